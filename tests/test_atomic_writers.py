"""The commands' writers are atomic: a crash while writing leaves the previous output whole.

For an IREE export, a search report and the plots, the final rename of one
output file is made to fail (an exception, or a SIGKILL in a child process);
the previous files must read back byte for byte, and no temporary may be left
once :func:`~pockjax.io.atomic.remove_stale_temporaries` has run (as the
commands do at their start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pockjax.io import atomic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Crash(Exception):
    """Stands for the process dying at the rename."""


def _crash_at(monkeypatch, name: str, attempted: dict | None = None) -> None:
    """Makes every rename onto a file called ``name`` fail (``attempted[name]``: what it would have written)."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)) == name:
            if attempted is not None:
                with open(src, "rb") as f:
                    attempted[name] = f.read()
            raise Crash(f"crash while writing {name}")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def _snapshot(directory) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, directory)] = open(p, "rb").read()
    return out


def _no_temporaries(directory) -> None:
    atomic.remove_stale_temporaries(directory)
    left = [os.path.join(r, n) for r, ds, fs in os.walk(directory) for n in ds + fs if atomic.is_temporary(n)]
    assert left == []


# -- export ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_export():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _iree_steps as S

    fs = S.mlp_step()
    old = [np.asarray(w) for w in fs.flat_state()]
    new = [w + np.asarray(1, w.dtype) for w in old]
    return S.compiled("mlp", "cpu"), old, new


@pytest.mark.iree
@pytest.mark.parametrize("last", ["weights.irpa", "module.vmfb", "module.json"])
def test_export_that_fails_mid_way_keeps_the_previous_export(mlp_export, tmp_path, monkeypatch, last):
    from pockjax import runtime
    from pockjax.backends.iree import export_module

    compiled, old, new = mlp_export
    out = tmp_path / "mlp"
    export_module(compiled, out, weights=old, extra={"run": "old"})
    before = _snapshot(out)
    _crash_at(monkeypatch, last)
    with pytest.raises(Crash):
        export_module(compiled, out, weights=new, extra={"run": "new"})
    monkeypatch.undo()
    assert _snapshot(out) == before
    _no_temporaries(tmp_path)
    assert os.listdir(tmp_path) == ["mlp"]
    assert json.loads((out / "module.json").read_text())["extra"]["run"] == "old"
    runtime.load(out)  # the checksum in the metadata matches the module
    names = [s.name for s in compiled.metadata.inputs]
    back = runtime.load_weights(out / "weights.irpa")
    np.testing.assert_array_equal(back[names[0]], old[0])


@pytest.mark.iree
def test_killed_export_leaves_the_previous_export_and_a_stale_temporary(mlp_export, tmp_path):
    from pockjax.backends.iree import export_module

    compiled, old, new = mlp_export
    out = tmp_path / "mlp"
    export_module(compiled, out, weights=old, extra={"run": "old"})
    before = _snapshot(out)
    (tmp_path / "module.vmfb").write_bytes(compiled.vmfb)
    (tmp_path / "meta.json").write_text(json.dumps(compiled.metadata.to_json()))
    np.savez(tmp_path / "new.npz", *new)
    script = textwrap.dedent("""
        import json, os, signal, sys
        import numpy as np
        from pockjax.backends.iree import export_module
        from pockjax.backends.iree.executable import CompiledModule
        from pockjax.runtime.metadata import ModuleMetadata
        d = sys.argv[1]
        meta = ModuleMetadata.from_json(json.load(open(os.path.join(d, "meta.json"))))
        compiled = CompiledModule(open(os.path.join(d, "module.vmfb"), "rb").read(), meta, "", 0.0)
        weights = list(np.load(os.path.join(d, "new.npz")).values())
        real = os.replace
        def replace(src, dst, *a, **k):
            if os.path.basename(dst) == "module.json":
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst, *a, **k)
        os.replace = replace
        export_module(compiled, os.path.join(d, "mlp"), weights=weights, extra={"run": "new"})
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert _snapshot(out) == before
    assert any(atomic.is_temporary(n) for n in os.listdir(tmp_path))  # the half-built export
    # the next export (any command writing there) starts by removing it
    export_module(compiled, out, weights=new, extra={"run": "new"})
    assert not any(atomic.is_temporary(n) for n in os.listdir(tmp_path))
    assert json.loads((out / "module.json").read_text())["extra"]["run"] == "new"


@pytest.mark.iree
def test_export_into_a_shared_directory_is_refused_rather_than_mixed(mlp_export, tmp_path, monkeypatch):
    """Beside other files, each file is replaced on its own and the old metadata goes first:
    an export that fails part way is refused by the runtime, never run with mixed files."""
    from pockjax import runtime
    from pockjax.backends.iree import export_module

    compiled, old, new = mlp_export
    out = tmp_path / "shared"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    export_module(compiled, out, weights=old, extra={"run": "old"})
    assert sorted(os.listdir(out)) == ["module.json", "module.vmfb", "notes.txt", "weights.irpa"]
    _crash_at(monkeypatch, "module.vmfb")
    with pytest.raises(Crash):
        export_module(compiled, out, weights=new, extra={"run": "new"})
    monkeypatch.undo()
    assert (out / "notes.txt").read_text() == "kept"
    _no_temporaries(tmp_path)
    with pytest.raises(runtime.ModuleError, match="no module metadata"):
        runtime.load(out)
    export_module(compiled, out, weights=new, extra={"run": "new"})
    assert json.loads((out / "module.json").read_text())["extra"]["run"] == "new"
    assert sorted(os.listdir(out)) == ["module.json", "module.vmfb", "notes.txt", "weights.irpa"]


# -- search report and plots ------------------------------------------------------------


_TINY = ["--model", "tiny", "--task", "uppercase", "--batch-size", "2", "--train-examples", "16",
         "--eval-examples", "2", "--reference-blocks", "1", "--proxy-batches", "1", "--no-progress", "--top", "0"]


@pytest.fixture(scope="module")
def search_out(tmp_path_factory):
    from pockjax.search.cli import main

    out = tmp_path_factory.mktemp("search") / "s"
    assert main([*_TINY, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", ["report.json", "units.tsv"])
def test_search_that_fails_writing_its_report_keeps_the_previous_one(search_out, tmp_path, monkeypatch, name):
    import shutil

    from pockjax import UpdateScheme
    from pockjax.schemes import save_scheme_file
    from pockjax.search.cli import SearchConfig, run_search

    out = tmp_path / "s"
    shutil.copytree(search_out, out)
    stale = out / "report.json.pockjax-tmp-999999999-00000000"
    stale.write_text('{"half": ')  # a run killed earlier
    before = _snapshot(out)
    del before[stale.name]
    attempted: dict = {}
    _crash_at(monkeypatch, name, attempted)
    # the smallest search (one candidate, wq of the last block, its own reference): it only has to
    # reach the writes, with a report other than the previous one
    reference = tmp_path / "reference.json"
    save_scheme_file(reference, UpdateScheme({"layers.1.attn.wq.kernel": "full"}))
    cfg = SearchConfig(model="tiny", task="uppercase", batch_size=2, train_examples=16, eval_examples=2,
                       kinds="wq", blocks="1", reference=str(reference), proxy_batches=1, out=str(out),
                       plot=False, progress=False, top=0, seed=1)
    with pytest.raises(Crash):
        run_search(cfg, log=lambda s: None)
    monkeypatch.undo()
    now = _snapshot(out)
    assert not stale.exists()  # removed at the start of the run
    assert attempted[name] != before[name]  # the crash was about to replace the previous file
    assert now[name] == before[name]
    json.loads(now["report.json"])  # whole
    _no_temporaries(out)


def test_plot_that_fails_keeps_the_previous_picture(search_out, tmp_path, monkeypatch):
    from pockjax.search.plot import plot_gain_vs_cost

    report = json.loads((search_out / "report.json").read_text())
    png = tmp_path / "gain_vs_cost.png"
    plot_gain_vs_cost(report, str(png))
    before = png.read_bytes()
    assert before[:8] == b"\x89PNG\r\n\x1a\n"
    report["units"] = report["units"][:3]
    _crash_at(monkeypatch, png.name)
    with pytest.raises(Crash):
        plot_gain_vs_cost(report, str(png))
    monkeypatch.undo()
    assert png.read_bytes() == before
    _no_temporaries(tmp_path)
    assert os.listdir(tmp_path) == [png.name]


def test_memory_timeline_that_fails_keeps_the_previous_pictures(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    from pockjax.memory import analyze, plot_timeline

    r = analyze(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)) @ x)(jnp.ones((16, 16))))
    written = plot_timeline(r, tmp_path / "t")
    before = _snapshot(tmp_path)
    assert sorted(before) == ["t.png", "t.svg"]
    _crash_at(monkeypatch, "t.png")  # the first of the two files
    with pytest.raises(Crash):
        plot_timeline(r, tmp_path / "t", before=r)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before and len(written) == 2
    _no_temporaries(tmp_path)


def test_bench_results_that_fail_keep_the_previous_ones(tmp_path, monkeypatch):
    from benchmarks.harness.common import BenchConfig
    from benchmarks.harness.runner import _write_results, summarize

    raw = [{"row": "torch-full", "phase": "speed", "step_times": [1.0], "losses": [1.0], "setup_s": 1.0,
            "train_peak_rss": 1}]
    res = summarize(raw, BenchConfig(model="tiny", batch=2, seq=8))
    _write_results(res, str(tmp_path))
    before = _snapshot(tmp_path)
    assert {"results.json", "results.md"} <= set(before)
    res["speed"]["torch-full"]["step_s"] = 2.0
    _crash_at(monkeypatch, "results.md")
    with pytest.raises(Crash):
        _write_results(res, str(tmp_path))
    monkeypatch.undo()
    assert _snapshot(tmp_path)["results.md"] == before["results.md"]
    _no_temporaries(tmp_path)

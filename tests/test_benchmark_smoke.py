"""Benchmarks run in a small configuration so they cannot rot."""

import importlib.util
import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_iree_vs_xla_tiny(tmp_path):
    out = tmp_path / "not-yet" / "ivx.json"  # made by the benchmark
    bench = _load("iree_vs_xla")
    assert bench.main(["--model", "tiny", "--schemes", "paper", "--blocks", "1", "--steps", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["xla_step_s"] > 0 and row["cpu_step_s"] > 0 and row["module_bytes"] > 10_000
    assert row["seq"] == 192  # the tiny model's default: its byte tokenizer needs 165 tokens


def test_iree_vs_xla_rejects_an_unwritable_output_before_compiling(tmp_path, capsys):
    import pytest

    bench = _load("iree_vs_xla")
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "tiny", "--schemes", "paper", "--json", str(tmp_path)])
    assert e.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_gpu_smoke_iree_prepare_into_a_file_is_a_one_line_error_before_compiling(tmp_path, capsys, monkeypatch):
    """``--iree-prepare DIR`` where DIR is a file, or lies under one: exit status 2
    and one line naming the file (no traceback), before anything is compiled."""
    import subprocess
    import sys

    blocker = tmp_path / "taken"
    blocker.write_text("mine")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--iree-prepare", str(blocker),
                           "--iree-target", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"gpu_smoke: cannot write into {blocker}: {blocker} is a file, not a directory;"
                           f" give --iree-prepare a directory (new or existing)\n")
    assert "Traceback" not in proc.stdout + proc.stderr and proc.stdout == ""
    smoke = _load("gpu_smoke")

    def compiled(*args, **kwargs):
        raise AssertionError("compiled before checking the output directory")

    monkeypatch.setattr(smoke, "_setup", compiled)
    assert smoke.main(["--iree-prepare", str(blocker / "sub" / "dir"), "--iree-target", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f": {blocker} is a file, not a directory" in err
    assert blocker.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["taken"]


@pytest.fixture(scope="module")
def iree_prepared(tmp_path_factory):
    """``gpu_smoke.py --iree-prepare`` for the host ``cpu`` target, once for the tests below."""
    out = tmp_path_factory.mktemp("iree")
    assert _load("gpu_smoke").main(["--iree-prepare", str(out), "--iree-target", "cpu"]) == 0
    return out


def test_gpu_smoke_iree_halves_match_and_catch_a_wrong_result(iree_prepared, tmp_path, capsys):
    """``gpu_smoke.py --iree-prepare`` / ``--iree-check`` (run on the H100 with
    ``cuda``), here with the host ``cpu`` target: the exported steps match XLA's
    reference, and a reference moved by about one AdamW update is a mismatch."""
    import shutil

    import numpy as np

    smoke = _load("gpu_smoke")
    tmp_path = tmp_path / "iree"
    shutil.copytree(iree_prepared, tmp_path)
    assert smoke.main(["--iree-check", str(tmp_path), "--iree-target", "cpu"]) == 0
    assert capsys.readouterr().out.count(" OK") == 2
    ref = dict(np.load(tmp_path / "reference.npz"))
    ref["paper/params/layers.1.attn.wq.kernel"][0, 0] += 1e-3  # AdamW's lr
    np.savez(tmp_path / "reference.npz", **ref)
    assert smoke.main(["--iree-check", str(tmp_path), "--iree-target", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "IREE cpu full:" in out and out.count("MISMATCH") == 1


def test_gpu_smoke_iree_check_fails_on_nan_and_explains_a_bad_directory(iree_prepared, tmp_path, capsys):
    """A NaN (from the GPU or in the reference) is a mismatch, not skipped by
    ``max``; a missing, corrupt or incomplete reference, a missing module and a
    module for another target are one-line errors (status 2) that say to run
    ``--iree-prepare`` again."""
    import os
    import shutil

    import numpy as np

    smoke = _load("gpu_smoke")

    def check(mutate, target="cpu"):
        d = tmp_path / f"case{len(os.listdir(tmp_path))}"
        shutil.copytree(iree_prepared, d)
        mutate(d)
        return smoke.main(["--iree-check", str(d), "--iree-target", target])

    def edit(fn):
        def mutate(d):
            ref = dict(np.load(d / "reference.npz"))
            fn(ref)
            np.savez(d / "reference.npz", **ref)
        return mutate

    capsys.readouterr()
    assert check(edit(lambda r: r["paper/params/layers.1.attn.wq.kernel"].__setitem__((0, 0), np.nan))) == 1
    assert check(edit(lambda r: r.__setitem__("paper/loss1", np.float32(np.nan)))) == 1
    assert capsys.readouterr().out.count("MISMATCH") == 2
    assert check(edit(lambda r: r.__setitem__("full/params/norm.scale", np.float32(1.0)))) == 1
    assert "in the reference" in capsys.readouterr().out  # a scalar does not broadcast against the tensor
    for mutate, says in [(lambda d: shutil.rmtree(d), "run --iree-prepare"),
                         (lambda d: os.unlink(d / "reference.npz"), "run --iree-prepare"),
                         (lambda d: (d / "reference.npz").write_bytes(b"garbage"), "not a readable reference"),
                         (edit(lambda r: r.pop("full/loss2")), "lacks ['full/loss2']"),
                         (lambda d: os.unlink(d / "full" / "module.json"), "no module metadata"),
                         (lambda d: None, "compiled for target 'cpu', not 'vulkan'")]:
        assert check(mutate, "vulkan" if "vulkan" in says else "cpu") == 2, says
        err = capsys.readouterr().err
        assert says in err and "--iree-prepare" in err and "Traceback" not in err
    assert not [n for n in os.listdir(iree_prepared) if ".pockjax-" in n]  # the reference went in atomically

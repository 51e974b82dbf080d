"""Benchmarks run in a small configuration so they cannot rot."""

import importlib.util
import json
import pathlib

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


def test_gpu_smoke_iree_halves_match_and_catch_a_wrong_result(tmp_path, capsys):
    """``gpu_smoke.py --iree-prepare`` / ``--iree-check`` (run on the H100 with
    ``cuda``), here with the host ``cpu`` target: the exported steps match XLA's
    reference, and a reference moved by about one AdamW update is a mismatch."""
    import numpy as np

    smoke = _load("gpu_smoke")
    assert smoke.main(["--iree-prepare", str(tmp_path), "--iree-target", "cpu"]) == 0
    assert smoke.main(["--iree-check", str(tmp_path), "--iree-target", "cpu"]) == 0
    assert capsys.readouterr().out.count(" OK") == 2
    ref = dict(np.load(tmp_path / "reference.npz"))
    ref["paper/params/layers.1.attn.wq.kernel"][0, 0] += 1e-3  # AdamW's lr
    np.savez(tmp_path / "reference.npz", **ref)
    assert smoke.main(["--iree-check", str(tmp_path), "--iree-target", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "IREE cpu full:" in out and out.count("MISMATCH") == 1

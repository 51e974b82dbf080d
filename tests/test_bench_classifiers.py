"""``pockjax bench --workload mobilenetv2 | minilm`` in a tiny configuration, so it cannot rot.

Each workload runs one PyTorch row and one pockjax row as the real benchmark does
(one process each, pretrained weights, the shipped data) on tiny sizes: 32x32
images or 16 tokens, batch 4, one warm-up and two timed steps, one quality step
scored on 8 held-out examples. One of the two rows is timed and the other scored,
crossed between the workloads, so that each phase runs for each framework and
each workload in two processes (each process imports PyTorch or JAX and reads
the pretrained weights: most of this file's time). The checks are about the harness (results files
written, every figure present and finite), not about speed. The last test checks
that the default workload is still the LLaMA benchmark with its old defaults.
"""

import json
import math
import os

import pytest

from benchmarks.harness.classifier_rows import ClassifierBenchConfig
from benchmarks.harness.classifier_runner import run_classifier

TINY = dict(batch=4, image_size=32, seq=16, warmup=1, steps=2, quality_steps=1, eval_examples=8)
CASES = {"mobilenetv2": (["pockjax-paper"], ["torch-bias-only"]),  # (speed rows, quality rows)
         "minilm": (["torch-lora"], ["pockjax-bias-only"])}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.parametrize("workload", list(CASES))
def test_classifier_workload_smoke(workload, tmp_path):
    rows, quality_rows = CASES[workload]
    res = run_classifier(ClassifierBenchConfig(workload=workload, **TINY), rows=rows, reps=1,
                         quality_rows=quality_rows, out=str(tmp_path), timeout=600, progress=False)
    for name in ("results.json", "results.md", "results.png"):
        assert os.path.getsize(tmp_path / name) > 0, name
    with open(tmp_path / "results.json") as f:
        on_disk = json.load(f)
    assert on_disk["workload"] == res["workload"] == workload and on_disk["config"]["batch"] == 4
    for name in rows:
        s = on_disk["speed"][name]
        assert not s["errors"], s["errors"]
        assert len(s["step_times"]) == TINY["steps"]
        for key in ("step_s", "per_s", "train_peak_rss", "trainable_params"):
            assert _finite(s[key]) and s[key] > 0, (name, key, s[key])
    for name in quality_rows:
        q = on_disk["quality"][name]
        assert q["error"] is None, q["error"]
        assert q["steps"] == TINY["quality_steps"] and q["eval_examples"] == TINY["eval_examples"]
        assert 0.0 <= q["accuracy"] <= 1.0 and _finite(q["final_loss"])
    table = (tmp_path / "results.md").read_text()
    unit = "images/s" if workload == "mobilenetv2" else "tokens/s"
    assert unit in table and all(f"| {n} |" in table for n in rows)
    assert "failed" not in table and "nan" not in table


def _bench_args(*flags):
    from pockjax.cli import build_parser

    return build_parser().parse_args(["bench", *flags])


def test_llama_workload_keeps_its_defaults():
    from benchmarks.harness.cli import classifier_config, llama_config
    from benchmarks.harness.common import BenchConfig

    args = _bench_args()
    assert args.workload == "llama"
    assert llama_config(args) == BenchConfig()  # the LLaMA benchmark as before --workload
    assert llama_config(_bench_args("--workload", "llama", "--batch", "8")).batch == 8
    mnv2 = classifier_config(_bench_args("--workload", "mobilenetv2"))
    assert (mnv2.batch, mnv2.image_size, mnv2.eval_examples, mnv2.lr) == (32, 224, 500, 1e-3)
    minilm = classifier_config(_bench_args("--workload", "minilm", "--batch-size", "8"))
    assert (minilm.batch, minilm.seq, minilm.lr) == (8, 128, 1e-4)

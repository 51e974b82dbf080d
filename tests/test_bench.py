"""The side-by-side benchmark (``pockjax bench``) in a small configuration, so it cannot rot.

The rows run as in the real benchmark (one process each), on the tiny model: a few
steps, a few held-out examples. The checks are about the harness being right (same
weights and batches in every row, same updates where two rows train the same
tensors, results files complete), not about speed.
"""

import json
import os

import pytest

from benchmarks.harness import BenchConfig, ROWS
from benchmarks.harness.runner import markdown_table, run, summarize

TINY = dict(model="tiny", batch=2, seq=192, warmup=1, steps=2, quality_steps=3, quality_batch=4,
            eval_examples=4)


def _raw(results, phase, row):
    return [r for r in results["raw"] if r["phase"] == phase and r["row"] == row]


def _tiny_forward_matmul_flops(one_piece_attention: bool = False) -> float:
    """Matrix-product FLOPs of one forward pass of the tiny model on a TINY batch
    (with ``one_piece_attention``, every query against every key, as PyTorch's
    counter counts its attention; pockjax skips the masked query blocks)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import pockjax
    from benchmarks.harness.common import random_config
    from pockjax.models import llama

    config = random_config("tiny")
    if one_piece_attention:
        config = config.replace(attn_block_rows=None)
    graphdef, params = llama.split(llama.Llama(config, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((TINY["batch"], TINY["seq"]), jnp.int32)
    return pockjax.count_flops(jax.make_jaxpr(lambda p, t: llama.apply(graphdef, p, t))(params, tokens),
                               matmul_only=True)


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = run(BenchConfig(**TINY), rows=["jax-full", "pockjax-full", "pockjax-paper"], reps=1,
              quality_rows=["jax-frozen", "pockjax-paper"], out=str(out), timeout=600, progress=False)
    return res, out


def test_rows_ran_and_results_written(tiny_results):
    res, out = tiny_results
    for name in ("results.json", "results.md", "results.png"):
        assert os.path.getsize(out / name) > 0, name
    with open(out / "results.json") as f:
        assert json.load(f)["config"]["model"] == "tiny"
    for name in ("jax-full", "pockjax-full", "pockjax-paper"):
        s = res["speed"][name]
        assert not s["errors"], s["errors"]
        assert len(s["step_times"]) == 2 and all(t > 0 for t in s["step_times"])
        assert s["train_peak_rss"] > 0 and s["tokens_per_s"] > 0
        assert [r["rep"] for r in _raw(res, "speed", name)] == [0]  # its round, for --history
    table = (out / "results.md").read_text()
    for name in ("jax-full", "pockjax-full", "pockjax-paper", "jax-frozen"):
        assert f"| {name} |" in table
    assert res["speed"]["pockjax-paper"]["trainable_params"] < res["speed"]["pockjax-full"]["trainable_params"]


def test_rows_count_their_matmul_flops(tiny_results):
    """Each speed row reports the matrix-product FLOPs of its step: plain JAX's full
    step does every product of the forward pass three times (forward, activation
    gradient, weight gradient); pockjax's answer-window loss and the sparse scheme
    each remove some."""
    res, _ = tiny_results
    forward = _tiny_forward_matmul_flops()
    flops = {n: res["speed"][n]["step_flops"] for n in ("jax-full", "pockjax-full", "pockjax-paper")}
    assert flops["jax-full"] == pytest.approx(3 * forward, rel=1e-9)
    assert 0 < flops["pockjax-paper"] < flops["pockjax-full"] < flops["jax-full"]
    for name, f in flops.items():
        s = res["speed"][name]
        assert s["gflop_per_s"] == pytest.approx(f / 1e9 / s["step_s"])
    table = markdown_table(res)
    assert f"| {flops['jax-full'] / 1e9:.1f} |" in table


def test_every_row_starts_from_the_same_weights_and_batch(tiny_results):
    res, _ = tiny_results
    first = {n: _raw(res, "speed", n)[0]["losses"][0] for n in ("jax-full", "pockjax-full", "pockjax-paper")}
    ref = first["jax-full"]
    assert all(abs(v - ref) < 1e-4 for v in first.values()), first


def test_plain_jax_frozen_and_pockjax_paper_train_the_same_update(tiny_results):
    """Both train the paper scheme's tensors with AdamW on the same batches: the
    losses of every quality step agree, and so does the held-out score."""
    res, _ = tiny_results
    a = _raw(res, "quality", "jax-frozen")[0]
    b = _raw(res, "quality", "pockjax-paper")[0]
    assert len(a["losses"]) == len(b["losses"]) == 3
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-4
    assert a["losses"][-1] < a["losses"][0]
    qa, qb = res["quality"]["jax-frozen"], res["quality"]["pockjax-paper"]
    assert qa["total"] == qb["total"] == 4 and 0.0 <= qa["accuracy"] <= 1.0
    assert qa["predictions"] == qb["predictions"]


def test_pytorch_rows_match_pockjax(tmp_path, tiny_results):
    # With MKL's vendor check answered "Intel" (a no-op on Intel CPUs), as the
    # rows run with --torch-mkl-any-cpu: the shim is loaded in their processes.
    # The quality phase's data does not depend on the speed steps, so torch-sparse is
    # compared with the pockjax-paper quality row of tiny_results (same model, same batches).
    res = run(BenchConfig(**{**TINY, "steps": 1, "torch_mkl_any_cpu": True}), rows=["torch-full", "torch-lora"],
              reps=1, quality_rows=["torch-sparse"], out=str(tmp_path), timeout=600, progress=False)
    pockjax_res = tiny_results[0]
    for name in ("torch-full", "torch-lora"):
        assert not res["speed"][name]["errors"], res["speed"][name]["errors"]
        assert res["speed"][name]["mkl_vendor_shim"] is True
    assert res["speed"]["torch-lora"]["trainable_params"] < res["speed"]["torch-full"]["trainable_params"]
    # PyTorch's count of the full step: the products of a JAX step with attention
    # in one piece (3x the forward pass), but the CPU attention kernel's backward
    # recomputes the scores: 5 attention products instead of 4, so the two counts
    # differ by the cost of one.
    from benchmarks.harness.common import random_config

    c = random_config("tiny")
    b, t = TINY["batch"], TINY["seq"]
    forward = _tiny_forward_matmul_flops(one_piece_attention=True)
    assert forward > _tiny_forward_matmul_flops()  # pockjax's blocks skip masked products
    one_attention_product = 2 * b * c.n_heads * t * t * c.head_dim_ * c.n_layers
    assert res["speed"]["torch-full"]["step_flops"] == pytest.approx(3 * forward + one_attention_product, rel=1e-9)
    assert res["speed"]["torch-lora"]["step_flops"] > forward
    a = _raw(res, "quality", "torch-sparse")[0]["losses"]
    b = _raw(pockjax_res, "quality", "pockjax-paper")[0]["losses"]
    assert len(a) == len(b) == TINY["quality_steps"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    assert res["quality"]["torch-sparse"]["predictions"] == pockjax_res["quality"]["pockjax-paper"]["predictions"]


def test_precision_rows_hold_frozen_tensors_smaller_and_start_from_the_same_loss(tmp_path, tiny_results):
    """The precision rows: pockjax's paper step with its frozen tensors in bf16
    or int4 blocks (as ``pockjax finetune --dtype`` / ``--quantize``), and PEFT
    under PyTorch's bf16 autocast (three of the five rows, one process each:
    the int8 path is the int4 one with another block format, and autocast is
    the same for the full row). Each holds fewer bytes than the fp32 step, and
    each first loss (same weights, same batch) is the fp32 one within the
    precision's error."""
    from benchmarks.harness.rows import DEFAULT_ROWS, PRECISION_ROWS, QUALITY_ROWS
    from pockjax.memory import format_bytes

    assert set(PRECISION_ROWS) == {"torch-full-bf16", "torch-lora-bf16", "pockjax-paper-bf16",
                                   "pockjax-paper-int8", "pockjax-paper-int4", "pockjax-paper-int8-bf16"}
    assert not set(PRECISION_ROWS) & (set(DEFAULT_ROWS) | set(QUALITY_ROWS))  # opt-in (--rows)
    rows = ["torch-lora-bf16", "pockjax-paper-bf16", "pockjax-paper-int4"]
    res = run(BenchConfig(**{**TINY, "steps": 1, "quality_steps": 0}), rows=rows, reps=1,
              out=str(tmp_path), timeout=600, progress=False)
    fp32 = tiny_results[0]["speed"]["pockjax-paper"]
    for name in rows:
        s = res["speed"][name]
        assert not s["errors"], s["errors"]
        assert s["first_loss"] == pytest.approx(fp32["first_loss"], rel=2e-3), name
    held = {n: res["speed"][f"pockjax-paper-{n}"]["weights_bytes"] for n in ("bf16", "int4")}
    assert fp32["weights_bytes"] > held["bf16"] > held["int4"] > 0, (fp32["weights_bytes"], held)
    table = (tmp_path / "results.md").read_text()
    assert "fp32 unless the row says otherwise" in table
    assert f"pockjax-paper-int4 {format_bytes(held['int4'])}" in table
    with pytest.raises(ValueError, match="no quality phase here"):
        run(BenchConfig(**TINY), rows=[], quality_rows=["pockjax-paper-int8"], out=str(tmp_path))


def test_precision_rows_hold_what_finetune_holds():
    """Each pockjax precision row holds the frozen tensors as ``pockjax finetune``
    does for the same flags, and computes as it does on this backend."""
    import jax
    from flax import nnx

    from benchmarks.harness.common import random_config
    from benchmarks.harness.rows import ROWS, _held_precision, _scheme
    from pockjax import quant
    from pockjax.models import llama

    config = random_config("tiny")
    cfg = BenchConfig(**TINY)
    params = llama.split(llama.Llama(config, rngs=nnx.Rngs(0)))[1]
    scheme = _scheme("paper", config, cfg)
    frozen_w, trained_w = "layers.0.mlp.w2.kernel", "layers.0.attn.wq.kernel"
    trained = {p for p, _ in scheme.rules}
    assert trained_w in trained and frozen_w not in trained
    for row, (qtype, other, compute) in {"pockjax-paper-int8": ("q8_0", "float32", None),
                                         "pockjax-paper-int4": ("q4_1", "float32", None),
                                         "pockjax-paper-int8-bf16": ("q8_0", "bfloat16", None),
                                         "pockjax-paper-bf16": ("bf16", "bfloat16", None)}.items():
        held, policy = _held_precision(params, config, scheme, ROWS[row].options["precision"])
        flat = llama.flatten_params(held)
        assert quant.is_qtensor(flat[frozen_w]) and flat[frozen_w].qtype == qtype, row
        assert flat["layers.0.attn_norm.scale"].dtype.name == other, row  # a frozen vector
        assert flat[trained_w].dtype.name == "float32" and not quant.is_qtensor(flat[trained_w]), row
        assert policy == compute and jax.default_backend() == "cpu"  # bf16 products on a GPU only
    with pytest.raises(ValueError, match="unknown row precision"):
        _held_precision(params, config, scheme, "int3")


def test_an_interrupted_run_writes_the_rows_that_finished(tmp_path, monkeypatch):
    """Ctrl-C (or ``timeout -s INT``) during a row keeps every run that finished."""
    from benchmarks.harness import runner

    real, calls = runner._run_job, []

    def interrupt_second(*args, **kwargs):
        calls.append(args[0]["row"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_run_job", interrupt_second)
    cfg = BenchConfig(**{**TINY, "steps": 1, "quality_steps": 0})
    with pytest.raises(runner.BenchInterrupted) as e:
        run(cfg, rows=["pockjax-paper", "pockjax-full"], reps=1, out=str(tmp_path / "a"), progress=False)
    assert e.value.written and calls == ["pockjax-paper", "pockjax-full"]
    with open(tmp_path / "a" / "results.json") as f:
        saved = json.load(f)
    assert saved["interrupted"] is True and list(saved["speed"]) == ["pockjax-paper"]
    assert "INTERRUPTED: this run was cut short" in (tmp_path / "a" / "results.md").read_text()
    assert not saved["speed"]["pockjax-paper"]["errors"]
    calls.clear()
    calls.append("none yet")  # the next row is the second call: interrupted before any run finished
    with pytest.raises(runner.BenchInterrupted) as e:
        run(cfg, rows=["pockjax-paper"], reps=1, out=str(tmp_path / "b"), progress=False)
    assert not e.value.written and not os.path.exists(tmp_path / "b" / "results.json")


def test_torch_flop_counter_counts_grouped_query_attention_kernels():
    """The FLOP counter of the PyTorch rows counts a fused attention kernel given
    fewer key/value heads than query heads (GQA) as the same kernel with the
    key/value heads repeated; PyTorch's own formula refused it before 2.12."""
    import torch
    import torch.nn.functional as F

    from benchmarks.harness.rows import _torch_flop_counter

    b, hq, hkv, t, d = 2, 8, 2, 16, 32
    q = torch.randn(b, hq, t, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, t, d, requires_grad=True) for _ in range(2))

    def count(k, v, **kw):
        with _torch_flop_counter() as counter:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw).sum().backward()
        return counter.get_total_flops()

    forward = 2 * (2 * b * hq * t * t * d)  # scores and the weighted sum
    grouped = count(k, v, enable_gqa=True)
    assert grouped == count(k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
    assert grouped >= 3 * forward  # the backward's products counted too


def test_goals_and_table_from_results():
    cfg = BenchConfig(model="tiny", batch=2, seq=8, quality_steps=5)

    def speed(row, t, rss):
        return {"row": row, "phase": "speed", "step_times": [t, t, t], "losses": [1.0], "setup_s": 1.0,
                "train_peak_rss": rss, "trainable_params": 10}

    raw = [speed("torch-full", 3.0, 100), speed("torch-lora", 2.0, 50), speed("pockjax-full", 2.5, 90),
           speed("pockjax-paper", 0.9, 60),
           {"row": "pockjax-full", "phase": "quality", "losses": [2.0, 1.0], "step_times": [1, 1],
            "eval": {"accuracy": 0.9, "correct": 9, "total": 10, "predictions": []}},
           {"row": "pockjax-paper", "phase": "quality", "losses": [2.0, 1.0], "step_times": [1, 1],
            "eval": {"accuracy": 0.85, "correct": 8, "total": 10, "predictions": []}}]
    res = summarize(raw, cfg)
    goals = {(g["row"], g["baseline"], g["what"]): g for g in res["goals"]}
    assert goals[("pockjax-paper", "torch-full", "speed")]["value"] == pytest.approx(3.0 / 0.9)
    assert goals[("pockjax-paper", "torch-full", "speed")]["met"] is True
    assert goals[("pockjax-full", "torch-full", "speed")]["met"] is False  # 1.2x < 1.3x
    assert goals[("pockjax-paper", "torch-lora", "memory")]["met"] is False  # 60 > 50
    assert goals[("pockjax-paper", "pockjax-full", "accuracy")]["value"] == pytest.approx(5.0)
    assert goals[("pockjax-paper", "pockjax-full", "accuracy")]["met"] is False
    assert res["speed"]["pockjax-paper"]["speedup_vs_torch_full"] == pytest.approx(3.0 / 0.9)
    table = markdown_table({**res, "machine": {"cpu": "x", "cores": 2}, "versions": {}})
    assert "3.33x" in table and "NOT met" in table and "85.0%" in table


def test_a_row_without_a_step_or_with_a_diverged_loss_is_null_in_results_json(tmp_path):
    """JSON has no NaN: a row whose every process failed has no step time (null,
    not NaN), a loss that is not finite is recorded as null, and the results
    are written as JSON that a strict reader loads."""
    from benchmarks.harness.classifier_rows import ClassifierBenchConfig, speed_summary
    from benchmarks.harness.common import timed_steps
    from benchmarks.harness.runner import _write_results
    from pockjax.io.jsonfile import read_json_object

    times, losses = timed_steps(lambda i: [2.0, float("nan"), float("-inf")][i], 1, 2)
    assert len(times) == 2 and losses == [2.0, None, None]
    raw = [{"row": "torch-full", "phase": "speed", "step_times": times, "losses": losses, "setup_s": 1.0,
            "train_peak_rss": 1},
           {"row": "pockjax-paper", "phase": "speed", "error": "Traceback ...\nRuntimeError: boom"}]
    res = summarize(raw, BenchConfig(model="tiny", batch=2, seq=8))
    failed = res["speed"]["pockjax-paper"]
    assert failed["step_s"] is None and failed["tokens_per_s"] is None and failed["speedup_vs_torch_full"] is None
    _write_results(res, str(tmp_path))
    back = read_json_object(tmp_path / "results.json")  # refuses NaN and Infinity
    assert back["speed"]["pockjax-paper"]["tokens_per_s"] is None
    assert back["speed"]["torch-full"]["first_loss"] == 2.0 and back["speed"]["torch-full"]["step_s"] > 0
    assert "| pockjax-paper |" in (tmp_path / "results.md").read_text()
    speed = speed_summary([{"row": "pockjax-paper", "phase": "speed", "error": "boom"}], ClassifierBenchConfig())
    assert speed["pockjax-paper"]["step_s"] is None and speed["pockjax-paper"]["per_s"] is None
    assert speed["pockjax-paper"]["images_per_s"] is None


def test_mkl_vendor_shim_answers_intel_and_a_missing_compiler_is_a_clear_error(tmp_path):
    import ctypes

    from benchmarks.harness.mkl import VendorShimError, build_vendor_shim, preload_env

    shim = build_vendor_shim(str(tmp_path / "shim"))
    assert ctypes.CDLL(shim).mkl_serv_intel_cpu_true() == 1
    assert preload_env({"LD_PRELOAD": "/x.so"}, shim)["LD_PRELOAD"] == f"{shim}:/x.so"
    with pytest.raises(VendorShimError, match="needs a C compiler.*no-such-cc"):
        build_vendor_shim(str(tmp_path / "none"), compiler="no-such-cc")


def test_table_says_how_pytorch_ran_its_matmuls_on_a_non_intel_cpu():
    cfg = BenchConfig(model="tiny", batch=2, seq=8)
    raw = [{"row": "torch-full", "phase": "speed", "step_times": [1.0], "losses": [1.0], "setup_s": 1.0,
            "train_peak_rss": 1, "torch_mkl": True, "mkl_vendor_shim": shim}
           for shim in (True, False)]
    res = summarize(raw, cfg)
    assert res["speed"]["torch-full"]["mkl_vendor_shim"] is False  # not in every process
    amd = {**res, "machine": {"cpu": "x", "cores": 2, "vendor": "amd"}, "versions": {}}
    assert "generic kernels" in markdown_table(amd)
    amd["speed"]["torch-full"]["mkl_vendor_shim"] = True
    assert "answered 'Intel'" in markdown_table(amd)
    intel = {**amd, "machine": {"cpu": "x", "cores": 2, "vendor": "intel"}}
    assert "MKL" not in markdown_table(intel)


def test_bad_rows_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark rows"):
        run(BenchConfig(**TINY), rows=["torch-fulll"], out=str(tmp_path))
    with pytest.raises(ValueError, match="nothing to run"):
        run(BenchConfig(**{**TINY, "quality_steps": 0}), rows=[], out=str(tmp_path))
    from pockjax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--rows", "nope", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert set(ROWS) >= {"torch-full", "torch-lora", "torch-sparse", "jax-full", "jax-frozen",
                         "pockjax-full", "pockjax-paper", "pockjax-norm-only", "pockjax-channels",
                         "pockjax-paper-iree"}


def test_duplicated_rows_and_quality_rows_without_steps_are_refused(tmp_path, capsys, monkeypatch):
    """A row named twice (it would run twice a round, or a quality row overwrite
    its own result) and ``--quality-rows`` without ``--quality-steps`` (silently
    no quality phase, and the whole default speed phase instead) exit with 2
    before anything runs."""
    import benchmarks.harness.classifier_runner as classifier_runner
    import benchmarks.harness.runner as runner
    from pockjax.cli import main

    def ran(*a, **k):
        raise AssertionError("the bench ran")

    monkeypatch.setattr(runner, "_prepare", ran)
    monkeypatch.setattr(classifier_runner, "prepare", ran)

    def code(argv):
        try:
            return main(["bench", "--model", "tiny", *argv, "--out", str(tmp_path / "out"), "--no-progress"])
        except SystemExit as e:
            return e.code

    for argv, says in [(["--rows", "pockjax-paper-int8,pockjax-paper,pockjax-paper-int8"],
                        "rows ['pockjax-paper-int8'] are given more than once"),
                       (["--rows", "none", "--quality-steps", "2", "--quality-rows", "pockjax-paper,pockjax-paper"],
                        "rows ['pockjax-paper'] are given more than once"),
                       (["--quality-rows", "pockjax-paper"], "--quality-rows needs --quality-steps"),
                       (["--workload", "minilm", "--rows", "pockjax-paper,pockjax-paper"], "more than once"),
                       (["--rows", "nope"], "pockjax bench: error: unknown rows ['nope']; rows: torch-full")]:
        assert code(argv) == 2, argv
        assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_every_spelling_of_no_rows_is_no_rows_for_both_checks(tmp_path, capsys, monkeypatch):
    """The values naming no rows (``cli.NO_ROWS``, one definition) give no rows,
    and a ``--quality-rows`` of no rows asks for no quality phase, so it needs no
    ``--quality-steps``."""
    import benchmarks.harness.runner as runner
    from benchmarks.harness.cli import NO_ROWS, _row_names
    from pockjax.cli import main

    class Ran(Exception):
        pass

    def fake_run(cfg, *, rows, quality_rows, **kwargs):
        raise Ran(rows, quality_rows)

    monkeypatch.setattr(runner, "run", fake_run)
    assert "none" in NO_ROWS and "" in NO_ROWS
    for text in NO_ROWS + tuple(f" {t} " for t in NO_ROWS):
        assert _row_names(text, ["pockjax-full"], ROWS, "") == []
        with pytest.raises(Ran) as e:
            main(["bench", "--model", "tiny", "--rows", "pockjax-paper", "--quality-rows", text,
                  "--out", str(tmp_path / "out"), "--no-progress"])
        assert e.value.args == (["pockjax-paper"], [])
    assert "--quality-steps" not in capsys.readouterr().err


def test_bench_outside_a_source_checkout_says_so_in_one_line(monkeypatch, capsys):
    """Installed without its checkout, ``pockjax bench`` (whatever its arguments) answers in one line."""
    import pockjax.cli

    monkeypatch.setattr(pockjax.cli, "_checkout_module", lambda name: None)
    for argv in (["bench"], ["bench", "--help"], ["bench", "--model", "tiny", "--rows", "jax-full"]):
        assert pockjax.cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "runs from a source checkout of pockjax" in err and "benchmarks/harness/" in err


def test_rows_too_short_for_the_task_are_a_clear_error(tmp_path, capsys):
    from benchmarks.harness.common import default_seq
    from pockjax.cli import main

    # the byte-level tiny model needs 165 tokens for the longest example
    assert default_seq("tiny") >= 165 and default_seq("smollm2-135m") == 128
    assert main(["bench", "--model", "tiny", "--seq", "64", "--rows", "pockjax-full",
                 "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "exceed seq_len=64" in err and "--seq" in err


def test_merge_combines_runs_and_refuses_different_settings(tiny_results, tmp_path):
    from benchmarks.harness.runner import merge

    res, out = tiny_results
    merged = merge([str(out / "results.json")], str(tmp_path / "m"))
    assert merged["speed"]["pockjax-paper"]["step_s"] == pytest.approx(res["speed"]["pockjax-paper"]["step_s"])
    assert merged["quality"]["pockjax-paper"]["accuracy"] == res["quality"]["pockjax-paper"]["accuracy"]
    assert (tmp_path / "m" / "results.md").read_text().count("| pockjax-paper |") == 1
    other = json.loads((out / "results.json").read_text())
    other["config"]["seed"] = 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different seed"):
        merge([str(out / "results.json"), str(tmp_path / "other.json")], str(tmp_path / "m2"))
    other["config"].update(seed=0, device="gpu")
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different device: 'cpu' vs 'gpu'"):
        merge([str(out / "results.json"), str(tmp_path / "other.json")], str(tmp_path / "m3"))


def test_gpu_table_summary_reports_gpu_memory(tmp_path):
    """On ``device="gpu"`` the memory column, the memory goal and the chart use
    each row's peak GPU memory, and the headline names the GPU."""
    from benchmarks.harness.runner import plot_results

    cfg = BenchConfig(model="llama-1b", device="gpu", batch=4, seq=192)

    def speed(row, t, gpu_bytes):
        return {"row": row, "phase": "speed", "step_times": [t, t], "losses": [1.0], "setup_s": 1.0,
                "train_peak_rss": 2**30, "device_peak_bytes": gpu_bytes, "trainable_params": 10}

    raw = [speed("torch-full", 0.30, 16 * 2**30), speed("torch-lora", 0.20, 6 * 2**30),
           speed("pockjax-paper", 0.08, 9 * 2**30)]
    res = summarize(raw, cfg)
    res["machine"].update(gpu="NVIDIA H100 80GB HBM3", gpu_memory_bytes=79 * 2**30)
    assert res["speed"]["torch-lora"]["device_peak_bytes"] == 6 * 2**30
    goals = {(g["row"], g["baseline"], g["what"]): g for g in res["goals"]}
    assert goals[("pockjax-paper", "torch-lora", "memory")]["value"] == pytest.approx(1.5)  # 9 / 6 GiB
    table = markdown_table(res)
    assert "peak GPU memory (GiB)" in table and "NVIDIA H100 80GB HBM3" in table
    assert "| 9.00 |" in table and "llama-1b (random weights)" in table
    assert plot_results(res, str(tmp_path / "gpu.png")) and (tmp_path / "gpu.png").stat().st_size > 0


def test_gpu_device_is_checked_before_any_row_runs(tmp_path):
    from benchmarks.harness.rows import default_rows
    from benchmarks.harness.runner import probe_gpu

    gpu = BenchConfig(**{**TINY, "device": "gpu"})
    with pytest.raises(ValueError, match=r"pockjax-paper-iree.*run on the CPU only"):
        run(gpu, rows=["pockjax-paper-iree"], out=str(tmp_path))
    assert "pockjax-paper-iree" not in default_rows("gpu") and "pockjax-paper" in default_rows("gpu")
    with pytest.raises(ValueError, match="unknown benchmark device 'tpu'"):
        BenchConfig(device="tpu")
    try:
        info = probe_gpu(gpu, timeout=120)
    except RuntimeError as e:  # the CPU-only machines the suite runs on
        assert "--device gpu needs an NVIDIA GPU" in str(e) and "--device cpu" in str(e)
    else:
        assert info["gpu"] and info["gpus"] >= 1

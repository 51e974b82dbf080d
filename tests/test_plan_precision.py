"""The memory planner under a precision policy: frozen weights in bf16 or block-quantized
(:mod:`pockjax.quant`), trained tensors and AdamW moments fp32 (``plan_precision``,
``pockjax plan --dtype/--quantize/--fits``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from pockjax.errors import PockjaxError
from pockjax.memory import analyze
from pockjax.memory.llama_plan import (
    PRECISIONS,
    check_precision,
    fit_table,
    plan_precision,
    plan_precisions,
)
from pockjax.models.llama import LlamaConfig
from pockjax.quant import BYTES_PER_VALUE

SEQ = 16


@pytest.fixture(scope="module")
def tiny_paper():
    return {p.name: p for p in plan_precisions(LlamaConfig.tiny(), "paper", seq=SEQ, blocks=1)}


def test_weight_bytes_order(tiny_paper):
    p = tiny_paper
    assert p["bf16+int4"].weight_bytes < p["bf16+int8"].weight_bytes < p["bf16"].weight_bytes < p["fp32"].weight_bytes
    # the liveness report counts them as held: weights live through the whole step, so the
    # peak drops by the same amount (the dequantized copy aside)
    for a, b in (("fp32", "bf16"), ("bf16", "bf16+int8"), ("bf16+int8", "bf16+int4")):
        saved = p[a].weight_bytes - p[b].weight_bytes
        assert p[a].inplace.peak_bytes - p[b].inplace.peak_bytes == saved
        assert p[a].inplace.peak_breakdown["weights"] - p[b].inplace.peak_breakdown["weights"] == saved
        assert p[a].peak_bytes > p[b].peak_bytes


def test_trained_stay_fp32_under_int4(tiny_paper):
    q, f = tiny_paper["bf16+int4"], tiny_paper["fp32"]
    assert q.trained_bytes == f.trained_bytes == 4 * q.trainable
    assert q.optimizer_bytes == f.optimizer_bytes > 0  # fp32 moments of the trained tensors
    trained = {path for path, fmt in f.held.items() if fmt == "fp32" and path.startswith("layers.1.")
               and not path.endswith("norm.scale") and not path.endswith("w2.kernel")}
    assert trained and all(q.held[path] == "fp32" for path in trained)
    # frozen matrices are q4_1 (codes and scales), frozen 1-D tensors bf16
    assert q.held["embed.embedding"] == q.held["lm_head.kernel"] == q.held["layers.0.mlp.w1.kernel"] == "q4_1"
    assert q.held["layers.1.mlp.w2.kernel"] == "q4_1"  # frozen by paper in a trained block
    assert q.held["norm.scale"] == q.held["layers.0.attn_norm.scale"] == "bf16"
    cfg = LlamaConfig.tiny()
    assert q.frozen_bytes["bf16"] == 2 * cfg.dim * (2 * cfg.n_layers + 1)
    n_q = sum(math.prod(r) for r in [(cfg.vocab, cfg.dim), (cfg.dim, cfg.vocab)])
    assert q.frozen_bytes["q4_1"] > n_q * BYTES_PER_VALUE["q4_1"]  # embedding, lm_head and more
    assert q.dequant_bytes == 2 * cfg.vocab * cfg.dim  # the largest frozen matrix, dequantized to bf16


def test_full_finetuning_keeps_everything_fp32():
    plans = plan_precisions(LlamaConfig.tiny(), "full", [("fp32", "none"), ("bf16", "int4")], seq=SEQ)
    fp32, q = plans
    assert q.frozen_bytes == {} and q.dequant_bytes == 0
    assert q.weight_bytes == fp32.weight_bytes == 4 * fp32.total
    assert q.peak_bytes == fp32.peak_bytes


def test_fp32_policy_matches_plain_fp32_plan():
    from pockjax.memory.llama_plan import plan_llama

    cfg = LlamaConfig.tiny()
    p = plan_precision(cfg, "paper", seq=SEQ)
    ref = plan_llama(cfg, "paper", seq=SEQ, dtype=jnp.float32)
    assert (p.program.peak_bytes, p.inplace.peak_bytes) == (ref.program.peak_bytes, ref.inplace.peak_bytes)


def test_in_bytes_overrides_input_sizes():
    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    cj = jax.make_jaxpr(lambda a, b: a * 2.0 + b)(x, x)
    plain = analyze(cj, fusion="none")
    small = analyze(cj, fusion="none", in_bytes=[100, None])
    assert plain.peak_bytes - small.peak_bytes == 1024 - 100
    assert small.input_bytes == 100 + 1024
    with pytest.raises(ValueError, match="in_bytes"):
        analyze(cj, in_bytes=[1])


def test_bad_precision_values():
    with pytest.raises(PockjaxError, match="quantize must be one of none, int8, int4; got 'int3'"):
        check_precision("bf16", "int3")
    with pytest.raises(PockjaxError, match="dtype must be one of fp32, bf16; got 'fp16'"):
        plan_precision(LlamaConfig.tiny(), "paper", dtype="fp16", seq=SEQ)
    assert check_precision("f32", "q4_1") == ("fp32", "int4")


@pytest.mark.parametrize("argv, message", [
    (["--quantize", "int3"], "argument --quantize: invalid choice: 'int3'"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--fits", "8,-1"], "pockjax plan: error: --fits: must be a finite number > 0, got '-1'"),
    (["--fits", ","], "pockjax plan: error: --fits must be a comma-separated list of GiB"),
])
def test_cli_refuses_bad_values(argv, message, capsys):
    from pockjax.cli import main

    try:
        rc = main(["plan", "--model", "tiny", *argv])
    except SystemExit as e:  # argparse's choices
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_quantize_with_mesh_is_refused(capsys):
    from pockjax.cli import main

    assert main(["plan", "--model", "tiny", "--quantize", "int8", "--devices", "2"]) == 2
    assert "--quantize" in capsys.readouterr().err


def test_cli_dtype_quantize_and_fits(capsys):
    from pockjax.cli import main

    assert main(["plan", "--model", "tiny", "--scheme", "paper", "--seq", str(SEQ), "--dtype", "bf16",
                 "--quantize", "int4", "--budget-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "bf16+int4:" in out and "q4_1" in out and "trained fp32" in out and "fits in 1 GiB" in out
    assert "activations counted at fp32" in out
    assert main(["plan", "--model", "tiny", "--scheme", "both", "--seq", str(SEQ), "--fits", "0.0008,1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "GiB |" not in line]
    assert len(rows) == 2 * len(PRECISIONS)
    assert all(row.endswith("| yes |") for row in rows)  # everything fits in 1 GiB
    # without --dtype/--quantize/--fits: as before (every tensor in one dtype)
    assert main(["plan", "--model", "tiny", "--scheme", "paper", "--seq", str(SEQ)]) == 0
    assert "f32, AdamW (moments in f32)" in capsys.readouterr().out
    # the old spelling of fp32
    assert main(["plan", "--model", "tiny", "--scheme", "paper", "--seq", str(SEQ), "--dtype", "f32"]) == 0
    assert "  fp32:" in capsys.readouterr().out


def test_fit_table_columns(tiny_paper):
    plans = list(tiny_paper.values())
    budget = (plans[-1].peak_bytes + plans[0].peak_bytes) / 2 / 2**30  # between bf16+int4 and fp32
    table = fit_table(plans, [budget, 1]).splitlines()
    assert table[0].endswith(f" {budget:g} GiB | 1 GiB |")
    fits = {line.split(" | ")[1]: line.split(" | ")[-2:] for line in table[2:]}
    assert fits["fp32"] == ["no", "yes |"] and fits["bf16+int4"] == ["yes", "yes |"]


def _gib(text: str) -> float:
    """A :func:`pockjax.memory.format_bytes` figure back in GiB ("6.45 GiB", "520.00 KiB")."""
    value, unit = text.split()
    return float(value) * {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 2**10}[unit]


@pytest.mark.slow
def test_7b_fit_table_from_shapes_in_a_fresh_process():
    """``pockjax plan --scheme both --fits 8,16,24`` on LLaMA-2-7B, in a fresh process: the scheme
    ``pockjax finetune`` trains, what fits on 8/16/24 GiB per precision, and a small RSS (planning
    allocates none of the 25 GiB of fp32 weights). Full fine-tuning in fp32 fits none; the paper
    scheme with bf16 + int4 frozen weights needs less than a third of it."""
    import sys

    from benchmarks._memory_rss import peak_rss_of_command

    # the command's own peak (a child's getrusage would start at the forking test worker's)
    r = peak_rss_of_command([sys.executable, "-m", "pockjax.cli", "plan", "--scheme", "both", "--fits", "8,16,24"],
                            timeout=600)
    assert r.returncode == 0, r.output
    out = r.output
    assert "[full]" in out and "[paper (last 11 blocks)]" in out
    assert "trainable: 6,738,415,616 of 6,738,415,616" in out
    assert "trainable: 1,730,150,400 of 6,738,415,616" in out  # wq/wk/wv/wo/w1/w3 of blocks 21-31
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("full", "paper (last 11 blocks)"):
            rows[(cells[0].split()[0], cells[1])] = cells
    assert set(rows) == {(s, p) for s in ("full", "paper") for p in ("fp32", "bf16", "bf16+int8", "bf16+int4")}
    full, q = rows[("full", "fp32")], rows[("paper", "bf16+int4")]
    # fp32 weights + two fp32 moments alone exceed 24 GiB: fits none of the devices
    assert full[2] == "none" and _gib(full[3]) + _gib(full[4]) > 24 and full[6:] == ["no", "no", "no"]
    peak = {p: _gib(rows[("paper", p)][5]) for p in ("fp32", "bf16", "bf16+int8", "bf16+int4")}
    assert peak["bf16+int4"] < peak["bf16+int8"] < peak["bf16"] < peak["fp32"]
    assert peak["bf16+int4"] < _gib(full[5]) / 3
    # everything the paper scheme trains stays fp32 (1.73 B parameters, weights and moments)
    assert _gib(q[3]) == pytest.approx(4 * 1_730_150_400 / 2**30, abs=0.01)
    assert _gib(q[4]) == pytest.approx(2 * _gib(q[3]), abs=0.01)
    assert q[2].startswith("q4_1 ")
    # a device that fits is never smaller than one that does not
    fits = [c == "yes" for c in q[6:]]
    assert fits == sorted(fits)
    assert r.peak_bytes < 2 * 2**30, "planning must not allocate the 25 GiB of fp32 weights"

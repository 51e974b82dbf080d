"""Tests of the memory passes (inplace_update, reorder_for_memory), memory_report and
the ``pockjax memory`` / ``pockjax plan`` commands."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax
from pockjax.memory import analyze, memory_report
from pockjax.memory.hlo import entry_schedule, update_positions
from pockjax.transforms.inplace_update import InplaceUpdateRecord, inplace_update, update_schedule
from pockjax.transforms.reorder_for_memory import ReorderForMemoryRecord, reorder_for_memory

STATE = {"param", "opt_state"}


def mlp_step(opt, width=256, depth=4, batch=8):
    def step(p, s, x):
        def loss(p):
            h = x
            for i in range(depth):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.sum(h**2)

        loss_value, g = jax.value_and_grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss_value

    keys = jax.random.split(jax.random.key(0), depth + 1)
    p = {f"w{i}": jax.random.normal(keys[i], (width, width)) / np.sqrt(width) for i in range(depth)}
    x = jax.random.normal(keys[-1], (batch, width))
    return step, (p, opt.init(p), x)


def llama_step(batch=2, seq=16, opt=None):
    from _transformer_program import transformer_step

    return transformer_step(batch, seq, opt)


def run(step, args, passes, scheme=None, donate=True):
    f = pockjax.compile(step, passes=passes, scheme=scheme, donate=donate)
    fresh = jax.tree.map(jnp.array, args)  # donated buffers are consumed
    return f(*fresh), f.lower(*args).compile()


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    chex.assert_trees_all_close(a, b, rtol=rtol, atol=atol)


def peak(graph):
    return analyze(graph, donate=STATE).peak_bytes


# -- inplace_update -------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: mlp_step(optax.adamw(1e-3)), lambda: llama_step()], ids=["mlp", "llama"])
def test_inplace_update_same_values_lower_peak(make):
    step, args = make()
    ref, _ = run(step, args, pockjax.dce())
    out, cs = run(step, args, pockjax.chain(pockjax.dce(), inplace_update()))
    assert_same(out, ref)
    g = pockjax.dce()(pockjax.trace_step(step, args))
    g2 = inplace_update()(g)
    assert peak(g2) <= peak(g)
    assert g2.record(InplaceUpdateRecord).barriers > 0
    assert g2.record(InplaceUpdateRecord).coupled == ()
    # the planner sees no more gradient bytes at the peak than before
    assert analyze(g2, donate=STATE).peak_breakdown["gradient"] <= analyze(g, donate=STATE).peak_breakdown["gradient"]


def test_update_schedule_is_topological_and_updates_follow_gradients():
    step, args = mlp_step(optax.adam(1e-3), width=16, depth=3)
    g = pockjax.trace_step(step, args)
    s = update_schedule(g.jaxpr)
    eqns = g.jaxpr.eqns
    assert sorted(s["order"]) == list(range(len(eqns)))
    seen = set(g.jaxpr.invars) | set(g.jaxpr.constvars)
    for i in s["order"]:
        assert all(isinstance(v, jax.extend.core.Literal) or v in seen for v in eqns[i].invars)
        seen.update(eqns[i].outvars)
    # three parameters, each with its own update group released during the backward pass
    assert len(s["cuts"]) >= 3


def test_inplace_order_holds_in_compiled_program():
    """Checked on the backend: XLA's scheduled HLO writes more parameter updates before
    the backward pass ends, and its temporary memory drops by about one gradient."""
    step, args = mlp_step(optax.adamw(1e-3))
    _, base = run(step, args, pockjax.dce())
    _, ours = run(step, args, pockjax.chain(pockjax.dce(), inplace_update()))
    rb, ro = memory_report(base), memory_report(ours)
    # every parameter but the first layer's (whose gradient completes last) is updated
    # while the backward pass still runs
    assert ro.hlo["n_params"] == 4
    assert ro.hlo["before_backward_end"] == 3
    assert ro.hlo["before_backward_end"] >= rb.hlo["before_backward_end"]
    grad_bytes = 256 * 256 * 4
    assert ro.xla["temp_size_in_bytes"] <= rb.xla["temp_size_in_bytes"] - 0.9 * grad_bytes
    # the barriers reached XLA (they are expanded into control dependencies before scheduling)
    hlo_in = ours.executable.jitted.lower(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ours.graph.in_avals]).as_text()
    assert "optimization_barrier" in hlo_in
    # without barriers only the jaxpr order changes, and XLA need not follow it
    _, nob = run(step, args, pockjax.chain(pockjax.dce(), inplace_update(barrier=False)))
    assert "optimization_barrier" not in nob.executable.jitted.lower(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in nob.graph.in_avals]
    ).as_text()


def test_global_norm_clipping_is_coupled_and_left_in_place():
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    step, args = mlp_step(opt, width=64)
    ref, _ = run(step, args, pockjax.dce())
    out, _ = run(step, args, pockjax.chain(pockjax.dce(), inplace_update()))
    assert_same(out, ref)
    g = pockjax.dce()(pockjax.trace_step(step, args))
    g2 = inplace_update()(g)
    record = g2.record(InplaceUpdateRecord)
    assert sorted(record.coupled) == ["w0", "w1", "w2", "w3"]
    assert record.barriers == 0  # (only the loss value and scalar norms are released early)
    # all gradients are still live together: no gain, and no loss
    grads = 4 * 64 * 64 * 4
    assert analyze(g2, donate=STATE).peak_breakdown["gradient"] >= grads - 64 * 4
    assert peak(g2) <= peak(g)


def test_inplace_update_with_sparse_scheme_and_sparse_state():
    step, args = llama_step(batch=2, seq=16)
    scheme = pockjax.UpdateScheme({"layers.1.*": "full", "layers.0.w1": "full"})
    tx = optax.adamw(1e-3)
    state = pockjax.init_opt_state(tx, args[0], scheme)
    args = (args[0], state, args[2])
    base = pockjax.chain(pockjax.sparse_grad(scheme, sparse_opt_state=True), pockjax.dce())
    ref, _ = run(step, args, base, scheme=scheme)
    out, cs = run(step, args, pockjax.chain(base, inplace_update(), reorder_for_memory()), scheme=scheme)
    assert_same(out, ref)
    assert cs.graph.pass_names[-3:] == ("inplace_update", "reorder_for_memory", "strip_tags")


def test_inplace_update_idempotent_and_noop_without_gradients():
    step, args = mlp_step(optax.sgd(0.1), width=16, depth=2)
    g = pockjax.dce()(pockjax.trace_step(step, args))
    once = inplace_update()(g)
    twice = inplace_update()(once)
    assert peak(twice) == peak(once)

    def no_grad(p, s, x):
        return jax.tree.map(lambda w: w * 0.5, p), s, x.sum()

    g = pockjax.trace_step(no_grad, args)
    assert inplace_update()(g).closed_jaxpr is g.closed_jaxpr


# -- reorder_for_memory ---------------------------------------------------------------


def test_reorder_same_values_and_never_worse():
    step, args = llama_step(batch=4, seq=32)
    ref, _ = run(step, args, pockjax.dce())
    g = pockjax.dce()(pockjax.trace_step(step, args))
    peaks = [peak(g)]
    for p in (inplace_update(), reorder_for_memory(), reorder_for_memory(remat_budget=1e9)):
        g = p(g)
        peaks.append(peak(g))
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), peaks
    record = g.record(ReorderForMemoryRecord)
    assert record.peak_after <= record.peak_before
    out, _ = run(step, args, pockjax.chain(pockjax.dce(), inplace_update(), reorder_for_memory(remat_budget=1e9)))
    assert_same(out, ref)


def test_remat_lowers_peak_under_budget_and_xla_agrees():
    step, args = llama_step(batch=8, seq=64)
    g = pockjax.dce()(pockjax.trace_step(step, args))
    free = reorder_for_memory(remat_budget=1e9)(g)
    record = free.record(ReorderForMemoryRecord)
    assert record.rematerialized > 0 and 0 < record.remat_flops <= 1e9
    assert record.peak_after < record.peak_reordered
    # a zero budget recomputes nothing
    assert reorder_for_memory(remat_budget=0)(g).record(ReorderForMemoryRecord).rematerialized == 0
    # a small budget recomputes fewer values
    small = reorder_for_memory(remat_budget=record.remat_flops / 4)(g).record(ReorderForMemoryRecord)
    assert small.rematerialized < record.rematerialized
    ref, base = run(step, args, pockjax.dce())
    out, cs = run(step, args, pockjax.chain(pockjax.dce(), reorder_for_memory(remat_budget=1e9)))
    assert_same(out, ref)
    # recomputation is not merged back by XLA: its temporaries shrink too
    assert cs.memory_analysis().temp_size_in_bytes < base.memory_analysis().temp_size_in_bytes


# -- memory_report and HLO reading ----------------------------------------------------


def test_memory_report_table_and_plot(tmp_path):
    step, args = llama_step(batch=2, seq=16)
    _, cs = run(step, args, pockjax.chain(pockjax.dce(), inplace_update()))
    r = memory_report(cs)
    assert 0.7 < r.ratio < 1.3
    assert r.before.peak_bytes >= r.after.peak_bytes
    text = r.table()
    assert "XLA temp" in text and "inplace_update" in text
    written = r.plot(tmp_path / "t", formats=("png",))
    assert [p.endswith(".png") for p in written] == [True]


def test_entry_schedule_parses_root_tuple():
    c = jax.jit(lambda x, y: (x + 1, y * 2, x.sum())).lower(jnp.ones(4), jnp.ones(3)).compile()
    s = entry_schedule(c.as_text())
    assert len(s.root_operands) == 3
    assert all(name in s.names for name in s.root_operands)
    assert update_positions(c, ["param", "param", "aux"])["n_params"] == 2


# -- command line ---------------------------------------------------------------------


def test_cli_memory_tiny(tmp_path, capsys):
    from pockjax.cli import main

    rc = main(["memory", "--model", "tiny", "--scheme", "paper", "--batch", "1", "--seq", "16", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "+ memory passes" in out and "XLA temp" in out
    assert (tmp_path / "memory_tiny_paper.png").exists()


def test_cli_plan_tiny_and_budget(capsys):
    from pockjax.cli import main

    assert main(["plan", "--model", "tiny", "--scheme", "both", "--seq", "32", "--budget-gb", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "[full]" in out and "[paper" in out and "does NOT fit in 0.001 GiB" in out
    assert main(["plan", "--model", "tiny", "--scheme", "norm-only", "--seq", "32", "--budget-gb", "1"]) == 0
    assert "fits in 1 GiB" in capsys.readouterr().out


def test_cli_plan_7b_prints_paper_figures(capsys):
    from pockjax.cli import main

    # two blocks of LLaMA-2-7B's shapes keep this quick; the paper's figures are printed
    # for the paper's setting (bf16, batch 1, seq 512) only
    assert main(["plan", "--model", "llama2-7b", "--layers", "2", "--scheme", "full", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert "43.1 GB" in out and "optimizer_state" in out

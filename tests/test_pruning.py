"""Pruning is real: FLOPs of the compiled step match an analytic count."""

from __future__ import annotations

import jax
import optax
import pytest

import pockjax
from pockjax.analysis import weight_grad_dots
from toy_models import Transformer, make_step

# Matmul-dominated: elementwise work is a few percent of the total.
MODEL = Transformer(vocab=128, dim=128, heads=4, hidden=256, layers=4, seq=32, batch_size=2)


def analytic_flops(m: Transformer, trained_blocks: int) -> float:
    """Forward of all blocks + head, backward of the last ``trained_blocks`` only.

    Only matmuls are counted. Each trained block's backward costs twice its
    forward (activation and weight gradients; the earliest trained block
    still needs the activation gradient through wq, wk, wv because its
    attention norm scale is trained). The frozen head still propagates the
    activation gradient (one matmul).
    """
    b, t, d, h, v = m.batch_size, m.seq, m.dim, m.hidden, m.vocab
    proj = 2 * b * t * d * d
    attn = 2 * (2 * b * t * t * d)  # scores and weighted sum
    mlp = 3 * 2 * b * t * d * h
    block = 4 * proj + attn + mlp
    head = 2 * b * t * d * v
    forward = m.layers * block + head
    if trained_blocks == 0:
        return forward
    backward = head + trained_blocks * 2 * block
    return forward + backward


def last_blocks_scheme(m: Transformer, k: int) -> pockjax.UpdateScheme:
    return pockjax.UpdateScheme({f"layers.{i}.**": "full" for i in range(m.layers - k, m.layers)})


@pytest.fixture(scope="module")
def setup():
    tx = optax.sgd(0.1)
    params = MODEL.init(jax.random.key(0))
    batch = MODEL.batch(jax.random.key(1))
    return tx, params, tx.init(params), batch


@pytest.mark.parametrize("k", [1, 2, 4])
def test_xla_flops_match_analytic_count(setup, k):
    tx, params, opt_state, batch = setup
    step = pockjax.compile(make_step(MODEL, tx), scheme=last_blocks_scheme(MODEL, k))
    compiled = step.lower(params, opt_state, batch).compile()
    xla_flops = compiled.cost_analysis()["flops"]
    expected = analytic_flops(MODEL, k)
    print(f"k={k}: XLA {xla_flops / 1e6:.1f} MFLOP, analytic {expected / 1e6:.1f} MFLOP")
    assert abs(xla_flops - expected) / expected < 0.10
    # and the jaxpr-level count agrees with XLA's
    assert abs(pockjax.count_flops(compiled.graph) - xla_flops) / xla_flops < 0.10


def test_frozen_blocks_leave_no_weight_gradient_dots(setup):
    tx, params, opt_state, batch = setup
    full = pockjax.trace_step(make_step(MODEL, tx), (params, opt_state, batch))
    # one weight-gradient dot per matmul weight: 7 per block, plus the head
    assert len(weight_grad_dots(full)) == 7 * MODEL.layers + 1
    for k in (1, 2):
        sparse = pockjax.dce()(pockjax.sparse_grad(last_blocks_scheme(MODEL, k))(full))
        assert len(weight_grad_dots(sparse)) == 7 * k
        # forward: 9 dots per block (4 projections, 2 attention, 3 MLP) + head;
        # backward: the head's input gradient + 18 per trained block
        dots = pockjax.count_primitives(sparse)["dot_general"]
        assert dots == 9 * MODEL.layers + 1 + 1 + k * 18


def test_backward_stops_at_the_earliest_trained_weight(setup):
    tx, params, opt_state, batch = setup
    full = pockjax.trace_step(make_step(MODEL, tx), (params, opt_state, batch))
    # Train only the matmul weights of the last block, not its norms: the
    # gradient w.r.t. that block's input (3 dots through wq, wk, wv) is dead.
    scheme = pockjax.UpdateScheme({"layers.3.attn.*.kernel": "full", "layers.3.mlp.*.kernel": "full"})
    sparse = pockjax.dce()(pockjax.sparse_grad(scheme)(full))
    assert pockjax.count_primitives(sparse)["dot_general"] == 9 * MODEL.layers + 2 + 18 - 3


def test_channel_rule_reduces_weight_gradient_flops(setup):
    tx, params, opt_state, batch = setup
    full = pockjax.trace_step(make_step(MODEL, tx), (params, opt_state, batch))
    base = pockjax.UpdateScheme({"layers.3.mlp.w1.kernel": "full"})
    quarter = pockjax.UpdateScheme({"layers.3.mlp.w1.kernel": pockjax.channels(0.25)})
    g_full = pockjax.dce()(pockjax.sparse_grad(base)(full))
    g_quarter = pockjax.dce()(pockjax.sparse_grad(quarter)(full))
    (dot_full,) = weight_grad_dots(g_full)
    (dot_quarter,) = weight_grad_dots(g_quarter)
    f_full = pockjax.analysis.eqn_flops(dot_full)
    f_quarter = pockjax.analysis.eqn_flops(dot_quarter)
    # the weight-gradient dot has the reduced shape: a quarter of the output channels
    assert sorted(dot_quarter.outvars[0].aval.shape) == sorted((MODEL.dim, MODEL.hidden // 4))
    assert f_quarter == pytest.approx(f_full / 4)
    saved = pockjax.count_flops(g_full) - pockjax.count_flops(g_quarter)
    assert saved >= 0.7 * (f_full - f_quarter)


def test_summary_reports_pruned_ops_and_flops(setup):
    tx, params, opt_state, batch = setup
    step = pockjax.compile(make_step(MODEL, tx), scheme=last_blocks_scheme(MODEL, 1))
    summary = step.summary(params, opt_state, batch)
    assert summary.eqns_after < summary.eqns_before
    assert summary.flops_after < 0.6 * summary.flops_before
    text = str(summary)
    assert "FLOPs" in text and "dot_general" in text

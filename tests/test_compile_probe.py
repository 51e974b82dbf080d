"""Adversarial steps found by probing ``pockjax.compile`` against ``jax.jit`` / ``nnx.jit``.

Each test pins a case where the compiled step used to differ from the
reference without a word; it must now either match or refuse clearly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import pockjax


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 6, rngs=rngs)
        self.l2 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _nnx_metrics_step(model, optimizer, metrics, x, y):
    """The Flax NNX tutorial's step: it updates a ``MultiMetric`` in place."""
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)
    return loss


@pytest.mark.parametrize("scheme", [None, pockjax.UpdateScheme({"l2.*": "full"})])
def test_nnx_object_in_the_batch_is_refused_not_dropped(scheme):
    # nnx.jit keeps the metrics' update; a compiled step used to return the loss and
    # leave the metrics object at count 0 (its average NaN) without a word
    model = _Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param if scheme is None else scheme.nnx_wrt())
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    step = pockjax.compile(_nnx_metrics_step, scheme=scheme)
    with pytest.raises(pockjax.PockjaxError, match=r"_nnx_metrics_step: argument 2 holds an NNX object \(MultiMetric\)"):
        step(model, optimizer, metrics, jnp.ones((5, 4)), jnp.zeros((5, 3)))


def test_nnx_object_in_a_functional_steps_batch_is_refused():
    tx = optax.sgd(0.1)

    def step(params, opt_state, rngs, x):
        noise = rngs.dropout.normal(x.shape)  # advances rngs' count in place
        loss, g = jax.value_and_grad(lambda p: jnp.sum((x + noise) @ p["w"]))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": jnp.ones((3, 2))}
    compiled = pockjax.compile(step)
    with pytest.raises(pockjax.PockjaxError, match=r"argument 2 holds an NNX object \(Rngs\)"):
        compiled(params, tx.init(params), nnx.Rngs(dropout=0), jnp.ones((4, 3)))


def test_a_pattern_shadowed_by_an_earlier_one_names_the_earlier_pattern():
    # {"a.*": full, "a.w": frozen} never freezes a.w (the first match wins); the
    # refusal used to say "'a.w' matches no parameter; closest paths: ['a.w', ...]"
    scheme = pockjax.UpdateScheme({"a.*": "full", "a.w": "frozen"})
    with pytest.raises(pockjax.UnmatchedPatternError) as err:
        scheme.resolve(["a.w", "a.b", "c.w"], [(4, 6), (6,), (6, 3)])
    assert "'a.w' matches ['a.w'], but an earlier pattern ('a.*') rules each of them" in str(err.value)
    assert "matches no parameter" not in str(err.value)

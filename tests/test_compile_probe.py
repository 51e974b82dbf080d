"""Adversarial steps probing ``pockjax.compile`` against ``jax.jit`` / ``nnx.jit``.

Each test pins a case where a compiled step could differ from the reference
without a word (most of them did, before their fix): it must match or refuse
clearly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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


def test_gradient_taken_inside_a_scan_is_zeroed_for_a_frozen_parameter_under_global_norm_clipping():
    """``jax.grad`` inside a ``lax.scan`` body, over parameters closed over from
    outside (gradient accumulation): the frozen parameter's gradient does not
    enter ``clip_by_global_norm``, as with jax.jit of the step with that gradient
    zeroed; without the freezing the trained parameter would move differently."""
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5))

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["a"] @ p["b"]) ** 2)

    def make(freeze_b):
        def step(p, s, xs):
            def body(acc, x):
                return jax.tree.map(jnp.add, acc, jax.grad(loss)(p, x)), None
            g, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), xs)
            if freeze_b:
                g = {"a": g["a"], "b": jnp.zeros_like(g["b"])}
            u, s = tx.update(g, s, p)
            new = optax.apply_updates(p, u)
            return ({"a": new["a"], "b": p["b"]} if freeze_b else new), s, None
        return step

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {"a": jax.random.normal(k[0], (4, 4)), "b": 3 * jax.random.normal(k[1], (4, 4))}
    xs = jax.random.normal(k[2], (3, 2, 4))
    f = pockjax.compile(make(False), scheme=pockjax.UpdateScheme({"a": "full", "b": "frozen"}))
    got = f(jax.tree.map(jnp.array, p), tx.init(p), xs)[0]
    want = jax.jit(make(True))(p, tx.init(p), xs)[0]
    unfrozen = jax.jit(make(False))(p, tx.init(p), xs)[0]
    np.testing.assert_allclose(got["a"], want["a"], rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(unfrozen["a"] - want["a"]))) > 1e-4  # the case tells the two apart
    np.testing.assert_array_equal(got["b"], p["b"])

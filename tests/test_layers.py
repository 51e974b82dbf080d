"""pockjax.models.layers.Dropout: 16 random bits per element, nnx.Dropout's behaviour otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax.models.layers import Dropout, keep_mask


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_fraction_and_expectation_are_exact(rate):
    mask, keep = keep_mask(jax.random.key(0), rate, (256, 129, 33))  # odd last axis
    assert mask.shape == (256, 129, 33) and mask.dtype == jnp.bool_
    assert keep == 1 - round(rate * 2**16) / 2**16
    n = mask.size
    assert abs(float(mask.mean()) - keep) < 4 * np.sqrt(keep * (1 - keep) / n)
    drop = Dropout(rate, rngs=nnx.Rngs(dropout=1))
    y = drop(jnp.ones((256, 129, 33)), deterministic=False)
    assert set(np.unique(np.asarray(y)).tolist()) == {0.0, np.float32(1 / keep)}
    assert abs(float(y.mean()) - 1.0) < 4 * np.sqrt((1 - keep) / keep / n)


def test_both_halves_of_a_word_are_independent_and_fresh_per_call():
    mask, _ = keep_mask(jax.random.key(3), 0.5, (4096, 64))
    m = np.asarray(mask, np.float64)
    lo, hi = m[:, :32].ravel(), m[:, 32:].ravel()  # the two 16-bit halves of the same words
    assert abs(np.corrcoef(lo, hi)[0, 1]) < 0.02
    drop = Dropout(0.5, rngs=nnx.Rngs(dropout=0))
    a, b = drop(jnp.ones((64, 64)), deterministic=False), drop(jnp.ones((64, 64)), deterministic=False)
    assert not np.array_equal(a, b)


def test_modes_shapes_and_fallbacks():
    x = jnp.arange(1.0, 7.0).reshape(2, 3)
    drop = Dropout(0.3, deterministic=True, rngs=nnx.Rngs(dropout=0))
    assert np.array_equal(drop(x), x)  # eval mode: identity
    assert drop(jnp.float32(2.0), deterministic=False).shape == ()  # a scalar
    assert np.array_equal(Dropout(1.0, rngs=nnx.Rngs(0))(x, deterministic=False), jnp.zeros_like(x))
    rows = Dropout(0.5, broadcast_dims=(1,), rngs=nnx.Rngs(dropout=2))(jnp.ones((64, 5)), deterministic=False)
    assert all(len(set(r.tolist())) == 1 for r in np.asarray(rows))  # nnx.Dropout's broadcast mask
    with pytest.raises(TypeError, match="needs rngs"):
        Dropout(0.5)(x, deterministic=False)
    with pytest.raises(ValueError, match=r"rate must be in \(0, 1\)"):
        keep_mask(jax.random.key(0), 1.5, (3,))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 16, rngs=rngs)
        self.drop = Dropout(0.25, rngs=rngs)
        self.b = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(jax.nn.relu(self.a(x))))


def _step(model, opt, x, y):
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def test_step_with_dropout_under_pockjax_equals_jit():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)), jnp.float32)
    y = jnp.arange(32) % 3
    runs = []
    for step in (nnx.jit(_step), pockjax.compile(_step, scheme=pockjax.UpdateScheme([("b.*", "full")]))):
        model = _Net(nnx.Rngs(0, dropout=1))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.All(nnx.Param, nnx.PathContains("b")))
        runs.append(([float(step(model, opt, x, y)) for _ in range(3)], nnx.state(model, nnx.Param)))
    (la, pa), (lb, pb) = runs
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    assert len(set(la)) == 3  # masks and weights change step to step
    for u, v in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(v, u, atol=1e-6)

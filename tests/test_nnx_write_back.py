"""An NNX step's new state goes back into the model's own variables, as ``nnx.jit`` puts it.

``pockjax.compile`` sets the values of the ``Variable`` objects ``nnx.split``
hands out, one array each; a variable holding several arrays (a dict) is
refused with an error that names it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from toy_models import nnx_mse_step


class Counted(nnx.Module):
    def __init__(self, *, several_leaves: bool):
        self.dense = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.several_leaves = several_leaves
        if several_leaves:  # one variable, two leaves
            self.stats = nnx.BatchStat({"sum": jnp.zeros(2), "count": jnp.zeros(())})
        else:
            self.stats = nnx.BatchStat(jnp.zeros(2))

    def __call__(self, x):
        y = self.dense(x)
        if self.several_leaves:
            s = self.stats.get_value()
            self.stats.set_value({"sum": s["sum"] + y.sum(0), "count": s["count"] + x.shape[0]})
        else:
            self.stats.set_value(self.stats.get_value() + y.sum(0))
        return y


def _run(compile_fn, several_leaves):
    model = Counted(several_leaves=several_leaves)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = compile_fn(nnx_mse_step)
    x, y = jnp.arange(12.0).reshape(4, 3) / 10, jnp.ones((4, 2))
    losses = [float(step(model, optimizer, x, y)) for _ in range(3)]
    return losses, jax.tree.map(np.asarray, nnx.state((model, optimizer))), model


def _pockjax(f):
    return pockjax.compile(f, scheme=pockjax.UpdateScheme.full())


def test_new_state_lands_in_the_models_variables_like_nnx_jit():
    want_losses, want, _ = _run(nnx.jit, several_leaves=False)
    got_losses, got, model = _run(_pockjax, several_leaves=False)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    # the statistic moved, in the model's own variable
    assert np.all(np.asarray(model.stats.get_value()) != 0)


def test_a_variable_holding_several_arrays_is_refused_by_name():
    with pytest.raises(pockjax.StepSignatureError, match=r"nnx_mse_step: NNX variable 0\.stats holds 2 arrays"):
        _run(_pockjax, several_leaves=True)

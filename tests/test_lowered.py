"""``step.lower(*args)`` is a Lowered step (nothing compiled); ``.compile()`` the CompiledStep a call runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import pockjax


def _step_and_args():
    tx = optax.adam(1e-2)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"a": jnp.ones((3, 4)) * 0.1, "b": jnp.ones((4, 2)) * 0.1}
    return step, (params, tx.init(params), jnp.ones((5, 3)))


def test_lower_then_compile_is_what_a_call_runs():
    step, args = _step_and_args()
    f = pockjax.compile(step, scheme=pockjax.UpdateScheme({"b": "full"}), donate=False)
    lowered = f.lower(*args)
    assert isinstance(lowered, pockjax.Lowered)
    assert lowered._compiled is None  # inspecting the rewritten graph compiles nothing
    assert lowered.summary().flops_after < lowered.summary().flops_before
    assert lowered.jaxpr is lowered.graph.closed_jaxpr
    assert f.lower(*args) is lowered  # cached per signature
    compiled = lowered.compile()
    assert isinstance(compiled, pockjax.CompiledStep) and lowered.compile() is compiled
    assert compiled.graph is lowered.graph and compiled.summary() == lowered.summary()
    f(*args)
    assert f._functional_compiled(args) is compiled  # the call ran the same compiled step
    assert compiled.cost_analysis()["flops"] > 0

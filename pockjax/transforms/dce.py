"""Dead-code elimination over a whole train step, nested jaxprs included.

After :func:`pockjax.sparse_grad` zeroes the gradients of frozen parameters,
the weight-gradient ops that produced them, and every activation-gradient op
that fed only those, have no live consumer: this pass removes them, so the
backward pass stops at the earliest trained layer by itself.

Rules live in ``DCE_RULES`` (Primitive object -> ``rule(used_outputs, eqn) ->
(used_inputs, new_eqn | None)``). The default rule drops an effect-free
equation whose outputs are all unused and keeps all inputs of one that is
used. Primitives with nested jaxprs use JAX's own DCE rule for them (which
prunes inside ``jit``, ``scan``, ``cond``, ``remat``, custom derivatives);
``while`` loops are kept whole when any output is used. A nested primitive
with no rule is an error that names it.
"""

from __future__ import annotations

import functools
from typing import Callable

from pockjax import _compat as C
from pockjax._src import jaxpr as J
from pockjax.errors import UnsupportedPrimitiveError
from pockjax.graph import PassRecord, TrainGraph
from pockjax.transforms.base import Pass

DceRule = Callable[[list, C.JaxprEqn], tuple]
DCE_RULES: dict[C.Primitive, DceRule] = J.PrimitiveTable()


def _default_rule(used_outputs, eqn):
    if not any(used_outputs) and not eqn.effects:
        return [False] * len(eqn.invars), None
    return [True] * len(eqn.invars), eqn


def _keep_whole(used_outputs, eqn):
    return _default_rule(used_outputs, eqn)


def _jax_rule(name: str) -> DceRule:
    def rule(used_outputs, eqn):
        if not any(used_outputs) and not eqn.effects:
            return [False] * len(eqn.invars), None
        return C.dce_rules[eqn.primitive](used_outputs, eqn)

    rule.__name__ = f"jax_dce_rule_{name}"
    return rule


for _prim in list(C.dce_rules):
    DCE_RULES[_prim] = _jax_rule(_prim.name)
DCE_RULES[C.primitives.while_p] = _keep_whole


def dce_jaxpr(jaxpr: C.Jaxpr, used_outputs: list[bool] | None = None) -> tuple[C.Jaxpr, list[bool]]:
    """DCE of one jaxpr; returns the new jaxpr (all inputs kept) and which inputs are used."""
    used_outputs = [True] * len(jaxpr.outvars) if used_outputs is None else list(used_outputs)
    live = set()
    for v, used in zip(jaxpr.outvars, used_outputs):
        if used and not isinstance(v, C.Literal):
            live.add(v)
    new_eqns = []
    for eqn in reversed(jaxpr.eqns):
        used_outs = [not isinstance(v, C.DropVar) and v in live for v in eqn.outvars]
        name = eqn.primitive.name
        rule = DCE_RULES.get(eqn.primitive)
        if rule is None:
            if J.subjaxprs(eqn, strict=False):
                raise UnsupportedPrimitiveError(
                    f"dce has no rule for primitive '{name}', which holds nested jaxprs; "
                    f"register one in pockjax.transforms.dce.DCE_RULES"
                )
            rule = _default_rule
        used_ins, new_eqn = rule(used_outs, eqn)
        if new_eqn is None:
            continue
        new_eqns.append(new_eqn)
        for v, used in zip(eqn.invars, used_ins):  # used_ins refers to the original operands
            if used and not isinstance(v, C.Literal):
                live.add(v)
    new_eqns.reverse()
    used_inputs = [v in live for v in jaxpr.invars]
    return jaxpr.replace(eqns=new_eqns), used_inputs


def _dce_graph(graph: TrainGraph, check: bool = True) -> TrainGraph:
    new_jaxpr, _ = dce_jaxpr(graph.jaxpr)
    if check:
        C.check_jaxpr(new_jaxpr)
    return graph.recorded(PassRecord("dce"), closed_jaxpr=C.ClosedJaxpr(new_jaxpr, graph.closed_jaxpr.consts))


def dce(*, check: bool = True) -> Pass:
    """The pass that removes every equation whose result no output needs.

    Inputs are kept, so the step's signature does not change.

    Args:
      check: type-check the rewritten program with JAX's ``check_jaxpr``
        (every variable defined before use, operand types matching each
        primitive's rule), which catches a wrong rule in ``DCE_RULES``. With
        ``False`` that check is skipped: safe when the graph is only analysed
        (FLOPs, liveness), not run or compiled, as the architecture search does
        for each candidate; a graph that will be compiled should be checked.

    Example:
        >>> import jax, jax.numpy as jnp, pockjax
        >>> def step(params, opt_state, x):
        ...     unused = jnp.sin(x) * 2.0
        ...     return params, opt_state, x.sum()
        >>> g = pockjax.trace_step(step, ({"w": jnp.ones(3)}, (), jnp.ones(3)))
        >>> len(g.jaxpr.eqns), len(pockjax.dce()(g).jaxpr.eqns)
        (3, 1)
    """
    return Pass("dce", _dce_graph if check else functools.partial(_dce_graph, check=False))

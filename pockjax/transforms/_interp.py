"""An env-based jaxpr interpreter that re-traces a jaxpr with per-eqn rules.

Passes that change what equations compute (zero a gradient, slice a
gradient, drop a tag) re-evaluate the jaxpr under ``jax.make_jaxpr``: every
equation is re-bound on tracers unless a rule says otherwise, which yields a
fresh, well-typed jaxpr. Rules see the equation and its input values and
return its output values. Nested jaxprs (``jit``, ``scan``, ``while``,
``cond``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``) are rewritten
recursively when ``needs_rewrite`` says they contain something to rewrite.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from pockjax import _compat as C
from pockjax.errors import UnsupportedPrimitiveError

EqnRule = Callable[[C.JaxprEqn, list], list]

# Primitives whose nested jaxprs the interpreter knows how to rewrite; the
# value is the list of params that hold those jaxprs.
NESTED_PARAMS: dict[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
    "remat": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "remat2": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
}


def is_var(v) -> bool:
    """Whether a jaxpr operand is a variable (not a literal)."""
    return not isinstance(v, C.Literal)


def producers(eqns: Sequence[C.JaxprEqn]) -> dict:
    """``{var: index of the equation in eqns that defines it}`` (dropped outputs left out)."""
    return {v: i for i, e in enumerate(eqns) for v in e.outvars if not isinstance(v, C.DropVar)}


def bind_eqn(eqn: C.JaxprEqn, invals: Sequence, params: dict | None = None) -> list:
    """Bind ``eqn``'s primitive on ``invals`` (with ``params`` overriding)."""
    params = dict(eqn.params if params is None else params)
    bind_params = C.get_bind_params(eqn.primitive, params)
    with C.source_context(eqn), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def contains(jaxpr, predicate: Callable[[C.JaxprEqn], bool]) -> bool:
    """Whether any equation of ``jaxpr`` (at any depth) satisfies ``predicate``."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if predicate(eqn):
            return True
        for _, sub in C.subjaxprs_of(eqn):
            subs = sub if isinstance(sub, (tuple, list)) else [sub]
            if any(contains(s, predicate) for s in subs):
                return True
    return False


def eval_jaxpr_with(
    jaxpr: C.Jaxpr,
    consts: Sequence,
    args: Sequence,
    rule: Callable[[C.JaxprEqn, list], list | None],
    *,
    order: Sequence[int] | None = None,
    after: Callable[[int, dict], None] | None = None,
) -> list:
    """Evaluate ``jaxpr``; ``rule(eqn, invals)`` may return outputs to use instead.

    Args:
      order: evaluate the equations in this (topological) order of indices.
      after: ``after(position, env)`` runs after the equation at each position
        of the order and may replace values in ``env`` (var -> value).
    """
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, C.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    eqns = jaxpr.eqns
    for position, index in enumerate(range(len(eqns)) if order is None else order):
        eqn = eqns[index]
        invals = [read(v) for v in eqn.invars]
        outs = rule(eqn, invals)
        if outs is None:
            outs = bind_eqn(eqn, invals)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, C.DropVar):
                env[v] = x
        if after is not None:
            after(position, env)
    return [read(v) for v in jaxpr.outvars]


def _aval_struct(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def retrace(jaxpr, rule: Callable[[C.JaxprEqn, list], list | None]):
    """Re-trace a ``Jaxpr``/``ClosedJaxpr`` applying ``rule``; same kind back."""
    closed = isinstance(jaxpr, C.ClosedJaxpr)
    inner = jaxpr.jaxpr if closed else jaxpr
    consts = list(jaxpr.consts) if closed else []
    if not closed and inner.constvars:
        raise UnsupportedPrimitiveError("cannot rewrite an open jaxpr with constvars")

    def fun(*args):
        return eval_jaxpr_with(inner, consts, args, rule)

    new = jax.make_jaxpr(fun)(*[_aval_struct(v.aval) for v in inner.invars])
    if closed:
        return new
    if new.consts:
        raise UnsupportedPrimitiveError(
            "rewriting a nested jaxpr introduced constants where the primitive takes an open jaxpr"
        )
    return new.jaxpr


def rewrite_nested(eqn: C.JaxprEqn, invals: list, rule, needs_rewrite: Callable[[C.JaxprEqn], bool]) -> list | None:
    """Rewrite the nested jaxprs of ``eqn`` with ``rule`` if any contains a match.

    Returns the outputs of the rebound equation, or ``None`` when nothing in
    ``eqn`` needs rewriting. Raises :class:`UnsupportedPrimitiveError` for a
    primitive with nested jaxprs that this interpreter does not know.
    """
    subs = C.subjaxprs_of(eqn)
    if not subs:
        return None
    if not any(
        contains(s, needs_rewrite) for _, sub in subs for s in (sub if isinstance(sub, (tuple, list)) else [sub])
    ):
        return None
    name = eqn.primitive.name
    if name not in NESTED_PARAMS:
        raise UnsupportedPrimitiveError(
            f"pockjax cannot rewrite inside primitive '{name}' (params {sorted(eqn.params)}); "
            f"supported nested primitives: {sorted(NESTED_PARAMS)}. Move the gradient "
            "computation out of it, or file an issue with the primitive's name."
        )
    params = dict(eqn.params)
    for pname, sub in subs:
        if isinstance(sub, (tuple, list)):
            params[pname] = type(sub)(retrace(s, rule) for s in sub)
        else:
            params[pname] = retrace(sub, rule)
    if name in ("custom_jvp_call", "custom_vjp_call"):
        raise UnsupportedPrimitiveError(
            f"a parameter gradient is computed inside '{name}'; pockjax needs gradients of "
            "parameters taken outside custom_jvp/custom_vjp functions"
        )
    return bind_eqn(eqn, invals, params)

"""The one place that walks and rewrites (closed) jaxprs.

Every pass, the IREE rewrites, liveness and FLOP counting find nested jaxprs
through :data:`HIGHER_ORDER`, a table keyed by ``jax.extend.core.Primitive``
objects (never by name), and build their own primitive tables with
:func:`prims`, so a primitive renamed by JAX fails loudly here, once.

* :func:`subjaxprs` / :func:`sub_jaxprs`: the nested jaxprs of an equation.
* :func:`walk`: visit every equation at any depth, with a multiplier
  (``scan`` length by default) and a hook choosing which sub-jaxprs to enter.
* :class:`Phase`, :func:`phase`, :func:`name_stack_phase`: the one place that
  decides whether an equation belongs to the forward pass, the backward pass
  or neither (the optimizer update...).
* :func:`contains`, :func:`eval_jaxpr_with`, :func:`retrace`,
  :func:`rewrite_nested`, :func:`bind_eqn`, :func:`producers`: the env-based
  interpreter that re-traces a jaxpr with per-equation rules. Passes that
  change what equations compute (zero a gradient, slice a gradient, drop a
  tag) re-evaluate the jaxpr under ``jax.make_jaxpr``: every equation is
  re-bound on tracers unless a rule says otherwise, which yields a fresh,
  well-typed jaxpr. Nested jaxprs are rewritten recursively when
  ``needs_rewrite`` says they contain something to rewrite.
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence

import jax

from pockjax import _compat as C
from pockjax import tags
from pockjax.errors import UnsupportedPrimitiveError

P = C.primitives
Primitive = C.Primitive
EqnRule = Callable[[C.JaxprEqn, list], list]


# -- primitive tables -----------------------------------------------------------
def _registry() -> dict[str, Primitive]:
    found: dict[str, Primitive] = {}
    for attr in dir(P):
        value = getattr(P, attr)
        if isinstance(value, Primitive):
            found.setdefault(value.name, value)
    for p in C.EXTRA_PRIMITIVES + tags.TAG_PRIMITIVES:
        found.setdefault(p.name, p)
    return found


#: Every primitive pockjax can name: ``jax.extend.core.primitives``, the few
#: extras of :data:`pockjax._compat.EXTRA_PRIMITIVES` and pockjax's tags.
BY_NAME: dict[str, Primitive] = _registry()


def prim(name: str) -> Primitive:
    """The Primitive object called ``name`` (raises ``KeyError`` if JAX has none)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no primitive named {name!r} in jax.extend.core.primitives or pockjax") from None


#: Names that pockjax's tables list for other JAX releases (or as ops that are
#: not primitives in this one): :func:`prims` skips them instead of raising.
NOT_PRIMITIVES = frozenset({"expand_dims", "copy_p"})


def prims(*names: str) -> frozenset[Primitive]:
    """The Primitive objects with these names, for building primitive-keyed tables.

    A name in :data:`NOT_PRIMITIVES` is skipped (it matched nothing as a
    string either); any other unknown name raises ``KeyError``.
    """
    return frozenset(prim(n) for n in names if not (n in NOT_PRIMITIVES and n not in BY_NAME))


class PrimitiveTable(dict):
    """A dict keyed by Primitive objects; a primitive *name* given as a key (by
    older code registering or looking up a rule) is turned into its Primitive."""

    @staticmethod
    def _key(key):
        return prim(key) if isinstance(key, str) else key

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __setitem__(self, key, value):
        super().__setitem__(self._key(key), value)

    def __contains__(self, key):
        if isinstance(key, str):
            return key in BY_NAME and super().__contains__(BY_NAME[key])
        return super().__contains__(key)

    def get(self, key, default=None):
        if isinstance(key, str) and key not in BY_NAME:
            return default
        return super().get(self._key(key), default)


def prims_with_prefix(*prefixes: str) -> frozenset[Primitive]:
    """Every known Primitive whose name starts with one of ``prefixes``."""
    return frozenset(p for n, p in BY_NAME.items() if n.startswith(prefixes))


#: Higher-order primitives and the params that hold their sub-jaxprs.
HIGHER_ORDER: dict[Primitive, tuple[str, ...]] = {
    P.jit_p: ("jaxpr",),
    P.closed_call_p: ("call_jaxpr",),
    P.call_p: ("call_jaxpr",),
    P.scan_p: ("jaxpr",),
    P.while_p: ("cond_jaxpr", "body_jaxpr"),
    P.cond_p: ("branches",),
    P.remat_p: ("jaxpr",),
    P.custom_jvp_call_p: ("call_jaxpr",),
    P.custom_vjp_call_p: ("call_jaxpr",),
}
if C.shard_map_p is not None:
    HIGHER_ORDER[C.shard_map_p] = ("jaxpr",)

#: Call-like higher-order primitives: one body, inlinable, and the param holding it.
CALL_BODY: dict[Primitive, str] = {
    P.jit_p: "jaxpr",
    P.closed_call_p: "call_jaxpr",
    P.call_p: "call_jaxpr",
    P.remat_p: "jaxpr",
    P.custom_jvp_call_p: "call_jaxpr",
    P.custom_vjp_call_p: "call_jaxpr",
}

#: Primitives whose jaxpr params describe a small combiner (scatter's update,
#: a generic reduction's body), not a computation on the operands: plain ops.
COMBINERS: frozenset[Primitive] = prims_with_prefix(*C.COMBINER_PRIMITIVE_PREFIXES)

#: Custom-derivative calls: a rewrite inside them would bypass their rule.
CUSTOM_DERIVATIVE_CALLS: frozenset[Primitive] = frozenset({P.custom_jvp_call_p, P.custom_vjp_call_p})


def _is_jaxpr(value) -> bool:
    return isinstance(value, (C.Jaxpr, C.ClosedJaxpr))


def _jaxpr_params(eqn: C.JaxprEqn) -> list[tuple[str, object]]:
    found = []
    for name, value in eqn.params.items():
        if _is_jaxpr(value):
            found.append((name, value))
        elif isinstance(value, (tuple, list)) and value and all(_is_jaxpr(v) for v in value):
            found.append((name, value))
    return found


def subjaxprs(eqn: C.JaxprEqn, *, strict: bool = True) -> list[tuple[str, object]]:
    """``(param_name, jaxpr_or_tuple)`` for every nested jaxpr of ``eqn``.

    A primitive in :data:`HIGHER_ORDER` gives its listed params (``cond``'s
    ``branches`` is a tuple); a combiner (:data:`COMBINERS`) or a primitive
    without jaxpr params gives ``[]``. Another primitive carrying jaxprs raises
    :class:`UnsupportedPrimitiveError` naming it, or with ``strict=False``
    gives those params as found.
    """
    prim_ = eqn.primitive
    if prim_ in COMBINERS:
        return []
    found = _jaxpr_params(eqn)
    if not found or prim_ not in HIGHER_ORDER:
        if found and strict:
            raise UnsupportedPrimitiveError(
                f"pockjax does not know the higher-order primitive '{prim_.name}' "
                f"(params {sorted(eqn.params)}); known: {sorted(p.name for p in HIGHER_ORDER)}"
            )
        return found
    names = HIGHER_ORDER[prim_]
    return [(n, v) for n, v in found if n in names]


def sub_jaxprs(eqn: C.JaxprEqn, *, strict: bool = True) -> list:
    """The nested jaxprs of ``eqn`` as one flat list (``cond`` branches unpacked)."""
    out = []
    for _, sub in subjaxprs(eqn, strict=strict):
        out.extend(sub if isinstance(sub, (tuple, list)) else [sub])
    return out


def open_jaxpr(jaxpr_like):
    """The ``Jaxpr`` of a ``Jaxpr`` / ``ClosedJaxpr`` (or of anything with ``.jaxpr``)."""
    return getattr(jaxpr_like, "jaxpr", jaxpr_like)


def scan_length(eqn: C.JaxprEqn) -> float:
    """The default :func:`walk` multiplier: a ``scan``'s length, else 1."""
    return float(eqn.params.get("length", 1)) if eqn.primitive is P.scan_p else 1.0


def walk(
    jaxpr,
    visit: Callable[[C.JaxprEqn, float], None],
    multiplier: float = 1.0,
    *,
    times: Callable[[C.JaxprEqn], float] = scan_length,
    select: Callable[[C.JaxprEqn, list], list] | None = None,
    strict: bool = False,
) -> None:
    """Call ``visit(eqn, multiplier)`` on every equation of ``jaxpr``, nested ones included.

    Args:
      multiplier: passed to ``visit`` for the top-level equations; nested ones
        get it times ``times(eqn)`` of the equation holding them.
      select: ``select(eqn, subs) -> subs`` chooses which of an equation's
        nested jaxprs (the flat list of :func:`sub_jaxprs`) to enter.
      strict: raise for an unknown higher-order primitive (see :func:`subjaxprs`).
    """
    for eqn in open_jaxpr(jaxpr).eqns:
        visit(eqn, multiplier)
        subs = sub_jaxprs(eqn, strict=strict)
        if not subs:
            continue
        if select is not None:
            subs = select(eqn, subs)
        inner = multiplier * times(eqn)
        for s in subs:
            walk(s, visit, inner, times=times, select=select, strict=strict)


# -- phases ---------------------------------------------------------------------
class Phase(enum.IntEnum):
    """Which part of a train step an equation belongs to.

    ``jax.grad`` / ``jax.vjp`` name what they emit: the linearized forward pass
    runs under ``jvp(...)`` in the name stack, the backward pass under
    ``transpose(jvp(...))``. Everything else the step computes is ``OTHER``:
    the optimizer update, and whatever the step does outside the
    differentiated function. (Integer values, so arrays of phases stay small.)
    """

    OTHER = 0
    FORWARD = 1
    BACKWARD = 2


def name_stack_phase(name_stack: str) -> Phase:
    """The :class:`Phase` of a name stack (a jaxpr equation's, or an HLO ``op_name``).

    Example:
        >>> name_stack_phase("jit(step)/transpose(jvp(loss))/dot_general")
        <Phase.BACKWARD: 2>
        >>> name_stack_phase("jvp(loss)/tanh"), name_stack_phase("step/sub")
        (<Phase.FORWARD: 1>, <Phase.OTHER: 0>)
    """
    if "transpose(" in name_stack:
        return Phase.BACKWARD
    if "jvp(" in name_stack:
        return Phase.FORWARD
    return Phase.OTHER


def eqn_name_stack(eqn: C.JaxprEqn) -> str:
    """An equation's name stack as text (empty for one built without source info)."""
    try:
        return str(eqn.source_info.name_stack)
    except AttributeError:
        return ""


def phase(eqn: C.JaxprEqn, outer_name_stack: str = "") -> Phase:
    """The :class:`Phase` of an equation.

    Args:
      eqn: the equation.
      outer_name_stack: the name stack of the equations holding it, for an
        equation of a nested jaxpr (whose own name stack starts inside its body).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def step(w):
        ...     return w - jax.grad(lambda w: jnp.sum(jnp.tanh(w)))(w)
        >>> phases = [phase(e).name for e in jax.make_jaxpr(step)(jnp.ones(3)).eqns]
        >>> phases[0], phases[-2], phases[-1]   # tanh, the gradient's last op, the update
        ('FORWARD', 'BACKWARD', 'OTHER')
    """
    local = eqn_name_stack(eqn)
    return name_stack_phase(f"{outer_name_stack}/{local}" if outer_name_stack else local)


# -- the interpreter ------------------------------------------------------------
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
    for eqn in open_jaxpr(jaxpr).eqns:
        if predicate(eqn):
            return True
        if any(contains(s, predicate) for s in sub_jaxprs(eqn, strict=False)):
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


def retrace(jaxpr, rule: Callable[[C.JaxprEqn, list], list | None], finish: Callable[[list], list] | None = None):
    """Re-trace a ``Jaxpr``/``ClosedJaxpr`` applying ``rule``; same kind back.

    ``finish(outputs)`` may replace the outputs (a rule's symbolic values made concrete).
    """
    closed = isinstance(jaxpr, C.ClosedJaxpr)
    inner = jaxpr.jaxpr if closed else jaxpr
    consts = list(jaxpr.consts) if closed else []
    if not closed and inner.constvars:
        raise UnsupportedPrimitiveError("cannot rewrite an open jaxpr with constvars")

    def fun(*args):
        outs = eval_jaxpr_with(inner, consts, args, rule)
        return outs if finish is None else finish(outs)

    new = jax.make_jaxpr(fun)(*[_aval_struct(v.aval) for v in inner.invars])
    if closed:
        return new
    if new.consts:
        raise UnsupportedPrimitiveError(
            "rewriting a nested jaxpr introduced constants where the primitive takes an open jaxpr"
        )
    return new.jaxpr


def rewrite_nested(eqn: C.JaxprEqn, invals: list, rule, needs_rewrite: Callable[[C.JaxprEqn], bool],
                   finish: Callable[[list], list] | None = None) -> list | None:
    """Rewrite the nested jaxprs of ``eqn`` with ``rule`` if any contains a match.

    Returns the outputs of the rebound equation, or ``None`` when nothing in
    ``eqn`` needs rewriting. Raises :class:`UnsupportedPrimitiveError` for a
    primitive with nested jaxprs that is not in :data:`HIGHER_ORDER`.
    """
    subs = subjaxprs(eqn, strict=False)
    if not subs:
        return None
    if not any(
        contains(s, needs_rewrite) for _, sub in subs for s in (sub if isinstance(sub, (tuple, list)) else [sub])
    ):
        return None
    name = eqn.primitive.name
    if eqn.primitive not in HIGHER_ORDER:
        raise UnsupportedPrimitiveError(
            f"pockjax cannot rewrite inside primitive '{name}' (params {sorted(eqn.params)}); "
            f"supported nested primitives: {sorted(p.name for p in HIGHER_ORDER)}. Move the gradient "
            "computation out of it, or file an issue with the primitive's name."
        )
    params = dict(eqn.params)
    for pname, sub in subs:
        if isinstance(sub, (tuple, list)):
            params[pname] = type(sub)(retrace(s, rule, finish) for s in sub)
        else:
            params[pname] = retrace(sub, rule, finish)
    if eqn.primitive in CUSTOM_DERIVATIVE_CALLS:
        raise UnsupportedPrimitiveError(
            f"a parameter gradient is computed inside '{name}'; pockjax needs gradients of "
            "parameters taken outside custom_jvp/custom_vjp functions"
        )
    return bind_eqn(eqn, invals, params)

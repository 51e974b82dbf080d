"""Graph rewrites that steer IREE around known compiler failures.

Each rewrite takes a function over flat arrays and returns an equivalent one
whose jaxpr avoids a pattern IREE 3.13 miscompiles or rejects. They are
registered as :class:`pockjax.backends.iree.workarounds.Workaround` entries.

``scatter_add_to_select``
    The backward of ``jnp.take_along_axis`` (how cross-entropy picks the
    target's log-probability) is a ``scatter-add`` of the upstream gradient into
    a zero tensor of the logits' shape. With batch size 1, JAX emits the size-1
    batch axis as a *window* dimension next to a batching dimension, and IREE's
    StableHLO conversion rejects it on every backend: ``'iree_linalg_ext.scatter'
    op expected indices to be equal to batch rank or batch rank + 1``.
    (It does not cure cuda's ``failed to get neutral element for reduction``:
    that comes from the row sums that follow, with or without the scatter; see
    the ``cuda-reduction-distribution`` flag workaround.)

    When every operand element receives at most one update (true for
    take_along_axis: one index per row), ``scatter-add`` equals
    ``operand + where(iota == index, updates, 0)``, a compare and a select of the
    operand's size, which every IREE backend compiles. Scatter-adds that sum
    many updates into one element (the embedding gradient) are left alone: the
    one-hot form would materialise ``tokens x vocab x dim``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax

from pockjax._src import jaxpr as J

__all__ = ["cond_as_select", "merge_reduced_axes", "rewrite_jaxpr_fun", "scatter_add_to_select",
           "scatter_add_as_select"]

# Call-like primitives whose body is inlined (and rewritten) by the interpreter
# (Primitive -> body param): jit, closed_call, custom_jvp_call and remat/checkpoint.
_CALL_PARAMS = {
    p: J.CALL_BODY[p] for p in (J.P.jit_p, J.P.closed_call_p, J.P.custom_jvp_call_p, J.P.remat_p)
}


def scatter_add_as_select(operand, indices, updates, dimension_numbers, mode) -> Any | None:
    """``scatter-add`` as a compare+select when each operand element gets at most one update.

    Returns None when the scatter is not of that form (then the caller keeps it).
    """
    dn = dimension_numbers
    if len(dn.scatter_dims_to_operand_dims) != 1 or indices.shape[-1] != 1:
        return None
    d = dn.scatter_dims_to_operand_dims[0]
    inserted = tuple(dn.inserted_window_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()) or ())
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()) or ())
    if any(k != d for k in inserted):
        return None
    nd = operand.ndim
    window_operand_dims = [k for k in range(nd) if k not in inserted and k not in op_batch]
    update_window_dims = list(dn.update_window_dims)
    if len(window_operand_dims) != len(update_window_dims):
        return None
    update_scatter_dims = [u for u in range(updates.ndim) if u not in update_window_dims]
    index_batch_dims = list(range(indices.ndim - 1))
    if len(update_scatter_dims) != len(index_batch_dims):
        return None

    # Operand dim for every updates dim (None: a size-1 dim to squeeze).
    upd_to_op: dict[int, int | None] = {}
    for u, k in zip(update_window_dims, window_operand_dims):
        if k == d:
            if updates.shape[u] != 1:
                return None
        elif updates.shape[u] != operand.shape[k]:
            return None  # a partial window starting at 0: not worth handling
        upd_to_op[u] = k
    idx_to_op: dict[int, int | None] = {}
    for u, j in zip(update_scatter_dims, index_batch_dims):
        if j in idx_batch:
            k = op_batch[idx_batch.index(j)]
            if indices.shape[j] != operand.shape[k]:
                return None
            upd_to_op[u] = idx_to_op[j] = k
        elif indices.shape[j] == 1:
            upd_to_op[u] = idx_to_op[j] = None
        else:
            return None  # several updates may land on one element: a real sum, keep the scatter

    def to_operand_layout(x, dim_map):
        keep = [a for a in range(x.ndim) if dim_map[a] is not None]
        x = x.reshape([x.shape[a] for a in keep])
        targets = [dim_map[a] for a in keep]
        order = sorted(range(len(targets)), key=lambda i: targets[i])
        x = jnp.transpose(x, order)
        present = sorted(targets)
        shape = [1] * nd
        for pos, k in enumerate(present):
            shape[k] = x.shape[pos]
        return x.reshape(shape)

    upd = to_operand_layout(updates, upd_to_op)
    if upd.shape[d] != 1:
        return None
    idx = to_operand_layout(indices[..., 0], idx_to_op)
    n = operand.shape[d]
    if mode == lax.GatherScatterMode.CLIP:
        idx = jnp.clip(idx, 0, n - 1)
    iota = lax.broadcasted_iota(idx.dtype, [n if k == d else 1 for k in range(nd)], d)
    hit = iota == idx
    return operand + jnp.where(hit, upd, jnp.zeros((), operand.dtype)).astype(operand.dtype)


def _loop_or_branch(eqn, invals, rules):
    """A ``scan``, ``while`` or ``cond`` rebuilt with ``rules`` applied in its bodies (None: another
    primitive, or bodies with nothing to rewrite: bound as it is)."""
    name = eqn.primitive.name
    if name not in ("scan", "while", "cond") or not any(
            J.contains(sub, lambda e: e.primitive in rules) for sub in J.sub_jaxprs(eqn, strict=False)):
        return None
    p = eqn.params

    def run(closed, args):
        return _eval(closed.jaxpr, closed.consts, list(args), rules)

    if name == "scan":
        nc, ncar = p["num_consts"], p["num_carry"]
        consts, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]

        def body(carry, x):
            outs = run(p["jaxpr"], [*consts, *carry, *x])
            return outs[:ncar], outs[ncar:]

        carry, ys = lax.scan(body, list(init), list(xs), length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
        return [*carry, *ys]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
        return list(lax.while_loop(lambda c: run(p["cond_jaxpr"], [*cconsts, *c])[0],
                                   lambda c: run(p["body_jaxpr"], [*bconsts, *c]), list(init)))
    branches = [lambda *ops, b=b: run(b, ops) for b in p["branches"]]
    return list(lax.switch(invals[0], branches, *invals[1:]))


def _eval(jaxpr, consts, args, rules):
    """Evaluate ``jaxpr`` with ``rules`` (Primitive -> rule), inlining the calls of :data:`_CALL_PARAMS`
    and applying them in the bodies of loops and branches too."""

    def rule(eqn, invals):
        outs = None
        fn = rules.get(eqn.primitive)
        if fn is not None:
            outs = fn(*invals, **eqn.params)
            if outs is not None and not eqn.primitive.multiple_results:
                outs = [outs]
        if outs is None and not eqn.effects:
            outs = _loop_or_branch(eqn, invals, rules)
        param = _CALL_PARAMS.get(eqn.primitive)
        if outs is None and param is not None and param in eqn.params:
            inner = eqn.params[param]
            if isinstance(inner, jex.core.ClosedJaxpr):
                outs = _eval(inner.jaxpr, inner.consts, invals, rules)
            elif isinstance(inner, jex.core.Jaxpr):
                outs = _eval(inner, (), invals, rules)
        return outs  # None: bind the equation as it is

    return J.eval_jaxpr_with(jaxpr, consts, args, rule)


def _primitive_keys(rules: dict) -> dict:
    """``rules`` keyed by Primitive objects (primitive names are looked up once, here)."""
    return {J.prim(k) if isinstance(k, str) else k: v for k, v in rules.items()}


def rewrite_jaxpr_fun(fun: Callable, flat_avals: Sequence[Any], rules: dict[Any, Callable]) -> Callable:
    """Traces ``fun`` and returns a function that re-evaluates it with ``rules``.

    ``rules`` maps Primitive objects (or primitive names, looked up once) to
    ``rule(*invals, **params)`` returning the output (or None to keep the
    original equation). Calls (``jit``, ``closed_call``, ``custom_jvp_call``,
    remat/checkpoint) are inlined so rules reach into them; a ``scan``,
    ``while`` or ``cond`` whose bodies hold a rewritten primitive is rebuilt
    with its bodies rewritten (others are kept as they are).
    """
    rules = _primitive_keys(rules)
    avals = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in flat_avals]
    closed = jax.make_jaxpr(fun)(*avals)
    out_tree = jax.tree.structure(jax.eval_shape(fun, *avals))

    def rewritten(*args):
        outs = _eval(closed.jaxpr, closed.consts, args, rules)
        return jax.tree.unflatten(out_tree, outs)

    return rewritten


def _scatter_add_rule(operand, indices, updates, *, dimension_numbers, mode, **_):
    return scatter_add_as_select(operand, indices, updates, dimension_numbers, mode)


def scatter_add_to_select(fun: Callable, flat_avals: Sequence[Any]) -> Callable:
    """``fun`` with every one-update-per-element ``scatter-add`` turned into compare+select."""
    return rewrite_jaxpr_fun(fun, flat_avals, {J.P.scatter_add_p: _scatter_add_rule})



def cond_as_select(fun: Callable, flat_avals: Sequence[Any]) -> Callable:
    """``fun`` with each ``cond`` of the failing form (a branch hands one of its operands back,
    as ``apply_if_finite``'s skipped update does) computing every branch and selecting the taken
    one's values, in loop and branch bodies too.

    The same values (a ``select_n`` by the branch index); every branch runs,
    so what the untaken one computes (an update of non-finite gradients) is
    computed and dropped. A cond with an effect or a ``while`` loop in a
    branch (bounded only under its guard) is kept as it is, and so is one
    whose branches hand no operand back.

    Example:
        >>> import numpy as np
        >>> f = cond_as_select(lambda x: jax.lax.cond(x[0] > 0, lambda x: x * 2, lambda x: x, x), [np.ones(2)])
        >>> f(np.array([1.0, 2.0])).tolist(), f(np.array([-1.0, 2.0])).tolist()
        ([2.0, 4.0], [-1.0, 2.0])
        >>> "cond" in str(jax.make_jaxpr(f)(np.ones(2)))
        False
    """
    rules: dict = {}

    def rule(index, *ops, branches, **_):
        if any(b.effects for b in branches) or any(J.contains(b, lambda e: e.primitive is J.P.while_p) for b in branches):
            return None  # a branch with an effect, or a loop only its guard bounds: as it is
        if not any(v in b.jaxpr.invars for b in branches for v in b.jaxpr.outvars):
            return None  # no branch hands an operand back: not the failing form, as it is
        outs = [_eval(b.jaxpr, b.consts, list(ops), rules) for b in branches]
        return [lax.select_n(index, *vals) for vals in zip(*outs)]

    rules[J.P.cond_p] = rule
    return rewrite_jaxpr_fun(fun, flat_avals, rules)


def _merged(primitive):
    """The rule reducing over one merged axis for a reduction ``primitive`` (sum, max, min)."""

    def rule(x, *, axes, **params):
        axes = tuple(sorted(axes))
        if len(axes) < 2:
            return None  # one axis: as it is
        if axes != tuple(range(axes[0], axes[-1] + 1)):  # not neighbours: the reduced axes moved last
            kept = [a for a in range(x.ndim) if a not in axes]
            x = lax.transpose(x, (*kept, *axes))
            axes = tuple(range(len(kept), x.ndim))
        first, last = axes[0], axes[-1]
        merged = x.shape[:first] + (math.prod(x.shape[first:last + 1]),) + x.shape[last + 1:]
        return primitive.bind(lax.reshape(x, merged), axes=(first,), **params)

    return rule


def merge_reduced_axes(fun: Callable, flat_avals: Sequence[Any]) -> Callable:
    """``fun`` with each sum, max or min over several axes taken over one merged axis, in
    loop and branch bodies too.

    ``x.sum((0, 1, 2))`` of an NHWC tensor (BatchNorm's mean and its backward)
    becomes ``x.reshape(N * H * W, C).sum(0)``: the same values, summed in
    the same order of the elements. Axes that are not neighbours (``(0, 2)``)
    are moved last by a transpose first.

    Example:
        >>> import numpy as np
        >>> x = np.arange(48, dtype=np.float32).reshape(2, 2, 4, 3)
        >>> f = merge_reduced_axes(lambda x: x - x.mean((0, 1, 2)), [x])
        >>> bool(np.allclose(f(x), x - x.mean((0, 1, 2))))
        True
        >>> "reshape" in str(jax.make_jaxpr(f)(x))
        True
    """
    return rewrite_jaxpr_fun(fun, flat_avals, {p: _merged(p) for p in (J.P.reduce_sum_p, J.P.reduce_max_p,
                                                                        J.P.reduce_min_p)})


# Primitives that only move data: an operand computed from a step input through
# these alone is packed straight from the input, and needs no barrier.
_LAYOUT_PRIMITIVES = J.prims("transpose", "reshape", "convert_element_type", "squeeze", "expand_dims")


# A batch-free matmul whose contraction is shorter than this gets a barrier on its
# result too (see dot_operands_behind_barrier).
SHORT_CONTRACTION = 256


def _short_plain_matmul(lhs_shape, dimension_numbers) -> bool:
    (lhs_contract, _), (lhs_batch, _) = dimension_numbers
    k = 1
    for d in lhs_contract:
        k *= int(lhs_shape[d])
    return not lhs_batch and k < SHORT_CONTRACTION


def dot_operands_behind_barrier(fun: Callable, flat_avals: Sequence[Any]) -> Callable:
    """``fun`` with each computed ``dot_general`` operand passed through ``lax.optimization_barrier``.

    The values are unchanged; the barrier only stops IREE from fusing a
    matmul operand's packing (data tiling's ``set_encoding``) into the
    dispatch that produces the operand. The result of a batch-free matmul
    with a contraction shorter than :data:`SHORT_CONTRACTION` (a weight
    gradient over few tokens: batch 1, or the answer window's LM-head
    gradient) is fenced as well, which keeps its consumer (the optimizer
    update) out of the matmul's dispatch. Operands that are step inputs (or a
    transpose/reshape of one) are left alone: their packing has no producer
    to fuse with, and without a barrier IREE can hoist the packing of a
    weight held in an immutable global (a frozen weight in a
    parameter-backed module) to load time.
    """
    keep: list[Any] = []
    from_inputs: set[int] = set()

    def mark(v):
        keep.append(v)  # keeps the object alive so its id is not reused during the trace
        from_inputs.add(id(v))

    def layout_rule(prim):
        def rule(x, **params):
            out = prim.bind(x, **params)
            if id(x) in from_inputs:
                mark(out)
            return out

        return rule

    def dot_rule(lhs, rhs, **params):
        computed = [k for k, v in enumerate((lhs, rhs)) if id(v) not in from_inputs]
        ops = [lhs, rhs]
        if computed:
            fenced = lax.optimization_barrier(tuple(ops[k] for k in computed))
            for k, v in zip(computed, fenced):
                ops[k] = v
        out = lax.dot_general_p.bind(*ops, **params)
        if _short_plain_matmul(lhs.shape, params["dimension_numbers"]):
            out = lax.optimization_barrier(out)
        return out

    rules = {J.P.dot_general_p: dot_rule}
    for prim in _LAYOUT_PRIMITIVES:
        rules[prim] = layout_rule(prim)
    inner = rewrite_jaxpr_fun(fun, flat_avals, rules)

    def rewritten(*args):
        keep.clear()
        from_inputs.clear()
        for a in args:
            mark(a)
        try:
            return inner(*args)
        finally:
            keep.clear()
            from_inputs.clear()

    return rewritten


def _unrolled(eqn, invals):
    """A ``scan`` equation bound fully unrolled (its body, and the scans in it, too)."""
    if eqn.primitive is not J.P.scan_p:
        return None
    body = J.retrace(eqn.params["jaxpr"], _unrolled)
    params = dict(eqn.params, jaxpr=body, unroll=eqn.params["length"])
    return J.P.scan_p.bind(*invals, **params)


def unroll_scans(fun: Callable, flat_avals: Sequence[Any]) -> Callable:
    """``fun`` with every ``lax.scan`` fully unrolled: no loop left in the program.

    The values are the same (each iteration's operations, in order); the
    program grows with the trip counts, so IREE takes longer to compile it.

    Example:
        >>> import numpy as np
        >>> def f(x):
        ...     return jax.lax.scan(lambda c, v: (c * v, c), x, np.arange(1.0, 4.0, dtype=np.float32))[0]
        >>> x = np.float32(2.0)
        >>> g = unroll_scans(f, [x])
        >>> float(g(x)), "while" in str(jax.jit(g).lower(x).as_text())
        (12.0, False)
    """
    avals = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in flat_avals]
    closed = jax.make_jaxpr(fun)(*avals)
    out_tree = jax.tree.structure(jax.eval_shape(fun, *avals))

    def rewritten(*args):
        return jax.tree.unflatten(out_tree, J.eval_jaxpr_with(closed.jaxpr, closed.consts, args, _unrolled))

    return rewritten

"""Quantized frozen inputs: dequantize each matrix right before each use.

A step is traced for the float value of every :class:`~pockjax.quant.QTensor`
it receives; :func:`dequantize_inputs` then rewrites the jaxpr so that the
input is the quantized codes and scales instead, and the float value is
computed from them block-wise right before every equation that reads it:

* one dequantization per reader, computed from the codes and one element of
  that reader's other operand (:func:`_tied`), so that XLA neither merges
  them (which would keep one float copy of every frozen matrix alive from the
  forward pass to the backward pass) nor runs them all at the start. The
  float copy of a matrix lives only for the one product that reads it.
* an embedding lookup gathers the codes of its rows; a product reading a
  matrix over :data:`CHUNK_BYTES` dequantizes it block by block.
* a ``scan`` over stacked layers receives the codes of its slice instead:
  the dequantization moves into the loop body (recursively), so a scanned
  model dequantizes one layer at a time.
* an output that returns the frozen matrix unchanged (every frozen parameter
  after ``sparse_grad``) returns the codes and scales it came with.

The rewrite is used by :func:`pockjax.compile` for train steps and by
:func:`quantized_jit` for any function (generation).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pockjax import _compat as C
from pockjax import quant
from pockjax._src import jaxpr as core

P = C.primitives

__all__ = ["dequantize_inputs", "quantized_jit"]


class _Lazy:
    """A quantized value in the interpreter's environment: its template and component values."""

    __slots__ = ("template", "comps")

    def __init__(self, template: quant.QTensor, comps: Sequence):
        self.template = template
        self.comps = list(comps)

    def value(self):
        return _tied(self.template, self.comps, None)


def _slice_template(t: quant.QTensor) -> quant.QTensor:
    # the template of one slice along the leading (stacked) axis
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), t)


def _template(qt: quant.QTensor) -> quant.QTensor:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), qt)


def _scan_rule(eqn, invals: list) -> list:
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    new_invals, body_lazy, linear = [], {}, []
    n_consts = 0
    given_linear = eqn.params.get("linear")  # not a scan parameter in every JAX release
    for k, x in enumerate(invals):
        lin = given_linear[k] if given_linear is not None else False
        pushable = isinstance(x, _Lazy) and (k < nc or (k >= nc + ncarry and len(x.template.q.shape) > 2))
        if pushable:
            tmpl = x.template if k < nc else _slice_template(x.template)
            body_lazy[k] = tmpl  # keyed by the body input it replaces
            new_invals.extend(x.comps)
            linear.extend([False] * len(x.comps))
            n_consts += len(x.comps) if k < nc else 0
        else:
            new_invals.append(x.value() if isinstance(x, _Lazy) else x)
            linear.append(lin)
            n_consts += 1 if k < nc else 0
    if not body_lazy:
        return core.bind_eqn(eqn, new_invals)
    body = _rewrite_closed(eqn.params["jaxpr"], body_lazy, {})
    params = dict(eqn.params, jaxpr=body, num_consts=n_consts)
    if given_linear is not None:
        params["linear"] = tuple(linear)
    return core.bind_eqn(eqn, new_invals, params)


def _tied(template: quant.QTensor, comps: Sequence, anchor) -> jax.Array:
    """The float value of ``comps``, computed from them *and* ``anchor`` (a value of the reader).

    XLA's CPU pipeline removes ``optimization_barrier`` s before common
    subexpression elimination, so barriers alone do not keep two readers of
    one frozen matrix (its forward and backward products) from sharing one
    dequantized copy, which then lives from the forward pass to the backward
    pass. Here each reader's dequantization also reads one element ``e`` of
    that reader's other operand: the block scales go through ``min(scale,
    max(|e|, 65504))`` (65504 when ``e`` is NaN), which leaves every finite
    float16 scale as it is, but makes the computations of two readers
    different (no sharing) and places each one after its reader's operand
    exists (just in time). A ``bf16`` tensor's values go through the same
    ``min`` with the largest float32 instead.
    """
    tree = jax.tree.structure(template)
    qt = jax.tree_util.tree_unflatten(tree, list(comps))
    if anchor is None:
        return quant.dequantize(qt)
    e = jnp.reshape(anchor, (-1,))[0].astype(jnp.float32)
    if qt.qtype == "bf16":
        limit = jnp.float32(np.finfo(np.float32).max)
        bound = jnp.where(e == e, jnp.maximum(jnp.abs(e), limit), limit)
        return jnp.minimum(quant.dequantize(qt, jnp.float32), bound).astype(qt.dtype)
    limit = jnp.float32(np.finfo(np.float16).max)
    bound = jnp.where(e == e, jnp.maximum(jnp.abs(e), limit), limit)
    scale = jnp.minimum(jnp.asarray(qt.scale).astype(jnp.float32), bound)
    return quant.dequantize(quant.QTensor(qt.qtype, qt.q, scale, qt.min, transposed=qt.transposed,
                                          dtype=qt.dtype))


def _anchor(invals: list):
    for x in invals:
        if not isinstance(x, _Lazy) and isinstance(x, jax.Array | jax.core.Tracer) and jnp.size(x) > 0:
            return x
    return None


def _just_in_time(invals: list) -> list:
    """The equation's operands with each quantized one dequantized for this equation alone (:func:`_tied`)."""
    anchor = _anchor(invals)
    return [_tied(x.template, x.comps, anchor) if isinstance(x, _Lazy) else x for x in invals]


def _gather_rows_rule(eqn, invals: list):
    """An embedding lookup (whole rows of a quantized table): gather the rows' codes, then dequantize them."""
    table, idx = invals[0], invals[1]
    t = table.template
    dn = eqn.params["dimension_numbers"]
    rows, cols = t.stored_shape[-2:] if len(t.stored_shape) == 2 else (None, None)
    if (rows is None or t.transposed or isinstance(idx, _Lazy) or len(invals) != 2
            or tuple(dn.collapsed_slice_dims) != (0,) or tuple(dn.start_index_map) != (0,)
            or tuple(dn.operand_batching_dims) or tuple(eqn.params["slice_sizes"]) != (1, cols)
            or tuple(dn.offset_dims) != (len(eqn.outvars[0].aval.shape) - 1,)):
        return None
    comps = list(table.comps)
    picked = [core.bind_eqn(eqn, [c, idx], dict(eqn.params, fill_value=0, slice_sizes=(1, int(c.shape[-1]))))[0]
              for c in comps]
    tree = jax.tree.structure(t)
    value = quant.dequantize(jax.tree_util.tree_unflatten(tree, picked))
    mode = eqn.params.get("mode")
    if mode is not None and "FILL" in str(mode):
        # the float table's gather fills a row outside the table with NaN (or the fill value)
        fill = eqn.params.get("fill_value")
        fill = jnp.nan if fill is None else fill
        inside = jnp.all((idx >= 0) & (idx < rows), axis=-1)
        value = jnp.where(inside[..., None], value, jnp.asarray(fill, value.dtype))
    return [value.astype(eqn.outvars[0].aval.dtype)]


#: A quantized matrix whose float copy would exceed this many bytes is
#: dequantized in row blocks inside the product that reads it (one block's
#: float copy at a time), not whole.
CHUNK_BYTES = 32 << 20


def _chunked_dot_rule(eqn, invals: list):
    """``dot_general`` reading a large quantized 2-D matrix: one block of its stored rows at a time."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    side = 0 if isinstance(invals[0], _Lazy) else 1
    lazy, other = invals[side], invals[1 - side]
    t = lazy.template
    if isinstance(other, _Lazy) or lb or rb or len(t.stored_shape) != 2:
        return None
    rows, cols = t.stored_shape
    if rows * cols * 4 <= CHUNK_BYTES:
        return None
    n = -(-rows * cols * 4 // CHUNK_BYTES)
    step = -(-rows // n)
    axis = 1 if t.transposed else 0  # the logical axis of the stored rows
    contract = (lc, rc)[side]
    out_dtype = eqn.outvars[0].aval.dtype
    pieces, carry = [], None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        # block after block: each block tied to the previous block's product (one float block alive)
        oth = other
        block = _tied(t, [c[start:stop] for c in lazy.comps], other if carry is None else carry)
        if axis in contract:
            other_axis = (rc, lc)[side][list(contract).index(axis)]
            oth = jax.lax.slice_in_dim(oth, start, stop, axis=other_axis)
        ops = [block, oth] if side == 0 else [oth, block]
        part = core.bind_eqn(eqn, ops)[0]
        if axis in contract:
            carry = part if carry is None else carry + part
        else:
            pieces.append(part)
            carry = part
    if axis in contract:
        return [carry.astype(out_dtype)]
    free = [d for d in range(2) if d not in contract]
    n_other_free = len(other.shape) - len((rc, lc)[side])
    out_axis = free.index(axis) + (n_other_free if side == 1 else 0)
    return [jnp.concatenate(pieces, axis=out_axis)]


def _rule(eqn, invals: list):
    if not any(isinstance(x, _Lazy) for x in invals):
        return None
    if eqn.primitive is P.scan_p:
        return _scan_rule(eqn, invals)
    if eqn.primitive in core.CALL_BODY and eqn.primitive not in core.CUSTOM_DERIVATIVE_CALLS:
        # a call (a jitted helper such as jnp.take): evaluated inline, so its
        # own equations read the quantized operand
        body = eqn.params[core.CALL_BODY[eqn.primitive]]
        return core.eval_jaxpr_with(core.open_jaxpr(body), list(getattr(body, "consts", [])), invals, _rule)
    if eqn.primitive is P.transpose_p:
        (x,) = invals
        nd = len(x.template.shape)
        if tuple(eqn.params["permutation"]) == tuple(range(nd - 2)) + (nd - 1, nd - 2):
            # swapping the last two axes: the same codes, read the other way round
            t = x.template
            return [_Lazy(quant.QTensor(t.qtype, t.q, t.scale, t.min, transposed=not t.transposed,
                                        dtype=t.dtype), x.comps)]
    if eqn.primitive is P.gather_p and isinstance(invals[0], _Lazy):
        out = _gather_rows_rule(eqn, invals)
        if out is not None:
            return out
    if eqn.primitive is P.dot_general_p:
        out = _chunked_dot_rule(eqn, invals)
        if out is not None:
            return out
    # one dequantization per equation that reads the matrix, right before it
    return core.bind_eqn(eqn, _just_in_time(invals))


def _rewrite_closed(closed: C.ClosedJaxpr, lazy: dict[int, quant.QTensor],
                    forward_outputs: dict[int, int]) -> C.ClosedJaxpr:
    """``closed`` with invar ``i`` of ``lazy`` replaced by the template's components.

    ``forward_outputs``: output position -> the lazy input index it may
    return as its components (when the output is that input, unchanged).
    """
    inner = closed.jaxpr
    avals = []
    slices = []
    for i, v in enumerate(inner.invars):
        if i in lazy:
            leaves = jax.tree.leaves(lazy[i])
            slices.append((i, len(avals), len(leaves)))
            avals.extend(leaves)
        else:
            slices.append((i, len(avals), 1))
            avals.append(core._aval_struct(v.aval))

    def fun(*flat):
        args = []
        for i, start, n in slices:
            args.append(_Lazy(lazy[i], flat[start:start + n]) if i in lazy else flat[start])
        env_outs = _eval(inner, list(closed.consts), args)
        outs = []
        for o, x in enumerate(env_outs):
            if isinstance(x, _Lazy):
                src = forward_outputs.get(o)
                if src is not None and x is args[src]:
                    outs.extend(x.comps)
                    continue
                x = x.value()
            outs.append(x)
        return outs

    return jax.make_jaxpr(fun)(*avals)


def _eval(jaxpr, consts, args) -> list:
    # core.eval_jaxpr_with, reading _Lazy values through to the rule
    return core.eval_jaxpr_with(jaxpr, consts, args, _rule)


def dequantize_inputs(closed: C.ClosedJaxpr, quantized: dict[int, quant.QTensor],
                      forward_outputs: dict[int, int] | None = None) -> C.ClosedJaxpr:
    """Rewrites a jaxpr traced for float inputs to take quantized ones.

    Args:
      closed: The traced jaxpr; input ``i`` of ``quantized`` is the float
        value of that :class:`~pockjax.quant.QTensor`.
      quantized: Input index -> the QTensor (arrays or ``ShapeDtypeStruct``
        leaves; only shapes and dtypes are read).
      forward_outputs: Output position -> input index: where that output is
        the input itself, it becomes the input's components.

    Returns:
      A closed jaxpr whose inputs are the original ones with each quantized
      input replaced by its components (``jax.tree.leaves`` order), and whose
      outputs are the original ones with each forwarded quantized input
      replaced the same way.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> qt = quant.quantize(np.ones((64, 4), np.float32), "q8_0", transposed=True)
        >>> closed = jax.make_jaxpr(lambda w, x: x @ w)(qt.abstract(), jnp.ones((2, 64)))
        >>> new = dequantize_inputs(closed, {0: qt})
        >>> [(v.aval.shape, v.aval.dtype.name) for v in new.jaxpr.invars]
        [((4, 64), 'int8'), ((4, 2), 'float16'), ((2, 64), 'float32')]
        >>> C.eval_jaxpr(new.jaxpr, new.consts, qt.q, qt.scale, jnp.ones((2, 64)))[0][0, :2]
        Array([64., 64.], dtype=float32)
    """
    lazy = {i: _template(q) for i, q in quantized.items()}
    return _rewrite_closed(closed, lazy, dict(forward_outputs or {}))


def quantized_jit(fn: Callable, **jit_kwargs: Any) -> Callable:
    """``jax.jit(fn)`` that accepts :class:`~pockjax.quant.QTensor` leaves in its arguments.

    ``fn`` is written for float arrays; each QTensor is dequantized right
    before each use inside the compiled function (a ``scan`` over stacked
    layers dequantizes one layer per iteration). Compiled once per argument
    structure and shapes. ``jit_kwargs`` go to ``jax.jit`` of the rewritten
    function (``donate_argnums`` counts flat leaves then, so it is refused).

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> w = np.linspace(-1, 1, 64 * 3, dtype=np.float32).reshape(64, 3)
        >>> qt = quant.quantize(w, "q8_0", transposed=True)
        >>> f = quantized_jit(lambda p, x: x @ p["w"])
        >>> x = jnp.ones((1, 64))
        >>> bool(jnp.allclose(f({"w": qt}, x), x @ quant.dequantize(qt), atol=1e-5))
        True
    """
    if "donate_argnums" in jit_kwargs or "static_argnums" in jit_kwargs:
        raise TypeError("quantized_jit takes no donate_argnums / static_argnums")
    cache: dict = {}

    def prepare(args):
        flat, tree = jax.tree_util.tree_flatten(args, is_leaf=quant.is_qtensor)
        key = (tree, tuple((jax.tree.structure(x), tuple((tuple(y.shape), str(y.dtype)) for y in jax.tree.leaves(x)))
                           for x in flat))
        hit = cache.get(key)
        if hit is None:
            logical = [x.abstract() if quant.is_qtensor(x) else jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype)
                       for x in flat]

            def flat_fn(*leaves):
                return fn(*jax.tree_util.tree_unflatten(tree, list(leaves)))

            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*logical)
            quantized = {i: x for i, x in enumerate(flat) if quant.is_qtensor(x)}
            new = dequantize_inputs(closed, quantized)
            run = jax.jit(lambda *xs: C.eval_jaxpr(new.jaxpr, new.consts, *xs), **jit_kwargs)
            hit = cache[key] = (run, jax.tree.structure(out_shape))
        return hit[0], hit[1], jax.tree.leaves(flat)

    def call(*args):
        run, out_tree, leaves = prepare(args)
        return jax.tree_util.tree_unflatten(out_tree, run(*leaves))

    def lower(*args):
        run, _, leaves = prepare(args)
        return run.lower(*leaves)

    call.lower = lower  # as jax.jit(f).lower(*args): the rewritten function lowered (memory_analysis...)
    return call

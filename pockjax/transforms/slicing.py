"""Channel slices of values, and the rules that push a slice into an op's inputs.

A channel rule asks for ``x[..., idx, ...]`` of a value along one axis. If the
value is computed by an op whose output channels come from a matching axis of
its inputs (elementwise ops, ``dot_general`` free dims, ``transpose``,
``broadcast_in_dim``, reductions over other axes, ``conv_general_dilated``
output features or batch), the op can compute the slice directly from sliced
inputs: the weight-gradient ``dot_general`` or conv of a channel-ruled kernel
then has the reduced shape. Ops with no rule compute the
whole value and are sliced afterwards; that is always correct, only slower.

``PUSH_RULES`` maps a Primitive object to ``rule(eqn, out_select) ->
(operand forms, params) | None``: for each operand, the
:class:`~pockjax.scheme.ChannelSelect` it is needed in, or ``None`` for the
whole value.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
from jax import lax
import jax.numpy as jnp

from pockjax import _compat as C
from pockjax._src.jaxpr import PrimitiveTable, prims
from pockjax.scheme import ChannelSelect

Form = Optional[ChannelSelect]  # None: the whole value


# -- applying a selection --------------------------------------------------------
def take(sel: ChannelSelect, x):
    """``x`` restricted to the selected channels."""
    if sel.is_contiguous:
        return lax.slice_in_dim(x, sel.start, sel.start + sel.count, axis=sel.axis)
    return jnp.take(x, np.asarray(sel.indices, dtype=np.int32), axis=sel.axis)


def put(sel: ChannelSelect, full, part):
    """``full`` with the selected channels replaced by ``part``."""
    if sel.is_contiguous:
        return lax.dynamic_update_slice_in_dim(full, part.astype(full.dtype), sel.start, axis=sel.axis)
    index = (slice(None),) * sel.axis + (np.asarray(sel.indices, dtype=np.int32),)
    return full.at[index].set(part.astype(full.dtype))


def pad(sel: ChannelSelect, part, full_shape):
    """A zero tensor of ``full_shape`` holding ``part`` in the selected channels."""
    if sel.is_contiguous:
        config = [(0, 0, 0)] * part.ndim
        config[sel.axis] = (sel.start, sel.size - sel.start - sel.count, 0)
        return lax.pad(part, np.array(0, dtype=part.dtype), config)
    return put(sel, jnp.zeros(full_shape, part.dtype), part)


def sliced_shape(sel: ChannelSelect, shape):
    shape = list(shape)
    shape[sel.axis] = sel.count
    return tuple(shape)


# -- push rules --------------------------------------------------------------
PushRule = Callable[[C.JaxprEqn, ChannelSelect], Optional[tuple[list[Form], dict]]]
PUSH_RULES: dict[C.Primitive, PushRule] = PrimitiveTable()

ELEMENTWISE = prims(
    "add", "sub", "mul", "div", "max", "min", "pow", "neg", "sqrt", "rsqrt", "cbrt",
    "exp", "exp2", "log", "log1p", "expm1", "sign", "abs", "tanh", "logistic", "sin",
    "cos", "tan", "erf", "erf_inv", "select_n", "add_any", "square", "integer_pow",
    "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "is_finite", "nextafter", "atan2", "rem", "clamp", "copy",
    "reduce_precision", "floor", "ceil", "round", "stop_gradient", "real", "imag",
    "pockjax_param_tag", "pockjax_tangent_tag",
)


def _shape(v):
    return tuple(v.aval.shape)


def _elementwise(eqn: C.JaxprEqn, sel: ChannelSelect):
    out_shape = _shape(eqn.outvars[0])
    forms: list[Form] = []
    for v in eqn.invars:
        s = _shape(v)
        if s == out_shape:
            if isinstance(v, C.Literal):
                return None  # a non-scalar literal; rare, leave it whole
            forms.append(sel)
        elif s == ():
            forms.append(None)
        else:
            return None
    return forms, dict(eqn.params)


for _prim in ELEMENTWISE:
    PUSH_RULES[_prim] = _elementwise


def _broadcast_in_dim(eqn, sel):
    (operand,) = eqn.invars[:1]
    params = dict(eqn.params)
    bdims = tuple(params["broadcast_dimensions"])
    shape = list(params["shape"])
    op_shape = _shape(operand)
    shape[sel.axis] = sel.count
    params["shape"] = tuple(shape)
    if len(eqn.invars) > 1:
        return None  # dynamic shapes
    if sel.axis in bdims:
        j = bdims.index(sel.axis)
        if op_shape[j] == sel.size and not isinstance(operand, C.Literal):
            return [sel.on_axis(j)], params
    return [None], params


def _dot_general(eqn, sel):
    lhs, rhs = eqn.invars
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nl, nr = len(_shape(lhs)), len(_shape(rhs))
    lfree = [d for d in range(nl) if d not in lc and d not in lb]
    rfree = [d for d in range(nr) if d not in rc and d not in rb]
    a = sel.axis
    if a < len(lb):
        return [sel.on_axis(lb[a]), sel.on_axis(rb[a])], dict(eqn.params)
    a -= len(lb)
    if a < len(lfree):
        return [sel.on_axis(lfree[a]), None], dict(eqn.params)
    a -= len(lfree)
    return [None, sel.on_axis(rfree[a])], dict(eqn.params)


def _transpose(eqn, sel):
    perm = eqn.params["permutation"]
    return [sel.on_axis(perm[sel.axis])], dict(eqn.params)


def _reduce(eqn, sel):
    axes = set(eqn.params["axes"])
    kept = [d for d in range(len(_shape(eqn.invars[0]))) if d not in axes]
    return [sel.on_axis(kept[sel.axis])], dict(eqn.params)


PUSH_RULES[C.primitives.broadcast_in_dim_p] = _broadcast_in_dim
PUSH_RULES[C.primitives.dot_general_p] = _dot_general
PUSH_RULES[C.primitives.transpose_p] = _transpose
for _prim in prims("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"):
    PUSH_RULES[_prim] = _reduce


def _conv_general_dilated(eqn, sel):
    """Push a channel slice of a convolution's output into its operands.

    With ``lhs_spec``/``rhs_spec``/``out_spec`` the dimension numbers (each
    ``(batch or out-feature, feature or in-feature, *spatial)`` as axes of the
    array), output feature ``o`` is computed from rhs out-feature ``o`` alone;
    output batch ``n`` from lhs batch ``n`` alone (when ``batch_group_count``
    is 1). Groups split that correspondence into ``G`` blocks: with
    ``feature_group_count = G`` output-feature block ``j`` (of ``O / G``
    features) reads lhs-feature block ``j`` (of ``C / G``); with
    ``batch_group_count = B`` it reads lhs-batch block ``j`` (of ``N / B``;
    the output batch is ``N / B``). A selection made of whole output blocks
    is pushed by taking those blocks of the lhs group axis too and binding
    with the number of blocks kept as the group count. JAX's kernel gradient
    is such a conv (operands swapped; ``batch_group_count = C`` for a
    depth-wise forward conv), so a channel rule on the kernel's output axis
    computes only the selected part of it.
    """
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    fgc, bgc = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
    params = dict(eqn.params)
    if any(isinstance(v, C.Literal) for v in eqn.invars):
        return None
    if sel.axis == out_spec[0] and bgc == 1:
        return [sel.on_axis(lhs_spec[0]), None], params
    if sel.axis != out_spec[1]:
        return None
    rhs_form = sel.on_axis(rhs_spec[0])
    groups = max(fgc, bgc)
    if groups == 1:
        return [None, rhs_form], params
    block = sel.size // groups
    blocks = [i // block for i in sel.indices[::block]]
    if sel.count % block or sel.indices != tuple(j * block + r for j in blocks for r in range(block)):
        return None  # not whole groups
    lhs_axis = lhs_spec[1] if fgc > 1 else lhs_spec[0]
    lhs_size = eqn.invars[0].aval.shape[lhs_axis]
    lhs_block = lhs_size // groups
    lhs_form = ChannelSelect(lhs_axis, lhs_size, tuple(j * lhs_block + r for j in blocks for r in range(lhs_block)))
    params["feature_group_count" if fgc > 1 else "batch_group_count"] = len(blocks)
    return [lhs_form, rhs_form], params


PUSH_RULES[C.primitives.conv_general_dilated_p] = _conv_general_dilated

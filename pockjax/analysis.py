"""Counting what a graph computes: primitives and FLOPs, nested jaxprs included.

The FLOP model: ``dot_general`` costs ``2 * batch * M * N * K``; a
convolution ``2 * out elements * (in features per group) * kernel window``;
reductions one per input element; every other op one per output element;
``scan`` bodies times their length; ``while`` bodies once (trip count
unknown); ``cond`` the most expensive branch.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from pockjax import _compat as C
from pockjax import tags
from pockjax._src import jaxpr as J
from pockjax._src.jaxpr import prims, prims_with_prefix

_P = C.primitives
# Primitive-object tables (names only to build them).
_ONE_PER_INPUT = prims_with_prefix("reduce_") | prims("argmax", "argmin", "cumsum", "cumprod", "cummax")
_FREE = frozenset(tags.TAG_PRIMITIVES) | prims(
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy"
)


def _jaxpr_of(obj):
    if hasattr(obj, "closed_jaxpr"):
        obj = obj.closed_jaxpr
    return getattr(obj, "jaxpr", obj)


def _size(aval) -> int:
    return int(math.prod(getattr(aval, "shape", ()) or ()))


def eqn_flops(eqn: C.JaxprEqn) -> float:
    """FLOPs of one equation, excluding nested jaxprs."""
    prim = eqn.primitive
    if prim is _P.dot_general_p:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        contract = math.prod(lhs[d] for d in lc) if lc else 1
        return 2.0 * _size(eqn.outvars[0].aval) * contract
    if prim is _P.conv_general_dilated_p:
        rhs = eqn.invars[1].aval.shape
        dn = eqn.params["dimension_numbers"]
        out_feature_dim = dn.rhs_spec[0]
        per_output = math.prod(rhs) / rhs[out_feature_dim]
        return 2.0 * _size(eqn.outvars[0].aval) * per_output
    if prim in _ONE_PER_INPUT:
        return float(_size(eqn.invars[0].aval))
    if prim in _FREE:
        return 0.0
    if J.subjaxprs(eqn, strict=False):
        return 0.0
    return float(sum(_size(v.aval) for v in eqn.outvars if hasattr(v, "aval")))


def _costliest_branch(eqn, subs):
    """For ``cond``, attribute only the most expensive branch."""
    if eqn.primitive is not _P.cond_p:
        return subs
    branches = eqn.params["branches"]
    costs = [count_flops(b) for b in branches]
    return [branches[costs.index(max(costs))]]


def _walk(jaxpr, visit, multiplier: float = 1.0):
    """Visit every equation (``scan`` bodies times their length, ``cond``'s costliest branch)."""
    J.walk(jaxpr, visit, multiplier, select=_costliest_branch)


_MATMUL_PRIMITIVES = frozenset({_P.dot_general_p, _P.conv_general_dilated_p})


def count_flops(obj: Any, *, matmul_only: bool = False) -> float:
    """Estimated FLOPs of a jaxpr / ClosedJaxpr / TrainGraph.

    Args:
      obj: What to count.
      matmul_only: Count only matrix products and convolutions (``dot_general``,
        ``conv_general_dilated``), as PyTorch's
        ``torch.utils.flop_counter.FlopCounterMode`` does; elementwise work
        and reductions are left out.

    Example:
        >>> import jax, jax.numpy as jnp, pockjax
        >>> pockjax.count_flops(jax.make_jaxpr(jnp.dot)(jnp.ones((4, 3)), jnp.ones((3, 5))))
        120.0
        >>> j = jax.make_jaxpr(lambda a, b: jnp.tanh(a @ b))(jnp.ones((4, 3)), jnp.ones((3, 5)))
        >>> pockjax.count_flops(j), pockjax.count_flops(j, matmul_only=True)
        (140.0, 120.0)
    """
    total = [0.0]

    def visit(eqn, mult):
        if matmul_only and eqn.primitive not in _MATMUL_PRIMITIVES:
            return
        total[0] += mult * eqn_flops(eqn)

    _walk(_jaxpr_of(obj), visit)
    return total[0]


def count_primitives(obj: Any) -> collections.Counter:
    """How many equations of each primitive (nested jaxprs included, scans once).

    Example:
        >>> import jax, jax.numpy as jnp, pockjax
        >>> dict(pockjax.count_primitives(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)))
        {'sin': 1, 'mul': 1}
    """
    counts = collections.Counter()

    def visit(eqn, mult):
        counts[eqn.primitive.name] += 1

    _walk(_jaxpr_of(obj), visit)
    return counts


def weight_grad_dots(graph) -> list[C.JaxprEqn]:
    """``dot_general`` equations whose result is a parameter gradient.

    Looks for the gradient tags of a traced (un-stripped) graph: a dot whose
    output reaches a ``pockjax_grad_tag`` through shape-only ops (transpose,
    reshape, convert, add_any).
    """
    jaxpr = _jaxpr_of(graph)
    producer = {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producer[v] = eqn
    found = []
    passthrough = prims("transpose", "reshape", "convert_element_type", "add_any", "copy", "pad", "concatenate", "slice")
    for eqn in jaxpr.eqns:
        if eqn.primitive is not tags.grad_tag_p:
            continue
        stack = [eqn.invars[0]]
        while stack:
            v = stack.pop()
            p = producer.get(v)
            if p is None:
                continue
            if p.primitive is _P.dot_general_p:
                found.append(p)
            elif p.primitive in passthrough:
                stack.extend(x for x in p.invars if not isinstance(x, C.Literal))
    return found


@dataclasses.dataclass(frozen=True)
class PruneSummary:
    """What a pass pipeline removed: equations and FLOPs before and after."""

    eqns_before: int
    eqns_after: int
    flops_before: float
    flops_after: float
    primitives_before: dict
    primitives_after: dict

    @property
    def flops_saved(self) -> float:
        return 1.0 - self.flops_after / self.flops_before if self.flops_before else 0.0

    def __str__(self) -> str:
        removed = {
            k: self.primitives_before.get(k, 0) - self.primitives_after.get(k, 0)
            for k in self.primitives_before
            if self.primitives_before.get(k, 0) > self.primitives_after.get(k, 0)
        }
        top = ", ".join(f"{k} -{n}" for k, n in sorted(removed.items(), key=lambda kv: -kv[1])[:6])
        return (
            f"equations {self.eqns_before} -> {self.eqns_after}; "
            f"FLOPs {self.flops_before / 1e6:.2f}M -> {self.flops_after / 1e6:.2f}M "
            f"({100 * self.flops_saved:.1f}% saved)" + (f"; removed {top}" if top else "")
        )

    __repr__ = __str__


def summarize(before, after) -> PruneSummary:
    """Compare two graphs (typically the traced step and the compiled one)."""
    pb, pa = count_primitives(before), count_primitives(after)
    return PruneSummary(
        eqns_before=sum(pb.values()),
        eqns_after=sum(pa.values()),
        flops_before=count_flops(before),
        flops_after=count_flops(after),
        primitives_before=dict(pb),
        primitives_after=dict(pa),
    )

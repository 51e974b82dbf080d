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


def _jaxpr_of(obj):
    if hasattr(obj, "closed_jaxpr"):
        obj = obj.closed_jaxpr
    return getattr(obj, "jaxpr", obj)


def _size(aval) -> int:
    return int(math.prod(getattr(aval, "shape", ()) or ()))


def eqn_flops(eqn: C.JaxprEqn) -> float:
    """FLOPs of one equation, excluding nested jaxprs."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        contract = math.prod(lhs[d] for d in lc) if lc else 1
        return 2.0 * _size(eqn.outvars[0].aval) * contract
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        dn = eqn.params["dimension_numbers"]
        out_feature_dim = dn.rhs_spec[0]
        per_output = math.prod(rhs) / rhs[out_feature_dim]
        return 2.0 * _size(eqn.outvars[0].aval) * per_output
    if name.startswith("reduce_") or name in ("argmax", "argmin", "cumsum", "cumprod", "cummax"):
        return float(_size(eqn.invars[0].aval))
    if name.startswith("pockjax_") or name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p"):
        return 0.0
    if C.subjaxprs_of(eqn):
        return 0.0
    return float(sum(_size(v.aval) for v in eqn.outvars if hasattr(v, "aval")))


def _walk(jaxpr, visit, multiplier: float = 1.0):
    for eqn in jaxpr.eqns:
        visit(eqn, multiplier)
        name = eqn.primitive.name
        subs = C.subjaxprs_of(eqn)
        if name == "cond":
            # attribute the most expensive branch
            branches = eqn.params["branches"]
            costs = [count_flops(b) for b in branches]
            _walk(_jaxpr_of(branches[costs.index(max(costs))]), visit, multiplier)
            continue
        times = float(eqn.params.get("length", 1)) if name == "scan" else 1.0
        for _, sub in subs:
            for s in sub if isinstance(sub, (tuple, list)) else [sub]:
                _walk(_jaxpr_of(s), visit, multiplier * times)


_MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated")


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
        if matmul_only and eqn.primitive.name not in _MATMUL_PRIMITIVES:
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
    passthrough = {"transpose", "reshape", "convert_element_type", "add_any", "copy", "copy_p", "pad", "concatenate"}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "pockjax_grad_tag":
            continue
        stack = [eqn.invars[0]]
        while stack:
            v = stack.pop()
            p = producer.get(v)
            if p is None:
                continue
            if p.primitive.name == "dot_general":
                found.append(p)
            elif p.primitive.name in passthrough or p.primitive.name == "slice":
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

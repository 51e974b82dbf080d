"""Reorder a train step's equations to lower its peak memory, optionally recomputing.

Two independent steps, each kept only when the liveness analysis
(:func:`pockjax.memory.analyze`, fusion modelled as XLA does) says the peak went
down, so the pass never makes the planner's peak worse:

1. **Reorder.** :func:`pockjax.memory.greedy_schedule` list-schedules the
   top-level equations (among the ready ones, run the one that grows live memory
   the least). Any topological order computes the same values; equations with
   effects keep their relative order. ``optimization_barrier`` equations (from
   :func:`pockjax.inplace_update`) are ordinary nodes, so the order they pin is
   kept.
2. **Rematerialise** (``remat_budget`` FLOPs, off by default). A *saved
   activation* (defined in the forward pass, read by the backward pass) that an
   elementwise equation computes from values that are live at its first backward
   reader anyway (or are small, at most 1/8 of its size) is recomputed right
   before that reader instead of being kept: its buffer then dies at its last
   forward reader. Chains of up to ``max_depth`` elementwise equations are
   recomputed together (``silu(a) * b`` from ``a`` and ``b``). Candidates are taken
   largest first while the added FLOPs (one per element per recomputed equation,
   ``transcendental_cost`` for ``exp``, ``tanh``, ``logistic``...) fit in the budget.
   The recomputed chain's operands go through an ``optimization_barrier`` with a
   backward value of the reader, as ``jax.checkpoint`` does, so that XLA neither
   merges the recomputation with the original (CSE) nor hoists it into the
   forward pass.

The pass records what it did in a :class:`ReorderForMemoryRecord`: the
planner's peak before and after each step, how many values were recomputed, and
the FLOPs added.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pockjax import _compat as C
from pockjax._src import jaxpr as _interp
from pockjax._src.jaxpr import Phase, prims
from pockjax.graph import PassRecord, TrainGraph
from pockjax.transforms.base import Pass

__all__ = ["ReorderForMemoryRecord", "reorder_for_memory"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReorderForMemoryRecord(PassRecord):
    """What :func:`reorder_for_memory` did (peaks are the planner's, in bytes).

    Attributes:
      peak_before: the peak of the graph the pass was given.
      peak_reordered: the peak after the reorder step (``peak_before`` if not kept).
      peak_after: the peak of the graph the pass returned.
      reordered: whether the new equation order was kept.
      rematerialized: how many saved activations are recomputed.
      remat_flops: the FLOPs the recomputation adds.
    """

    name: str = "reorder_for_memory"
    peak_before: int
    peak_reordered: int
    peak_after: int
    reordered: bool
    rematerialized: int
    remat_flops: float

_STATE_ROLES = ("param", "opt_state", "model_state")

# elementwise primitives worth recomputing, and their FLOPs per element (Primitive objects)
_CHEAP = prims(
    "add", "sub", "mul", "neg", "max", "min", "abs", "select_n", "convert_element_type",
    "square", "integer_pow", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "sign", "clamp", "add_any", "transpose", "pockjax_param_tag",
)
_TRANSCENDENTAL = prims("exp", "log", "tanh", "logistic", "rsqrt", "sqrt", "div", "erf", "sin", "cos")
_NO_FLOP = prims("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "transpose",
                 "pockjax_param_tag")


def _nbytes(aval: Any) -> int:
    try:
        return int(np.prod(aval.shape)) * int(np.dtype(aval.dtype).itemsize)
    except TypeError:
        return 0


_is_var = _interp.is_var


def _peak(graph: TrainGraph, fusion: str) -> int:
    from pockjax.memory import analyze

    return analyze(graph, donate=set(_STATE_ROLES), fusion=fusion).peak_bytes


def _permute(graph: TrainGraph, order: list[int]) -> TrainGraph:
    jaxpr = graph.jaxpr
    new = jaxpr.replace(eqns=[jaxpr.eqns[i] for i in order])
    C.check_jaxpr(new)
    return graph.replace(closed_jaxpr=C.ClosedJaxpr(new, graph.closed_jaxpr.consts))


def _effects_order_kept(jaxpr, order: list[int]) -> bool:
    eff = [i for i in order if jaxpr.eqns[i].effects]
    return eff == sorted(eff)


def _plan_remat(jaxpr, budget: float, max_depth: int, transcendental_cost: float, min_bytes: int):
    """Choose values to recompute; returns ``{var: (first_backward_pos, [eqn idx chain])}`` and FLOPs."""
    eqns = jaxpr.eqns
    n = len(eqns)
    producer = _interp.producers(eqns)
    readers: dict = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v):
                readers.setdefault(v, []).append(i)
    last_use = {v: max(rs) for v, rs in readers.items()}
    outvars = {v for v in jaxpr.outvars if _is_var(v)}
    phases = [_interp.phase(e) for e in eqns]

    def flops(i: int) -> float:
        e = eqns[i]
        prim = e.primitive
        if prim in _NO_FLOP:
            return 0.0
        size = float(np.prod(e.outvars[0].aval.shape))
        return size * (transcendental_cost if prim in _TRANSCENDENTAL else 1.0)

    def chain_for(v, at: int, depth: int, big: int):
        """Equations (in dependency order) recomputing ``v`` before position ``at``, or None."""
        i = producer.get(v)
        if i is None:
            return None
        e = eqns[i]
        prim = e.primitive
        if prim not in _CHEAP and prim not in _TRANSCENDENTAL:
            return None
        if e.effects or _interp.subjaxprs(e, strict=False) or len(e.outvars) != 1:
            return None
        chain: list[int] = []
        for u in e.invars:
            if not _is_var(u):
                continue
            if u not in producer:  # input or constant: alive if read at/after `at` or not donated
                continue
            if last_use.get(u, -1) >= at or _nbytes(u.aval) * 8 <= big:
                continue
            if depth >= max_depth:
                return None
            sub = chain_for(u, at, depth + 1, big)
            if sub is None:
                return None
            chain.extend(c for c in sub if c not in chain)
        chain.append(i)
        return chain

    candidates = []
    for v, i in producer.items():
        if phases[i] is not Phase.FORWARD or v in outvars:
            continue
        size = _nbytes(v.aval)
        if size < min_bytes:
            continue
        back = [r for r in readers.get(v, ()) if phases[r] is Phase.BACKWARD]
        if not back:
            continue
        at = min(back)
        if any(r >= at and phases[r] is not Phase.BACKWARD for r in readers[v]):
            continue
        chain = chain_for(v, at, 1, size)
        if chain is None:
            continue
        cost = sum(flops(c) for c in chain)
        candidates.append((size, -cost, v, at, chain, cost))
    candidates.sort(key=lambda c: (-c[0], -c[1]))
    chosen: dict = {}
    spent = 0.0
    for size, _, v, at, chain, cost in candidates:
        if spent + cost > budget:
            continue
        chosen[v] = (at, chain)
        spent += cost
    del n
    return chosen, spent


def _apply_remat(graph: TrainGraph, chosen: dict) -> TrainGraph:
    jaxpr = graph.jaxpr
    eqns = jaxpr.eqns
    by_pos: dict[int, list] = {}
    for v, (at, chain) in chosen.items():
        by_pos.setdefault(at, []).append((v, chain))
    consts = list(graph.closed_jaxpr.consts)
    producer = _interp.producers(eqns)

    def fun(*args):
        env: dict = {}
        swapped: dict = {}  # var -> recomputed value, for readers at or after its position

        def read(v):
            if isinstance(v, C.Literal):
                return v.val
            return swapped.get(v, env[v])

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for k, e in enumerate(eqns):
            for v, chain in by_pos.get(k, ()):
                # operands of the chain from outside it, tied to a backward value of the reader
                inside = {ov for c in chain for ov in eqns[c].outvars}
                ext = []
                for c in chain:
                    for u in eqns[c].invars:
                        if _is_var(u) and u not in inside and u not in ext:
                            ext.append(u)
                anchor = next(
                    (u for u in e.invars if _is_var(u) and u not in chosen and producer.get(u) is not None
                     and _interp.phase(eqns[producer[u]]) is Phase.BACKWARD),
                    None,
                )
                vals = [read(u) for u in ext] + ([read(anchor)] if anchor is not None else [])
                with C.source_context(e):  # counted in the reader's (backward) phase
                    vals = jax.lax.optimization_barrier(vals)
                local = dict(zip(ext, vals))
                for c in chain:
                    ce = eqns[c]
                    with C.source_context(e):
                        outs = ce.primitive.bind(
                            *[u.val if isinstance(u, C.Literal) else local[u] for u in ce.invars],
                            **C.get_bind_params(ce.primitive, dict(ce.params)),
                        )
                    outs = list(outs) if ce.primitive.multiple_results else [outs]
                    for ov, x in zip(ce.outvars, outs):
                        local[ov] = x
                swapped[v] = local[v]
                if anchor is not None:
                    swapped[anchor] = vals[-1]
            outs = _interp.bind_eqn(e, [read(u) for u in e.invars])
            for v, x in zip(e.outvars, outs):
                if not isinstance(v, C.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars]
    return graph.replace(closed_jaxpr=jax.make_jaxpr(fun)(*avals))


def reorder_for_memory(
    remat_budget: float | None = None,
    *,
    fusion: str = "xla",
    max_depth: int = 2,
    transcendental_cost: float = 8.0,
    min_bytes: int = 64 * 1024,
) -> Pass:
    """A pass: a topological reorder (and optional recomputation) that lowers the peak.

    Args:
      remat_budget: FLOPs the pass may add by recomputing cheap saved activations
        (``None`` or 0: no recomputation). A budget of a few percent of the step's
        FLOPs (``pockjax.count_flops``) is typical.
      fusion: the fusion model the liveness analysis uses (see
        :data:`pockjax.memory.FUSION_MODES`).
      max_depth: longest chain of elementwise equations recomputed for one value.
      transcendental_cost: FLOPs per element charged for ``exp``, ``tanh``, ``div``...
      min_bytes: smallest activation considered for recomputation.

    Returns:
      A :class:`~pockjax.Pass` that records a :class:`ReorderForMemoryRecord`:
      ``peak_before``, ``peak_reordered``, ``peak_after`` (planner bytes),
      ``reordered`` (whether the new order was kept), ``rematerialized`` (values
      recomputed) and ``remat_flops``.

    Example:
      >>> import jax, jax.numpy as jnp, pockjax
      >>> from pockjax.transforms.reorder_for_memory import reorder_for_memory
      >>> def step(p, s, x):          # two big temporaries, each reduced to a scalar
      ...     a = jnp.broadcast_to(x, (64, 256)) @ p; b = jnp.broadcast_to(x * 2.0, (64, 256)) @ p
      ...     return p, s, a.sum() + b.sum()
      >>> g = pockjax.trace_step(step, (jnp.ones((256, 256)), (), jnp.ones(256)))
      >>> m = reorder_for_memory()(g).record(pockjax.transforms.ReorderForMemoryRecord)
      >>> m.peak_after <= m.peak_before
      True
    """
    budget = float(remat_budget or 0.0)

    def reorder_for_memory_pass(graph: TrainGraph) -> TrainGraph:
        from pockjax.memory import greedy_schedule

        before = _peak(graph, fusion)
        donate = [r in _STATE_ROLES for r in graph.in_roles]
        order, _, _ = greedy_schedule(graph.closed_jaxpr, graph.in_roles, donate=donate, fusion=fusion)
        current, peak = graph, before
        reordered = False
        if order != list(range(len(order))) and _effects_order_kept(graph.jaxpr, order):
            candidate = _permute(graph, order)
            p = _peak(candidate, fusion)
            if p < peak:
                current, peak, reordered = candidate, p, True
        peak_reordered = peak
        n_remat, flops = 0, 0.0
        if budget > 0:
            chosen, spent = _plan_remat(current.jaxpr, budget, max_depth, transcendental_cost, min_bytes)
            if chosen:
                candidate = _apply_remat(current, chosen)
                p = _peak(candidate, fusion)
                if p < peak:
                    current, peak, n_remat, flops = candidate, p, len(chosen), spent
        record = ReorderForMemoryRecord(
            peak_before=before,
            peak_reordered=peak_reordered,
            peak_after=peak,
            reordered=reordered,
            rematerialized=n_remat,
            remat_flops=flops,
        )
        return current.recorded(record)

    return Pass("reorder_for_memory", reorder_for_memory_pass)

"""The budgeted search: the set of units with the best predicted gain that fits.

Gains are additive over units (:mod:`pockjax.search.contribution`); costs are
not (:mod:`pockjax.search.cost`): the deepest unit of a set fixes the
activation-gradient FLOPs and the saved activations. So the search enumerates
that *anchor*: for each unit ``a`` whose cost alone fits, every unit no deeper
than ``a`` is a candidate whose extra cost is only its own weight gradient,
update and optimizer state; that is a two-constraint knapsack (FLOPs, memory),
solved greedily by gain per normalised cost and then improved by one-for-one
swaps and refills. The best set over all anchors wins. With a
:class:`~pockjax.search.cost.StepGraph`, the winner is measured exactly and
the search repeats with tightened budgets until the exact figures fit.

Example:
  >>> from flax import nnx
  >>> from pockjax.models import llama
  >>> from pockjax.search.cost import StepGraph, calibrate
  >>> from pockjax.search.units import Unit, all_units
  >>> model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  >>> sg = StepGraph.for_model(model, batch=2, seq=16)
  >>> cm = calibrate(sg)
  >>> gains = {u: (2.0 if u.kind == "wq" else 1.0) for u in all_units(model.config)}
  >>> budget = sg.evaluate([Unit(1, "wq"), Unit(1, "wo")])
  >>> r = search(gains, cm, flops_budget=budget.flops, step_graph=sg)
  >>> r.exact.flops <= budget.flops, Unit(1, "wq") in r.units
  (True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from pockjax.errors import PockjaxError
from pockjax.search.cost import CostModel, Exact, StepGraph
from pockjax.search.units import Unit

__all__ = ["BudgetError", "SearchResult", "search"]


class BudgetError(PockjaxError, ValueError):
    """No unit fits the budget."""


@dataclasses.dataclass
class SearchResult:
    """The chosen set and its figures.

    Attributes:
      units: the chosen units (sorted).
      gain: predicted gain (sum of the units' gains).
      flops, memory: predicted by the cost model.
      exact: exact figures of the pruned step (None without a step graph).
      flops_budget, memory_budget: the budgets (None: unbounded).
      anchors: anchors tried; rounds: exact re-checks.
    """

    units: list
    gain: float
    flops: float
    memory: float
    exact: Exact | None
    flops_budget: float | None
    memory_budget: float | None
    anchors: int
    rounds: int


def _fits(f, m, bf, bm) -> bool:
    return (bf is None or f <= bf) and (bm is None or m <= bm)


def _knapsack(anchor: Unit, cands: Sequence[Unit], gains: dict, cm: CostModel, bf, bm, refine: bool):
    """Greedy + swap refinement for one anchor; returns (units, gain) or None."""
    m0, md, mp = cm.mem_coef
    base_f = cm.fwd_flops + cm.depth(anchor) + cm.weight(anchor)
    base_m = m0 + md * cm.depth(anchor) / cm.block_flops + mp * cm.param_bytes[anchor.kind]
    if not _fits(base_f, base_m, bf, bm):
        return None
    rf = None if bf is None else bf - base_f
    rm = None if bm is None else bm - base_m
    wf = {u: cm.weight(u) + (cm.extra(anchor.block, anchor.kind, u.kind) if u.block == anchor.block else 0.0)
          for u in cands}
    wm = {u: mp * cm.param_bytes[u.kind] for u in cands}

    def norm_cost(u):
        c = 0.0
        if rf is not None:
            c += wf[u] / max(rf, 1e-9)
        if rm is not None:
            c += max(wm[u], 0.0) / max(rm, 1e-9)
        return c if c > 0 else 1e-12

    order = sorted(cands, key=lambda u: -gains[u] / norm_cost(u))
    chosen, used_f, used_m = [], 0.0, 0.0

    def ok(f, m):
        return (rf is None or f <= rf) and (rm is None or m <= rm)

    for u in order:
        if ok(used_f + wf[u], used_m + wm[u]):
            chosen.append(u)
            used_f += wf[u]
            used_m += wm[u]
    if refine:
        improved = True
        while improved:
            improved = False
            inside = set(chosen)
            outside = [u for u in order if u not in inside]
            for out in sorted(chosen, key=lambda u: gains[u]):
                for new in outside:
                    if gains[new] <= gains[out]:
                        continue
                    f = used_f - wf[out] + wf[new]
                    m = used_m - wm[out] + wm[new]
                    if ok(f, m):
                        chosen.remove(out)
                        chosen.append(new)
                        used_f, used_m = f, m
                        # refill with whatever now fits
                        inside = set(chosen)
                        for u in order:
                            if u not in inside and ok(used_f + wf[u], used_m + wm[u]):
                                chosen.append(u)
                                inside.add(u)
                                used_f += wf[u]
                                used_m += wm[u]
                        improved = True
                        break
                if improved:
                    break
    units = [anchor] + chosen
    return units, sum(gains[u] for u in units)


def _search_once(gains, cm, bf, bm, refine_top):
    units = list(gains)
    depth = {u: cm.depth(u) for u in units}
    # each anchor: candidates strictly shallower, or as deep but ordered after it
    results = []
    for a in units:
        cands = [u for u in units if u != a and (depth[u], u) < (depth[a], a)]
        r = _knapsack(a, cands, gains, cm, bf, bm, refine=False)
        if r is not None:
            results.append((r[1], a, cands))
    if not results:
        return None, 0
    results.sort(key=lambda t: -t[0])
    best = None
    for _, a, cands in results[:refine_top]:
        r = _knapsack(a, cands, gains, cm, bf, bm, refine=True)
        if best is None or r[1] > best[1]:
            best = r
    return best, len(results)


def search(gains: dict, cm: CostModel, *, flops_budget: float | None = None, memory_budget: float | None = None,
           step_graph: StepGraph | None = None, incumbents: Sequence[Sequence[Unit]] = (), refine_top: int = 8,
           max_rounds: int = 6, log: Callable[[str], None] | None = None) -> SearchResult:
    """Picks the units with the best total gain under the budgets (see the module docstring).

    Args:
      gains: ``{unit: predicted gain}`` over the candidate units.
      cm: the calibrated :class:`~pockjax.search.cost.CostModel`.
      flops_budget: the pruned step's FLOPs may not exceed this (the step-time budget).
      memory_budget: the planned peak bytes may not exceed this.
      step_graph: measure candidates exactly: an over-budget winner is repaired by
        dropping its worst units (by gain per cost) and the search repeats with
        budgets tightened by the overshoot; the best exactly-fitting set wins.
      incumbents: sets known to be acceptable answers (the reference scheme): the
        result is never worse than the best of them that fits.
      refine_top: anchors whose greedy solution gets the swap refinement.
      max_rounds: searches at most.

    Raises:
      BudgetError: no budget given, or not even one unit fits.
    """
    if flops_budget is None and memory_budget is None:
        raise BudgetError("give a FLOPs (step-time) budget, a memory budget, or both")
    if not gains:
        raise BudgetError("no candidate units to search over")
    bf, bm = flops_budget, memory_budget
    anchors = 0
    feasible: list = []  # (gain, units, exact)

    def fits_exact(ex):
        return _fits(ex.flops, ex.peak_bytes, flops_budget, memory_budget)

    def cost_share(u):
        c = 0.0
        if flops_budget:
            c += cm.weight(u) / flops_budget
        if memory_budget:
            c += cm.mem_coef[2] * cm.param_bytes[u.kind] / memory_budget
        return c or 1e-12

    for inc in incumbents:
        inc = [u for u in inc if u in gains]
        if inc and step_graph is not None:
            ex = step_graph.evaluate(inc)
            if fits_exact(ex):
                feasible.append((sum(gains[u] for u in inc), sorted(inc), ex))
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        best, n = _search_once(gains, cm, bf, bm, refine_top)
        anchors += n
        if best is None:
            if feasible:
                break
            cheapest = min(gains, key=lambda u: cm.flops([u]))
            raise BudgetError(
                f"no unit fits the budget: the cheapest ({cheapest.name}) needs {cm.flops([cheapest]):.3g} FLOPs"
                f" and {cm.memory([cheapest]) / 2**20:.1f} MiB (budget: "
                f"{'-' if flops_budget is None else f'{flops_budget:.3g}'} FLOPs,"
                f" {'-' if memory_budget is None else f'{memory_budget / 2**20:.1f}'} MiB)")
        units = list(best[0])
        if step_graph is None:
            feasible.append((best[1], sorted(units), None))
            break
        ex = step_graph.evaluate(units)
        if log:
            log(f"round {rounds}: {len(units)} tensors, exact {ex.flops:.4g} FLOPs, {ex.peak_bytes / 2**20:.1f} MiB"
                + ("" if fits_exact(ex) else " (over budget)"))
        if fits_exact(ex):
            feasible.append((best[1], sorted(units), ex))
            break
        # repair: drop the worst units (never the deepest, which fixes the depth) until it fits
        deepest = min(units, key=lambda u: (u.block, -cm.depth(u)))
        rest = sorted((u for u in units if u != deepest), key=lambda u: gains[u] / cost_share(u))
        trial = list(units)
        for u in rest[:8]:
            trial.remove(u)
            ex2 = step_graph.evaluate(trial)
            if fits_exact(ex2):
                feasible.append((sum(gains[x] for x in trial), sorted(trial), ex2))
                break
        if flops_budget is not None and ex.flops > flops_budget:
            bf = bf - (ex.flops - flops_budget) - 1e-3 * flops_budget
        if memory_budget is not None and ex.peak_bytes > memory_budget:
            bm = bm - (ex.peak_bytes - memory_budget) - 1e-3 * memory_budget
    if not feasible:
        raise BudgetError(f"no set found whose exact cost fits after {max_rounds} rounds")
    gain, units, ex = max(feasible, key=lambda t: t[0])
    return SearchResult(units, gain, cm.flops(units), cm.memory(units), ex, flops_budget, memory_budget,
                        anchors, rounds)

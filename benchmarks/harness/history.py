"""The speed goals over many runs of ``pockjax bench`` (``pockjax bench --history``).

One run's ratio is a median of noisy step times: on a machine whose speed
drifts between sittings it can land on either side of a goal. This module reads
several runs' ``results.json`` and puts each speed goal of every run side by
side, with the ratio of every round (the row's and its baseline's processes of
the same round, which ran minutes apart) and a summary over all runs, so a
reader sees the spread instead of one draw.

Example:
  >>> from benchmarks.harness.common import BenchConfig
  >>> from benchmarks.harness.runner import summarize
  >>> raw = [{"row": row, "phase": "speed", "rep": r, "step_times": [t], "losses": [], "setup_s": 0,
  ...         "train_peak_rss": 1} for row, ts in (("torch-full", [3.0, 2.0]), ("pockjax-full", [2.0, 1.6]))
  ...        for r, t in enumerate(ts)]
  >>> run = summarize(raw, BenchConfig(model="tiny"))
  >>> g = goal_history(run)[("pockjax-full", "torch-full")]
  >>> round(g["value"], 3), [round(x, 3) for x in g["rounds"]], g["rounds_met"]
  (1.389, [1.5, 1.25], 1)
"""

from __future__ import annotations

import os
from typing import Sequence

from benchmarks.harness.common import cpu_name, median, read_results
from pockjax.io.atomic import save_figure
from benchmarks.harness.runner import GOALS

__all__ = ["SPEED_GOALS", "goal_history", "load_runs", "cpu_label", "history", "history_table", "plot_history"]

#: The speed goals ``(row, baseline, target)`` of :data:`benchmarks.harness.runner.GOALS`.
SPEED_GOALS = tuple((row, base, target) for row, base, what, target in GOALS if what == "speed")


def _rounds(raw: list[dict], row: str) -> dict[int, list[float]]:
    """Step times of ``row``'s speed processes by round.

    Runs written before results carried ``rep`` list a row's processes in round
    order (the runner appends them round by round), so the k-th is round k.
    """
    out: dict[int, list[float]] = {}
    k = 0
    for r in raw:
        if r.get("phase") != "speed" or r.get("row") != row:
            continue
        rep = r.get("rep", k)
        k += 1
        if r.get("step_times"):
            out[rep] = list(r["step_times"])
    return out


def goal_history(run: dict) -> dict[tuple[str, str], dict]:
    """Each speed goal one run measured, as it recorded it, with the ratio of every round.

    Args:
      run: A ``results.json`` of ``pockjax bench`` (loaded).

    Returns:
      ``{(row, baseline): {"value", "target", "met", "rounds", "rounds_met"}}``:
      ``value``, ``target`` and ``met`` the run's own goal (the ratio of median
      step times, the baseline's over the row's), ``rounds`` that ratio per round.
    """
    out = {}
    for g in run.get("goals", []):
        if g["what"] != "speed" or g["value"] is None:
            continue
        a, b = _rounds(run.get("raw", []), g["row"]), _rounds(run.get("raw", []), g["baseline"])
        rounds = [median(b[k]) / median(a[k]) for k in sorted(set(a) & set(b))]
        out[(g["row"], g["baseline"])] = {"value": g["value"], "target": g["target"], "met": g["met"],
                                          "rounds": rounds,
                                          "rounds_met": sum(x >= g["target"] for x in rounds)}
    return out


def load_runs(paths: Sequence[str]) -> list[tuple[str, dict]]:
    """``(path, results)`` of each ``results.json`` (or a directory holding one),
    oldest first by the run's date; runs without a speed phase are left out.

    Raises:
      FileMissingError: a path that is neither a results file nor a directory with one.
      ResultsFileError: a file that is not a ``results.json`` of ``pockjax bench``.
    """
    runs = []
    for p in paths:
        f = os.path.join(p, "results.json") if os.path.isdir(p) else p
        res = read_results(p)
        if res.get("speed"):
            runs.append((f, res))
    runs.sort(key=lambda pr: pr[1]["date"])
    return runs


def cpu_label(res: dict) -> str:
    """The CPU column of a run: its model, ``(AVX-512)`` where the run recorded
    it, and ``MKL any-CPU`` when its PyTorch rows ran with ``--torch-mkl-any-cpu``.

    Example:
      >>> cpu_label({"machine": {"cpu": "AMD EPYC", "avx512": True},
      ...            "config": {"torch_mkl_any_cpu": True}})
      'AMD EPYC (AVX-512), MKL any-CPU'
      >>> cpu_label({"machine": {"cpu": "AMD EPYC"}, "config": {}})
      'AMD EPYC'
    """
    any_cpu = res.get("config", {}).get("torch_mkl_any_cpu")
    return cpu_name(res.get("machine", {})) + (", MKL any-CPU" if any_cpu else "")


def history(paths: Sequence[str], goals: Sequence[tuple] = SPEED_GOALS) -> dict:
    """The speed goals (``goals``, in this order) over the runs at ``paths``.

    Returns:
      ``{"runs": [{"name", "path", "date", "cpu", "goals"}], "goals": those of ``goals``
      some run measured, "summary": {(row, baseline):
      {"target", "runs", "runs_met", "median", "min", "max", "rounds", "rounds_met"}},
      "complete": runs that measured every goal, "all_met": those of them that met
      every goal}``. Runs that measure none of the goals are left out.
    """
    runs = []
    for path, res in load_runs(paths):
        g = goal_history(res)
        if g:  # a run of other rows measures none of the goals
            runs.append({"name": os.path.basename(os.path.dirname(path)) or path, "path": path,
                         "date": res["date"], "cpu": cpu_label(res), "goals": g})
    summary = {}
    for row, base, target in goals:
        vals = [r["goals"][(row, base)] for r in runs if (row, base) in r["goals"]]
        if not vals:
            continue
        xs = [v["value"] for v in vals]
        summary[(row, base)] = {"target": target, "runs": len(xs), "runs_met": sum(v["met"] for v in vals),
                                "median": median(xs), "min": min(xs), "max": max(xs),
                                "rounds": sum(len(v["rounds"]) for v in vals),
                                "rounds_met": sum(v["rounds_met"] for v in vals)}
    complete = [r for r in runs if all((row, base) in r["goals"] for row, base, _ in goals)]
    all_met = sum(all(r["goals"][(row, base)]["met"] for row, base, _ in goals) for r in complete)
    return {"runs": runs, "goals": [g for g in goals if g[:2] in summary], "summary": summary,
            "all_met": all_met, "complete": len(complete), "n_goals": len(goals)}


def _label(row: str, base: str, target: float) -> str:
    short = {"pockjax-paper": "paper", "pockjax-full": "pockjax full", "torch-lora": "LoRA",
             "torch-full": "PyTorch full"}
    return f"{short.get(row, row)} vs {short.get(base, base)} (goal {target:g}x)"


def history_table(h: dict) -> str:
    """:func:`history` as markdown: a line per run (each goal's ratio, its rounds
    in brackets, ``*`` where met) and the summary over runs."""
    present = h["goals"]
    head = "| run | date | CPU | " + " | ".join(_label(*g) for g in present) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(present)]
    for run in h["runs"]:
        cells = []
        for row, base, _ in present:
            g = run["goals"].get((row, base))
            if g is None:
                cells.append("")
                continue
            rounds = " / ".join(f"{x:.2f}" for x in g["rounds"])
            cells.append(f"{g['value']:.2f}x{' *' if g['met'] else ''} ({rounds})")
        lines.append(f"| {run['name']} | {run['date']} | {run['cpu']} | " + " | ".join(cells) + " |")
    lines += ["", "`*`: met in that run; in brackets: the ratio in each round.", ""]
    for row, base, target in present:
        s = h["summary"][(row, base)]
        lines.append(f"- {_label(row, base, target)}: median {s['median']:.2f}x over {s['runs']} runs"
                     f" ({s['min']:.2f}x-{s['max']:.2f}x); met in {s['runs_met']} of {s['runs']} runs"
                     f" and {s['rounds_met']} of {s['rounds']} rounds")
    lines.append(f"- every speed goal met in the same run: {h['all_met']} of the {h['complete']} runs"
                 f" that measured all {h['n_goals']}")
    return "\n".join(lines) + "\n"


def plot_history(h: dict, path: str) -> str | None:
    """A panel per speed goal: each run's ratio (a bar) and its rounds' ratios
    (dots) against the goal (a line), oldest run first (PNG); None without
    matplotlib or runs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    present = h["goals"]
    if not present:
        return None
    runs = h["runs"]
    fig, axes = plt.subplots(len(present), 1, figsize=(max(6.0, 0.55 * len(runs) + 2), 2.6 * len(present)),
                             sharex=True, squeeze=False)
    for ax, (row, base, target) in zip(axes[:, 0], present):
        for i, run in enumerate(runs):
            g = run["goals"].get((row, base))
            if g is None:
                continue
            ax.bar(i, g["value"], color="#3377cc" if g["met"] else "#aabbcc", width=0.6)
            ax.plot([i] * len(g["rounds"]), g["rounds"], "o", color="#333333", markersize=3)
        ax.axhline(target, color="#cc3333", linewidth=1)
        s = h["summary"][(row, base)]
        ax.set_title(f"{_label(row, base, target)}: median {s['median']:.2f}x,"
                     f" met in {s['runs_met']} of {s['runs']} runs", fontsize=10)
        ax.set_ylabel("speed-up")
    axes[-1, 0].set_xticks(range(len(runs)))
    axes[-1, 0].set_xticklabels([r["name"] for r in runs], rotation=45, ha="right", fontsize=8)
    fig.suptitle("pockjax bench --history: bars = a run's ratio (dark: goal met), dots = its rounds,"
                 " line = the goal", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)

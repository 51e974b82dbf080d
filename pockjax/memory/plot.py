"""Timeline plots: memory over the step, stacked by category (matplotlib, optional)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pockjax.io.atomic import atomic_open
from pockjax.memory.liveness import MemoryReport, format_bytes

__all__ = ["plot_timeline"]

_COLORS = {
    "weights": "#4c72b0",
    "optimizer_state": "#8172b3",
    "model_state": "#64b5cd",
    "batch": "#937860",
    "saved_activation": "#dd8452",
    "gradient": "#c44e52",
    "temporary": "#55a868",
    "output": "#8c8c8c",
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            "plot_timeline needs matplotlib: pip install 'pockjax[plot]' (or matplotlib>=3.8)"
        ) from e
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _columns(report: MemoryReport, max_points: int) -> tuple[Any, Any]:
    """Equation indices and timeline columns to draw: every column, or for long
    programs the column with the largest total in each of ``max_points`` bins (so the
    peak is always drawn)."""
    import numpy as np

    n = report.n_eqns
    if n <= max_points:
        idx = np.arange(n)
    else:
        total = report.timeline.sum(axis=0)
        edges = np.linspace(0, n, max_points + 1).astype(int)
        idx = np.array([a + int(total[a:b].argmax()) for a, b in zip(edges[:-1], edges[1:]) if b > a])
    return idx, report.timeline[:, idx]


def _draw(
    ax: Any, report: MemoryReport, title: str, unit: float, unit_name: str, ymax: float | None, max_points: int
) -> None:
    x, cols = _columns(report, max_points)
    rows = [(c, cols[i] / unit) for i, c in enumerate(report.categories) if cols[i].any()]
    if rows:
        ax.stackplot(
            x,
            *[r for _, r in rows],
            labels=[c.replace("_", " ") for c, _ in rows],
            colors=[_COLORS.get(c, None) for c, _ in rows],
            linewidth=0,
        )
    peak = report.peak_bytes / unit
    ax.axvline(report.peak_index, color="black", linestyle="--", linewidth=0.8)
    ax.annotate(
        f"peak {format_bytes(report.peak_bytes)}",
        xy=(report.peak_index, peak),
        xytext=(0.02, 0.95),
        textcoords="axes fraction",
        va="top",
        fontsize=9,
        arrowprops=dict(arrowstyle="->", linewidth=0.6),
    )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(f"equation ({report.schedule} order)")
    ax.set_ylabel(f"live memory ({unit_name})")
    ax.set_xlim(0, max(report.n_eqns - 1, 1))
    ax.set_ylim(0, (ymax or peak) * 1.08 + 1e-12)


def plot_timeline(
    report: MemoryReport,
    path: str | os.PathLike,
    *,
    before: MemoryReport | None = None,
    titles: Sequence[str] = ("before", "after"),
    formats: Sequence[str] = ("png", "svg"),
    dpi: int = 120,
    max_points: int = 1500,
) -> list[str]:
    """Save a stacked-area plot of live memory per category over the step.

    With ``before``, two panels share the y axis: ``before`` on the left, ``report``
    on the right (e.g. before and after a pass).

    Args:
      report: the :class:`~pockjax.memory.MemoryReport` to draw.
      path: output path; a suffix in ``formats`` saves that one file, otherwise one
        file per format is written (``path.png``, ``path.svg``).
      before: optional report drawn in a left panel for comparison.
      titles: panel titles (before, after); a single panel uses the last one.
      formats: formats written when ``path`` has no such suffix.
      dpi: resolution of raster formats.
      max_points: longer timelines are drawn from this many columns (in each bin the
        one with the largest total, so the peak is kept); keeps SVGs small.

    Returns:
      The paths written.

    Raises:
      ImportError: if matplotlib is not installed.

    Example:
      >>> import jax, jax.numpy as jnp, tempfile, os
      >>> from pockjax.memory import analyze
      >>> r = analyze(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)) @ x)(jnp.ones((64, 64))))
      >>> d = tempfile.mkdtemp()
      >>> [os.path.basename(p) for p in plot_timeline(r, os.path.join(d, "t"), before=r)]
      ['t.png', 't.svg']
    """
    plt = _pyplot()
    path = os.fspath(path)
    root, ext = os.path.splitext(path)
    targets = [path] if ext.lstrip(".") in formats else [f"{path}.{f}" for f in formats]
    peak = max(report.peak_bytes, before.peak_bytes if before is not None else 0)
    unit, unit_name = next(((s, n) for s, n in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if peak >= s), (1, "B"))
    if before is None:
        fig, ax = plt.subplots(figsize=(8, 4))
        _draw(ax, report, titles[-1] if len(titles) else "", unit, unit_name, None, max_points)
    else:
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
        _draw(ax0, before, titles[0], unit, unit_name, peak / unit, max_points)
        _draw(ax1, report, titles[1] if len(titles) > 1 else "", unit, unit_name, peak / unit, max_points)
    handles: dict[str, Any] = {}
    for a in fig.axes:
        for h, lab in zip(*a.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    order = [c.replace("_", " ") for c in report.categories if c.replace("_", " ") in handles]
    fig.legend([handles[k] for k in order], order, loc="lower center", ncol=len(order), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    written = []
    try:
        for t in targets:
            os.makedirs(os.path.dirname(os.path.abspath(t)), exist_ok=True)
            with atomic_open(t, "wb") as f:
                fig.savefig(f, format=os.path.splitext(t)[1].lstrip(".").lower(), dpi=dpi)
            written.append(t)
    finally:
        plt.close(fig)
    return written

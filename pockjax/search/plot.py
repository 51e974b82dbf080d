"""The gain-against-cost plot of a search report (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from pockjax.io.atomic import save_figure

__all__ = ["plot_gain_vs_cost"]

_COLORS = {"wq": "tab:blue", "wk": "tab:cyan", "wv": "tab:purple", "wo": "tab:olive",
           "w1": "tab:green", "w3": "tab:orange", "w2": "tab:red"}


def plot_gain_vs_cost(report: dict, path: str, *, gain_label: str = "predicted gain (Adam first-order loss decrease)",
                      log_scale: bool = True) -> str:
    """Left: each unit's gain against its FLOPs when trained alone (depth included),
    chosen units ringed in black, the reference scheme's marked with x. Right: gain
    by block for each kind. Writes a PNG to ``path`` and returns it.

    ``report["units"]``: rows with ``kind``, ``block``, ``gain``, ``flops_alone``,
    ``chosen`` and ``reference`` (the LLaMA search's, or the classifiers'
    :mod:`pockjax.search.classifier`, whose kinds get colours in their order)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["units"]
    kinds = list(report.get("by_kind") or dict.fromkeys(r["kind"] for r in rows))  # forward order
    colors = {k: _COLORS.get(k, f"C{i}") for i, k in enumerate(kinds)} if set(kinds) - set(_COLORS) else _COLORS
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for kind, color in colors.items():
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        a.scatter([r["flops_alone"] / 1e9 for r in rs], [r["gain"] for r in rs], s=22, c=color, label=kind,
                  alpha=0.85)
        ch = [r for r in rs if r["chosen"]]
        a.scatter([r["flops_alone"] / 1e9 for r in ch], [r["gain"] for r in ch], s=60, facecolors="none",
                  edgecolors="black", linewidths=1.0)
        ref = [r for r in rs if r["reference"]]
        a.scatter([r["flops_alone"] / 1e9 for r in ref], [r["gain"] for r in ref], s=14, marker="x", c="black",
                  linewidths=0.7)
        rs = sorted(rs, key=lambda r: r["block"])
        b.plot([r["block"] for r in rs], [r["gain"] for r in rs], "-o", ms=3, c=color, label=kind)
    a.set_xlabel("backward GFLOP when trained alone (depth + weight gradient)")
    a.set_ylabel(gain_label)
    a.set_title("gain vs cost (o: searched, x: reference)")
    a.legend(fontsize=8, ncol=2)
    b.set_xlabel("block")
    b.set_ylabel(gain_label.split(" (")[0])
    if log_scale:
        a.set_yscale("log")
        b.set_yscale("log")
    else:
        a.axhline(0.0, color="grey", linewidth=0.6)
        b.axhline(0.0, color="grey", linewidth=0.6)
    b.xaxis.get_major_locator().set_params(integer=True)
    b.set_title("gain by block and tensor kind")
    b.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return save_figure(fig, path)

"""``memory_report(compiled_step)``: the planner's figures next to XLA's, with plots.

For a :class:`pockjax.CompiledStep` it analyses two graphs with the same memory
model (:func:`pockjax.memory.analyze`, parameters and optimizer state donated as
:func:`pockjax.compile` donates them):

* *before*: the step as traced, with only dead code removed (no sparse update,
  no memory passes), in the order JAX emitted it;
* *after*: the graph the backend compiled (after all passes);

and reads XLA's ``memory_analysis()`` of the executable, and where the scheduled
HLO writes each parameter update (:func:`pockjax.memory.hlo.update_positions`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pockjax.memory.liveness import MemoryReport, analyze, format_bytes
from pockjax.memory.planner import xla_memory

__all__ = ["StepMemoryReport", "memory_report"]

_STATE_ROLES = ("param", "opt_state", "model_state")


@dataclasses.dataclass(frozen=True)
class StepMemoryReport:
    """Memory of one compiled train step, three views.

    Attributes:
      after: planner report of the compiled graph.
      before: planner report of the traced step (dead code removed only).
      xla: :func:`~pockjax.memory.xla_memory` of the executable (``total`` =
        argument + output + temp - alias).
      hlo: :func:`~pockjax.memory.hlo.update_positions` of the executable, or
        ``{}`` when the HLO could not be read.
      passes: names of the passes the graph went through.

    Example:
      >>> import jax, jax.numpy as jnp, optax, pockjax
      >>> from pockjax.memory import memory_report
      >>> tx = optax.adam(1e-2)
      >>> def step(p, s, x):
      ...     loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(p)
      ...     u, s = tx.update(g, s, p)
      ...     return optax.apply_updates(p, u), s, loss
      >>> p = {"w": jnp.ones((8, 8))}
      >>> r = memory_report(pockjax.compile(step).lower(p, tx.init(p), jnp.ones((2, 8))).compile())
      >>> print(r.table().splitlines()[0])
      planner peak, before passes ...
    """

    after: MemoryReport
    before: MemoryReport
    xla: dict
    hlo: dict
    passes: tuple

    @property
    def planner_peak_bytes(self) -> int:
        """The planner's peak of the compiled graph."""
        return self.after.peak_bytes

    @property
    def ratio(self) -> float:
        """Planner peak (compiled graph) / XLA total."""
        return self.after.peak_bytes / max(self.xla.get("total", 0), 1)

    def table(self) -> str:
        """The figures as aligned text lines."""
        x = self.xla
        rows = [
            ("planner peak, before passes", format_bytes(self.before.peak_bytes)),
            ("planner peak, compiled graph", format_bytes(self.after.peak_bytes)),
            ("  of which gradients", format_bytes(self.after.peak_breakdown.get("gradient", 0))),
            ("  of which saved activations", format_bytes(self.after.peak_breakdown.get("saved_activation", 0))),
            ("XLA argument", format_bytes(x.get("argument_size_in_bytes", 0))),
            ("XLA output", format_bytes(x.get("output_size_in_bytes", 0))),
            ("XLA alias (donated)", format_bytes(x.get("alias_size_in_bytes", 0))),
            ("XLA temp", format_bytes(x.get("temp_size_in_bytes", 0))),
            ("XLA total (a+o+t-al)", format_bytes(x.get("total", 0))),
            ("planner / XLA", f"{self.ratio:.3f}"),
        ]
        if self.hlo:
            rows.append(
                (
                    "param updates during backward",
                    f"{self.hlo['before_backward_end']} of {self.hlo['n_params']} (scheduled HLO)",
                )
            )
        if self.passes:
            rows.append(("passes", ", ".join(self.passes)))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v:>14}" if k != "passes" else f"{k:<{w}}  {v}" for k, v in rows)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | os.PathLike, *, formats=("png", "svg"), titles=None) -> list[str]:
        """Timeline of live memory by category, before and after the passes, side by side.

        Args:
          path: output path (a ``.png``/``.svg`` suffix writes that file, otherwise
            one file per format).
          formats: formats to write when ``path`` has no suffix.
          titles: the two panel titles.

        Returns:
          The paths written.
        """
        from pockjax.memory.plot import plot_timeline

        titles = titles or (
            f"as traced (peak {format_bytes(self.before.peak_bytes)})",
            f"compiled graph (peak {format_bytes(self.after.peak_bytes)}; XLA {format_bytes(self.xla.get('total', 0))})",
        )
        return plot_timeline(self.after, path, before=self.before, titles=titles, formats=formats)


def memory_report(compiled_step: Any, *, donate: bool = True, fusion: str = "xla") -> StepMemoryReport:
    """Planner figures of a compiled step next to XLA's memory analysis.

    Args:
      compiled_step: a :class:`pockjax.CompiledStep` (``pockjax.compile(step).lower(*args).compile()``).
      donate: whether parameters and optimizer state were donated (pockjax's default).
      fusion: fusion model of the planner.

    Returns:
      A :class:`StepMemoryReport` (``.table()``, ``.plot(path)``).
    """
    from pockjax.transforms.dce import dce
    from pockjax.transforms.strip_tags import strip_tags

    graph = compiled_step.graph
    forwarded = {src for src in getattr(compiled_step, "passthrough", ()) if src is not None}
    if donate:
        mask = [r in _STATE_ROLES and i not in forwarded for i, r in enumerate(graph.in_roles)]
    else:
        mask = False
    after = analyze(graph, donate=mask, fusion=fusion)
    traced = compiled_step.traced
    before = analyze(dce()(strip_tags()(traced)), donate=set(_STATE_ROLES) if donate else False, fusion=fusion)
    compiled = compiled_step.executable.compiled
    x = xla_memory(compiled)
    try:
        from pockjax.memory.hlo import update_positions

        pt = getattr(compiled_step, "passthrough", None)
        outs = None if pt is None else [o for o, src in enumerate(pt) if src is None]
        hlo = update_positions(compiled, graph.out_roles, outputs=outs)
    except Exception:  # noqa: BLE001 - the HLO text is best effort
        hlo = {}
    return StepMemoryReport(after, before, x, hlo, graph.pass_names)

"""Memory analysis for train steps: liveness, a planner, XLA comparison, plots.

Everything works from abstract values (``jax.ShapeDtypeStruct``) and never allocates
the arrays it reasons about. :mod:`pockjax.memory.llama_plan` plans the Flax LLaMA
fine-tuning step (what ``pockjax plan`` and ``pockjax memory`` report); the process-RSS
measurements of the benchmarks live in ``benchmarks/_memory_rss.py``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pockjax import memory
  >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  >>> x = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16)
  >>> p = memory.plan(lambda w, x: (x @ w).sum(), (w, x), roles=("param", "batch"), budget_gb=1)
  >>> memory.format_bytes(p.peak_bytes), p.fits
  ('40.00 MiB', True)
"""

from pockjax.memory.liveness import (
    CATEGORIES,
    FUSION_MODES,
    ROLE_CATEGORY,
    SCHEDULES,
    LiveValue,
    MemoryReport,
    analyze,
    aval_bytes,
    format_bytes,
    greedy_schedule,
)
from pockjax.memory.planner import (
    Plan,
    XlaComparison,
    compare_report,
    compare_with_xla,
    flat_roles,
    plan,
    xla_memory,
)
from pockjax.memory.hlo import update_positions
from pockjax.memory.plot import plot_timeline
from pockjax.memory.report import StepMemoryReport, memory_report

__all__ = [
    "CATEGORIES",
    "FUSION_MODES",
    "ROLE_CATEGORY",
    "SCHEDULES",
    "LiveValue",
    "MemoryReport",
    "Plan",
    "StepMemoryReport",
    "XlaComparison",
    "analyze",
    "aval_bytes",
    "compare_report",
    "compare_with_xla",
    "flat_roles",
    "format_bytes",
    "greedy_schedule",
    "memory_report",
    "plan",
    "plot_timeline",
    "update_positions",
    "xla_memory",
]

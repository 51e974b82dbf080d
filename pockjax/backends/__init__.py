"""Compilation backends: what a rewritten train step is compiled with.

- :mod:`pockjax.backends.xla`: the in-process XLA executable (``jax.jit`` of
  the rewritten jaxpr, state donated); ``pockjax.compile`` without ``target=``.
- :mod:`pockjax.backends.iree`: ahead-of-time compilation with IREE (lowering
  to StableHLO, the target table, the workarounds and rewrites for known IREE
  failures, the arm64 runner); ``pockjax.compile(..., target=...)`` and
  ``CompiledStep.export``.

The backends import the core (graph, passes' results) and ``pockjax.runtime``,
never the trainers or tools. Submodules are imported on use so that
``import pockjax.backends`` stays cheap.
"""

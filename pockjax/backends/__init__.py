"""Compilation backends.

- :mod:`pockjax.backends.targets`: the table of IREE targets (no heavy imports).
- :mod:`pockjax.backends.iree`: export to StableHLO, compile with IREE, run with
  state kept on the device (imports JAX and ``iree.compiler``).
- :mod:`pockjax.backends.iree_rewrites`: graph rewrites that avoid IREE
  compiler failures (registered as workarounds in ``iree.WORKAROUNDS``).
- :mod:`pockjax.backends.arm64_runner`: fetches the aarch64 ``iree-run-module``
  and runs arm64 modules under ``qemu-aarch64``.

Submodules are imported on use so that ``import pockjax.backends`` stays cheap.
"""

"""Ahead-of-time compilation of flat JAX functions with IREE.

``pockjax.compile(..., target=...)`` hands this package a function over
*flat* arrays (``jax.extend.core.jaxpr_as_fun(closed_jaxpr)``), the flat
abstract values, and a mask of which inputs are *state* (parameters and
optimizer state that live on the device between steps). By concern:

- :mod:`.targets`: the one table of IREE targets (no heavy imports);
- :mod:`.lowering`: export with ``jax.export`` to StableHLO, compile with
  ``iree.compiler`` (:func:`compile_flat`);
- :mod:`.workarounds` and :mod:`.rewrites`: the known IREE compiler failures
  (:data:`WORKAROUNDS`) and the graph rewrites that avoid some of them;
- :mod:`.parameters`: state kept in module globals read from a parameter
  archive;
- :mod:`.executable`: :class:`CompiledModule`, :class:`IreeExecutable`
  (state kept on the device) and :func:`export_module`;
- :mod:`.step`: :class:`IreeStepExecutable`, the backend of ``pockjax.compile``;
- :mod:`.arm64`: runs arm64 modules on another host under ``qemu-aarch64``.

The names below are imported on first use, so that ``pockjax.backends.iree.targets``
stays cheap.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from pockjax.backends import iree as piree
    >>> def step(w, x):            # state w, batch x -> (new w, aux)
    ...     return w - 0.1 * x, jnp.sum(w * x)
    >>> avals = [jax.ShapeDtypeStruct((3,), jnp.float32)] * 2
    >>> exe = piree.compile_flat(step, avals, "cpu", state_mask=[True, False])
    >>> exe.set_state([np.ones(3, np.float32)])
    >>> [float(a) for a in exe.step(np.ones(3, np.float32))]
    [3.0]
    >>> np.round(exe.get_state()["in0"], 3)
    array([0.9, 0.9, 0.9], dtype=float32)
"""

from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "IreeCompileError": "lowering",
    "compile_flat": "lowering",
    "compile_stablehlo": "lowering",
    "export_stablehlo": "lowering",
    "largest_matmul_macs": "lowering",
    "make_signature": "lowering",
    "versions": "lowering",
    "Workaround": "workarounds",
    "WORKAROUNDS": "workarounds",
    "default_workarounds": "workarounds",
    "wrap_state_as_parameters": "parameters",
    "CompiledModule": "executable",
    "IreeExecutable": "executable",
    "export_module": "executable",
    "CACHING_ALLOCATOR_DRIVERS": "executable",
    "IreeStepExecutable": "step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

"""From a flat JAX function to a compiled IREE module.

:func:`compile_flat` exports the function with ``jax.export`` to StableHLO,
applies the target's :data:`~pockjax.backends.iree.workarounds.WORKAROUNDS`,
optionally moves the state into parameter-backed globals
(:mod:`.parameters`), compiles with ``iree.compiler`` for a
:mod:`.targets` target and binds the result to this machine's device
(:class:`~pockjax.backends.iree.executable.IreeExecutable`) when it can run
here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from pockjax._src import jaxpr as J
from pockjax.backends.iree import targets as _targets
from pockjax.backends.iree.executable import CompiledModule, IreeExecutable
from pockjax.backends.iree.parameters import wrap_state_as_parameters
from pockjax.backends.iree.workarounds import WORKAROUNDS, default_workarounds
from pockjax.runtime.metadata import ModuleMetadata, TensorSpec, host_machine_triple_prefix

__all__ = [
    "IreeCompileError",
    "compile_flat",
    "compile_stablehlo",
    "export_stablehlo",
    "largest_matmul_macs",
    "make_signature",
    "versions",
]


class IreeCompileError(RuntimeError):
    """``iree-compile`` failed; ``.diagnostics`` holds its output."""

    def __init__(self, message: str, diagnostics: str = "", target: str = ""):
        super().__init__(message)
        self.diagnostics = diagnostics
        self.target = target


def versions() -> dict[str, str]:
    """Versions of the tools that produced a module (for metadata)."""
    out = {"jax": jax.__version__}
    try:
        from importlib.metadata import version

        for dist in ("pockjax", "iree-base-compiler", "iree-base-runtime"):
            try:
                out[dist] = version(dist)
            except Exception:  # noqa: BLE001 - not installed as a distribution
                pass
    except ImportError:
        pass
    if "pockjax" not in out:
        try:
            from pockjax import __version__ as pv
        except Exception:  # noqa: BLE001 - a partial checkout
            pv = "unknown"
        out["pockjax"] = f"{pv}+src"
    return out


def export_stablehlo(fun: Callable, flat_avals: Sequence[Any]) -> str:
    """Exports ``fun(*flat_args)`` to StableHLO text (entry ``main``) via ``jax.export``."""
    avals = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in flat_avals]
    exported = jax.export.export(jax.jit(fun, keep_unused=True))(*avals)
    return exported.mlir_module()


#: A folder where :func:`compile_stablehlo` keeps each ``.vmfb`` it compiles, found again by a
#: SHA-256 of the module text, backend, flags and the IREE compiler's version (unset: no cache).
#: The test suite points it to a new folder per run, as it does JAX's compilation cache.
IREE_CACHE_ENV = "POCKJAX_IREE_CACHE_DIR"


def _cache_path(mlir_text: str | bytes, backend: str, flags: Sequence[str]) -> str | None:
    folder = os.environ.get(IREE_CACHE_ENV)
    if not folder:
        return None
    h = hashlib.sha256()
    for part in (versions().get("iree-base-compiler", "unknown"), backend, "\0".join(flags)):
        h.update(part.encode() + b"\1")
    h.update(mlir_text.encode() if isinstance(mlir_text, str) else bytes(mlir_text))
    return os.path.join(folder, h.hexdigest() + ".vmfb")


def compile_stablehlo(
    mlir_text: str | bytes,
    target: "str | _targets.Target",
    extra_flags: Sequence[str] = (),
) -> bytes:
    """Compiles StableHLO (MLIR text or bytecode) to a ``.vmfb`` for ``target``.

    With ``POCKJAX_IREE_CACHE_DIR`` (:data:`IREE_CACHE_ENV`) set, a module
    compiled before with the same text, backend, flags and compiler version
    is read from that folder instead (each written atomically).

    Raises:
      IreeCompileError: with IREE's diagnostics and the target name.
    """
    import iree.compiler as ic

    t = _targets.resolve(target) if isinstance(target, str) else target
    flags = [f for f in t.flags if not f.startswith("--iree-hal-target-backends=")] + list(extra_flags)
    cached = _cache_path(mlir_text, t.backend, flags)
    if cached is not None:
        try:
            with open(cached, "rb") as f:
                return f.read()
        except FileNotFoundError:
            pass
    try:
        vmfb = ic.compile_str(mlir_text, input_type="stablehlo", target_backends=[t.backend], extra_args=flags)
    except ic.CompilerToolError as e:
        diag = str(e)
        first = next((ln for ln in diag.splitlines() if "error:" in ln), diag.strip().splitlines()[0] if diag.strip() else "")
        known = sorted((not w.default, w.name) for w in WORKAROUNDS.values() if w.symptom in diag)
        hint = f" (known IREE issue; workaround {' or '.join(repr(n) for _, n in known)} exists)" if known else ""
        raise IreeCompileError(
            f"iree-compile failed for target {t.name!r} ({t.backend}): {first.strip()}{hint}", diag, t.name
        ) from None
    if cached is not None:
        from pockjax.io.atomic import write_bytes

        os.makedirs(os.path.dirname(cached), exist_ok=True)
        write_bytes(cached, vmfb)
    return vmfb


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def make_signature(
    flat_avals: Sequence[Any],
    out_avals: Sequence[Any],
    state_mask: Sequence[bool] | None,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    state_outputs: Mapping[int, int] | None = None,
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Builds input/output :class:`TensorSpec` lists.

    By default the first ``k`` outputs (``k`` = number of state inputs) are
    the new values of the state inputs, in order, which is what a
    ``(params, opt_state, batch) -> (params, opt_state, aux...)`` step
    flattens to. Pass ``state_outputs={out_index: in_index}`` otherwise; a
    state input that no output replaces (a frozen weight the caller forwards
    itself) is read-only state: uploaded once and left on the device.
    """
    n = len(flat_avals)
    state_mask = list(state_mask) if state_mask is not None else [False] * n
    if len(state_mask) != n:
        raise ValueError(f"state_mask has {len(state_mask)} entries for {n} inputs")
    input_names = list(input_names) if input_names is not None else [f"in{i}" for i in range(n)]
    output_names = list(output_names) if output_names is not None else [f"out{i}" for i in range(len(out_avals))]
    state_in = [i for i, s in enumerate(state_mask) if s]
    if state_outputs is None:
        if len(out_avals) < len(state_in):
            raise ValueError(f"{len(state_in)} state inputs but only {len(out_avals)} outputs")
        state_outputs = {o: i for o, i in enumerate(state_in)}
    inputs = [
        TensorSpec(input_names[i], tuple(a.shape), _dtype_name(a.dtype), "state" if state_mask[i] else "input")
        for i, a in enumerate(flat_avals)
    ]
    outputs = []
    for o, a in enumerate(out_avals):
        if o in state_outputs:
            i = state_outputs[o]
            if not state_mask[i]:
                raise ValueError(f"output {o} is mapped to input {i}, which is not state")
            if tuple(a.shape) != tuple(flat_avals[i].shape) or np.dtype(a.dtype) != np.dtype(flat_avals[i].dtype):
                raise ValueError(
                    f"output {o} {tuple(a.shape)}/{np.dtype(a.dtype)} cannot replace state input {i} "
                    f"{tuple(flat_avals[i].shape)}/{np.dtype(flat_avals[i].dtype)}"
                )
            outputs.append(TensorSpec(output_names[o], tuple(a.shape), _dtype_name(a.dtype), "state", i))
        else:
            outputs.append(TensorSpec(output_names[o], tuple(a.shape), _dtype_name(a.dtype), "aux"))
    # State inputs that no output replaces (frozen weights whose graph output just forwards
    # the input) are read-only state: uploaded once, never changed.
    return inputs, outputs


def compile_flat(
    fun: Callable,
    flat_avals: Sequence[Any],
    target: "str | _targets.Target" = "cpu",
    options: Mapping[str, Any] | None = None,
    *,
    state_mask: Sequence[bool] | None = None,
    state_outputs: Mapping[int, int] | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    workarounds: Sequence[str] | str | None = "default",
    extra: Mapping[str, Any] | None = None,
    bind: bool = True,
    emulate: bool = False,
    state_storage: str = "arguments",
    parameter_scope: str = "model",
) -> "IreeExecutable | CompiledModule":
    """Exports ``fun`` over flat arrays to StableHLO and compiles it with IREE.

    Args:
      fun: function of flat arrays returning a flat tuple/list of arrays.
      flat_avals: ``jax.ShapeDtypeStruct`` (or anything with shape/dtype) per input.
      target: a target name from :mod:`pockjax.backends.iree.targets` or a ``Target``.
      options: target options (``cpu``, ``features``, ``arch``, ``triple``,
        ``static_library``, ``stack_allocation_limit``, ``extra_flags``).
      state_mask: which inputs are state kept on the device between steps.
      state_outputs: ``{output_index: state_input_index}``; default: the
        first outputs replace the state inputs in order.
      input_names, output_names: names for metadata and errors.
      workarounds: ``"default"`` (those registered for the target's backend,
        and after a failure with the symptom of a ``retry`` one, that one
        too), ``None``/``()`` (none) or a list of names from :data:`WORKAROUNDS`.
      extra: free-form metadata (pytree structure, scheme...).
      bind: return an :class:`IreeExecutable` on this machine's device; with
        ``False`` (or for targets this process cannot run) return the
        :class:`CompiledModule` only.
      emulate: for an aarch64 module on another host, bind it to the aarch64
        ``iree-run-module`` run under qemu (:mod:`pockjax.backends.iree.arm64`);
        every step then passes all arrays through ``.npy`` files.
      state_storage: ``"arguments"`` (state passed in and out of ``main``; the
        runtime keeps the device buffers) or ``"parameters"`` (state in module
        globals initialised by name from an IREE parameter archive, see
        :func:`wrap_state_as_parameters`; export with weights and run it with
        ``pockjax.runtime.load``; the result is never bound here).
      parameter_scope: parameter scope for ``"parameters"``.
    """
    t = _targets.resolve(target, **dict(options or {})) if isinstance(target, str) else target
    if t.options.get("data_tiling") == "auto":
        t = _resolve_auto_data_tiling(t, fun, flat_avals)
    if workarounds == "default":
        names = default_workarounds(t)
    elif workarounds is None:
        names = []
    else:
        names = [workarounds] if isinstance(workarounds, str) else list(workarounds)
    unknown = [n for n in names if n not in WORKAROUNDS]
    if unknown:
        raise ValueError(f"unknown workarounds {unknown}; known: {sorted(WORKAROUNDS)}")

    out_shapes = jax.eval_shape(fun, *[jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in flat_avals])
    out_avals = jax.tree.leaves(out_shapes)
    inputs, outputs = make_signature(
        flat_avals, out_avals, state_mask, input_names=input_names, output_names=output_names,
        state_outputs=state_outputs,
    )
    if state_storage not in ("arguments", "parameters"):
        raise ValueError(f"state_storage must be 'arguments' or 'parameters', not {state_storage!r}")

    def build(names):
        f = fun
        for n in names:
            if WORKAROUNDS[n].fun_rewrite is not None:
                f = WORKAROUNDS[n].fun_rewrite(f, flat_avals)
        text = export_stablehlo(f, flat_avals)
        flags: list[str] = []
        for n in names:
            w = WORKAROUNDS[n]
            if w.rewrite is not None:
                text = w.rewrite(text)
            flags += list(w.flags)
        source: str | bytes = text
        if state_storage == "parameters":
            source = wrap_state_as_parameters(text, inputs, outputs, parameter_scope, bytecode=True)
        return text, flags, source

    if state_storage == "parameters":
        bind = False
    text, flags, source = build(names)
    t0 = time.perf_counter()
    try:
        vmfb = compile_stablehlo(source, t, extra_flags=flags)
    except IreeCompileError as e:
        # a known failure whose fix is too costly for every program: compile once more with it
        retry = [w.name for w in WORKAROUNDS.values() if w.retry and w.name not in names
                 and t.backend in w.applies_to and w.symptom in e.diagnostics] if workarounds == "default" else []
        if not retry:
            raise
        names = names + retry
        text, flags, source = build(names)
        vmfb = compile_stablehlo(source, t, extra_flags=flags)
    dt = time.perf_counter() - t0
    meta = ModuleMetadata(
        inputs=inputs,
        outputs=outputs,
        target={**t.to_json(), "flags": list(t.flags) + flags, "workarounds": names},
        versions=versions(),
        module_sha256=hashlib.sha256(vmfb).hexdigest(),
        extra=dict(extra or {}),
        state_storage=state_storage,
        parameter_scope=parameter_scope,
    )
    compiled = CompiledModule(vmfb=bytes(vmfb), metadata=meta, stablehlo=text, compile_seconds=dt,
                              workarounds=tuple(names))
    if not bind:
        return compiled
    if not _runs_here(t):
        if emulate and t.backend == "llvm-cpu" and (t.triple or "").startswith("aarch64"):
            from pockjax.backends.iree import arm64

            return IreeExecutable(compiled, tool=arm64.command_prefix())
        return compiled
    return IreeExecutable(compiled)


def largest_matmul_macs(fun: Callable, flat_avals: Sequence[Any]) -> int:
    """Multiply-adds of the largest ``dot_general`` in ``fun`` (nested jaxprs included)."""
    avals = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in flat_avals]
    best = 0

    def visit(eqn, times):
        nonlocal best
        if eqn.primitive is J.P.dot_general_p:
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
            best = max(best, int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64)) * k)

    J.walk(jax.make_jaxpr(fun)(*avals), visit)
    return best


def _resolve_auto_data_tiling(t: _targets.Target, fun: Callable, flat_avals: Sequence[Any]) -> _targets.Target:
    on = largest_matmul_macs(fun, flat_avals) >= _targets.DATA_TILING_MIN_MACS
    t = dataclasses.replace(t, options={**t.options, "data_tiling": on})
    if not on:
        return t
    # Before the caller's extra_flags, which come last so that they can override these.
    extra = tuple(t.options.get("extra_flags", ()))
    head = t.flags[: len(t.flags) - len(extra)] if extra and t.flags[len(t.flags) - len(extra):] == extra else t.flags
    return dataclasses.replace(t, flags=tuple(head) + _targets.DATA_TILING_FLAGS + extra)


def _runs_here(t: _targets.Target) -> bool:
    if t.backend == "llvm-cpu":
        return bool(t.triple) and t.triple.split("-")[0] == host_machine_triple_prefix() and \
            "static_library" not in t.options
    return t.driver.startswith("local-") or _driver_has_device(t.driver)


@functools.lru_cache(maxsize=None)
def _driver_has_device(driver: str) -> bool:
    """Whether IREE's ``driver`` (``cuda``, ``vulkan``...) finds a device on this machine.

    A GPU module compiled on a machine without that GPU (or its driver
    library) is not bound: it is exported and run on the device.
    """
    try:
        import iree.runtime as rt

        return bool(rt.get_driver(driver).query_available_devices())
    except Exception:  # noqa: BLE001 - no runtime, no driver library, no device: not here
        return False

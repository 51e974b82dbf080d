"""Ahead-of-time compilation of flat JAX functions with IREE.

The lead's ``pockjax.compile(..., target=...)`` hands this module a function
over *flat* arrays (``jax.extend.core.jaxpr_as_fun(closed_jaxpr)``), the flat
abstract values, and a mask of which inputs are *state* (parameters and
optimizer state that live on the device between steps). We

1. export it with ``jax.export`` to StableHLO,
2. optionally rewrite the StableHLO text to dodge known IREE bugs
   (:data:`WORKAROUNDS`),
3. compile it with ``iree.compiler`` for a :mod:`pockjax.backends.targets` target,
4. return an :class:`IreeExecutable` whose call keeps state on the device.

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

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import jax

from pockjax.backends import targets as _targets
from pockjax.runtime import module as _rtmod
from pockjax.runtime.module import (
    METADATA_FILE,
    DeviceSession,
    MODULE_FILE,
    WEIGHTS_FILE,
    ModuleMetadata,
    StatefulModule,
    TensorSpec,
)

__all__ = [
    "IreeCompileError",
    "CompiledModule",
    "IreeExecutable",
    "Workaround",
    "WORKAROUNDS",
    "export_stablehlo",
    "compile_stablehlo",
    "compile_flat",
    "export_module",
    "versions",
]


class IreeCompileError(RuntimeError):
    """``iree-compile`` failed; ``.diagnostics`` holds its output."""

    def __init__(self, message: str, diagnostics: str = "", target: str = ""):
        super().__init__(message)
        self.diagnostics = diagnostics
        self.target = target


# ---------------------------------------------------------------------------
# Workarounds for IREE bugs seen on train steps
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Workaround:
    """A fix for a known IREE failure.

    Attributes:
      name: short id, used in ``compile_flat(..., workarounds=...)``.
      symptom: the substring of the IREE error it fixes.
      applies_to: backends (``llvm-cpu``, ``cuda``...) it is applied for by default.
      flags: extra ``iree-compile`` flags.
      rewrite: optional StableHLO text -> text rewrite.
      fun_rewrite: optional ``(fun, flat_avals) -> fun`` graph rewrite applied
        before export (see :mod:`pockjax.backends.iree_rewrites`).
      why: what goes wrong and why this helps.
      requires_flag: applied by default only to targets whose flags include
        this one (a workaround for a failure that only that flag brings).
      default: applied by default where it applies; ``False`` for an
        alternative that is only applied when named.
    """

    name: str
    symptom: str
    applies_to: tuple[str, ...]
    flags: tuple[str, ...] = ()
    rewrite: Callable[[str], str] | None = None
    fun_rewrite: Callable[[Callable, Sequence[Any]], Callable] | None = None
    why: str = ""
    requires_flag: str | None = None
    default: bool = True


WORKAROUNDS: dict[str, Workaround] = {}


def _register(w: Workaround) -> Workaround:
    WORKAROUNDS[w.name] = w
    return w


_register(
    Workaround(
        name="cuda-reduction-distribution",
        symptom="failed to get neutral element for reduction",
        applies_to=("cuda",),
        flags=("--iree-codegen-llvmgpu-use-reduction-vector-distribution=false",),
        why=(
            "The backward of log-softmax cross-entropy sums the incoming gradient over each "
            "row (fused with the scatter-add or select that produced it). IREE 3.13's LLVMGPU "
            "reduction vector-distribution pipeline picks that dispatch and fails to tile it "
            "('failed to get neutral element for reduction', 'tiling of level PartialReduction "
            "failed'). Turning that pipeline off makes IREE use its generic GPU reduction "
            "lowering, which compiles it."
        ),
    )
)


_register(
    Workaround(
        name="llvmcpu-no-aggressive-fusion",
        symptom="exceeded stack allocation limit",
        applies_to=("llvm-cpu",),
        flags=("--iree-dispatch-creation-enable-aggressive-fusion=false",),
        why=(
            "With aggressive dispatch fusion (on at --iree-opt-level=O3), IREE 3.13 fuses the "
            "embedding gradient (a scatter-add of every token's row into the table) with its "
            "producers and keeps a tile of tokens x dim on the stack; past 32 KiB llvm-cpu "
            "refuses it ('exceeded stack allocation limit'), and raising the limit only trades "
            "that for a worker-stack overflow at run time (IREE's task workers have 128 KiB). "
            "Keeping aggressive fusion off (last flag wins, so this holds even with O3) gives "
            "the scatter its own dispatch, which needs no stack."
        ),
    )
)


def _scatter_rewrite(fun, flat_avals):
    from pockjax.backends import iree_rewrites

    return iree_rewrites.scatter_add_to_select(fun, flat_avals)


_register(
    Workaround(
        name="scatter-add-to-select",
        symptom="op expected indices to be equal to batch rank or batch rank + 1",
        applies_to=("llvm-cpu", "vmvx", "vulkan-spirv", "cuda"),
        fun_rewrite=_scatter_rewrite,
        why=(
            "The backward of take_along_axis (cross-entropy picking the target log-prob) is a "
            "scatter-add into zeros. With batch size 1 JAX emits it with a size-1 window dim next "
            "to a batching dim, which IREE's StableHLO conversion rejects on every backend. Each "
            "logit gets at most one update, so the scatter is rewritten as operand + "
            "where(iota == index, update, 0). See pockjax.backends.iree_rewrites."
        ),
    )
)


_register(
    Workaround(
        name="llvmcpu-no-multi-use-fusion",
        symptom="One or more operations with large vector sizes",
        applies_to=("llvm-cpu",),
        flags=("--iree-dispatch-creation-fuse-multi-use=false",),
        requires_flag="--iree-opt-data-tiling=true",
        why=(
            "With data tiling (the cpu target's default), IREE 3.13 fuses the packing of a "
            "matmul operand (set_encoding) into the dispatch that produces it, also when that "
            "producer has other uses. In the full fine-tuning step the RMSNorm backward yields a "
            "gradient and its transpose from one elementwise op, both packed for the "
            "weight-gradient matmuls; llvm-cpu vectorises that pack of a transposed result as one "
            "64x64 vector and refuses it ('One or more operations with large vector sizes (16384 "
            "bytes)'); turning that check off only trades it for 'exceeded stack allocation "
            "limit' and a 9-minute compile. A second failure of the same family: a weight "
            "gradient over few tokens (batch 1 x 64, or the LM head's gradient over the answer "
            "window, 64 positions) whose AdamW moments are fused into its dispatch needs 145-290 "
            "KiB of stack ('exceeded stack allocation limit'). Both fused producers have several "
            "uses; with multi-use fusion off each keeps its own dispatch. (The alternative "
            "'dot-operands-behind-barrier' avoids the same failures, but every barrier became a "
            "host-side wait in IREE's stream schedule: 354 command buffers per SmolLM2 paper "
            "step against 5 with this flag, and a slower step.)"
        ),
    )
)


def _dot_barrier_rewrite(fun, flat_avals):
    from pockjax.backends import iree_rewrites

    return iree_rewrites.dot_operands_behind_barrier(fun, flat_avals)


_register(
    Workaround(
        name="dot-operands-behind-barrier",
        symptom="One or more operations with large vector sizes",
        applies_to=("llvm-cpu",),
        fun_rewrite=_dot_barrier_rewrite,
        requires_flag="--iree-opt-data-tiling=true",
        default=False,
        why=(
            "An alternative to 'llvmcpu-no-multi-use-fusion', applied only when named: every "
            "computed dot_general operand passes through lax.optimization_barrier, which keeps its "
            "packing in its own dispatch (the values are unchanged), and the result of a batch-free "
            "matmul with a contraction shorter than 256 is fenced as well. Step inputs are left "
            "unfenced, so the packing of a frozen weight in an immutable global can be hoisted to "
            "load time. IREE's stream scheduling turns each barrier into a host-side wait between "
            "command buffers (0.4 s of idle time per SmolLM2 paper step), so the flag is the default."
        ),
    )
)


def default_workarounds(target: _targets.Target) -> list[str]:
    """Names of the workarounds applied by default for a target."""
    return [
        w.name
        for w in WORKAROUNDS.values()
        if w.default and target.backend in w.applies_to
        and (w.requires_flag is None or w.requires_flag in target.flags)
    ]


# ---------------------------------------------------------------------------
# Export and compile
# ---------------------------------------------------------------------------


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


def compile_stablehlo(
    mlir_text: str,
    target: "str | _targets.Target",
    extra_flags: Sequence[str] = (),
) -> bytes:
    """Compiles StableHLO text to a ``.vmfb`` for ``target``.

    Raises:
      IreeCompileError: with IREE's diagnostics and the target name.
    """
    import iree.compiler as ic

    t = _targets.resolve(target) if isinstance(target, str) else target
    flags = [f for f in t.flags if not f.startswith("--iree-hal-target-backends=")] + list(extra_flags)
    try:
        return ic.compile_str(mlir_text, input_type="stablehlo", target_backends=[t.backend], extra_args=flags)
    except ic.CompilerToolError as e:
        diag = str(e)
        first = next((ln for ln in diag.splitlines() if "error:" in ln), diag.strip().splitlines()[0] if diag.strip() else "")
        known = sorted((not w.default, w.name) for w in WORKAROUNDS.values() if w.symptom in diag)
        hint = f" (known IREE issue; workaround {' or '.join(repr(n) for _, n in known)} exists)" if known else ""
        raise IreeCompileError(
            f"iree-compile failed for target {t.name!r} ({t.backend}): {first.strip()}{hint}", diag, t.name
        ) from None


_MLIR_ELEMENT = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "ui8", "uint16": "ui16", "uint32": "ui32", "uint64": "ui64", "bool": "i1",
}


def _tensor_type(spec: TensorSpec) -> str:
    if spec.dtype not in _MLIR_ELEMENT:
        raise ValueError(f"{spec.name}: dtype {spec.dtype} is not supported for parameter-backed state")
    dims = "".join(f"{d}x" for d in spec.shape)
    return f"tensor<{dims}{_MLIR_ELEMENT[spec.dtype]}>"


def _mlir_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def wrap_state_as_parameters(
    mlir_text: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], scope: str = "model"
) -> str:
    """Rewrites an exported step so its state lives in module globals read from named parameters.

    The exported ``main(*state, *batch) -> (*new_state, *aux)`` becomes the
    private ``@pockjax_step``; a new public ``main(*batch) -> (*aux)`` loads
    each state global, calls it, stores the new state and returns the aux
    outputs. Each state input ``name`` is a ``util.global`` initialised from
    ``#flow.parameter.named<scope::name>``, so IREE's io_parameters module
    fills it from a parameter archive (``.irpa``) when the module is loaded;
    state that no output replaces (frozen weights) is an immutable global.
    ``get_state() -> (*state)`` and ``set_state(*mutable_state)`` read and write
    it.
    """
    header = "func.func public @main("
    if mlir_text.count(header) != 1:
        raise ValueError("expected exactly one public @main in the exported module")
    text = mlir_text.replace(header, "func.func private @pockjax_step(", 1)
    state_idx = [i for i, s in enumerate(inputs) if s.role == "state"]
    batch_idx = [i for i, s in enumerate(inputs) if s.role != "state"]
    stored = {o.state_index: k for k, o in enumerate(outputs) if o.role == "state"}
    mutable = [i for i in state_idx if i in stored]
    aux_idx = [k for k, o in enumerate(outputs) if o.role != "state"]
    ty_in = [_tensor_type(s) for s in inputs]
    ty_out = [_tensor_type(o) for o in outputs]
    lines = []
    for i in state_idx:
        mut = " mutable" if i in stored else ""
        lines.append(
            f"  util.global private{mut} @pockjax_state_{i} = "
            f"#flow.parameter.named<{_mlir_string(scope)}::{_mlir_string(inputs[i].name)}> : {ty_in[i]}"
        )
    # main(*batch) -> (*aux)
    args = ", ".join(f"%b{i}: {ty_in[i]}" for i in batch_idx)
    res = ", ".join(ty_out[k] for k in aux_idx)
    body = [f"  func.func public @main({args}) -> ({res}) {{"]
    for i in state_idx:
        body.append(f"    %s{i} = util.global.load @pockjax_state_{i} : {ty_in[i]}")
    operands = ", ".join(f"%s{i}" if inputs[i].role == "state" else f"%b{i}" for i in range(len(inputs)))
    body.append(
        f"    %r:{len(outputs)} = func.call @pockjax_step({operands}) : "
        f"({', '.join(ty_in)}) -> ({', '.join(ty_out)})"
        if len(outputs) > 1
        else f"    %r = func.call @pockjax_step({operands}) : ({', '.join(ty_in)}) -> ({', '.join(ty_out)})"
    )
    ref = (lambda k: f"%r#{k}") if len(outputs) > 1 else (lambda k: "%r")
    for i in mutable:
        body.append(f"    util.global.store {ref(stored[i])}, @pockjax_state_{i} : {ty_in[i]}")
    body.append(f"    return {', '.join(ref(k) for k in aux_idx)} : {res}" if aux_idx else "    return")
    body.append("  }")
    # get_state() -> (*state)
    body.append(f"  func.func public @get_state() -> ({', '.join(ty_in[i] for i in state_idx)}) {{")
    for i in state_idx:
        body.append(f"    %s{i} = util.global.load @pockjax_state_{i} : {ty_in[i]}")
    body.append(f"    return {', '.join(f'%s{i}' for i in state_idx)} : {', '.join(ty_in[i] for i in state_idx)}")
    body.append("  }")
    # set_state(*mutable_state)
    body.append(f"  func.func public @set_state({', '.join(f'%s{i}: {ty_in[i]}' for i in mutable)}) {{")
    for i in mutable:
        body.append(f"    util.global.store %s{i}, @pockjax_state_{i} : {ty_in[i]}")
    body.append("    return")
    body.append("  }")
    end = text.rstrip().rfind("}")
    return text[:end] + "\n".join(lines + body) + "\n" + text[end:]


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


@dataclass
class CompiledModule:
    """A compiled ``.vmfb`` plus everything needed to run or export it."""

    vmfb: bytes
    metadata: ModuleMetadata
    stablehlo: str
    compile_seconds: float
    workarounds: tuple[str, ...] = ()

    @property
    def size_bytes(self) -> int:
        return len(self.vmfb)


# Local CPU drivers get IREE's caching allocator. A train step allocates its transient
# buffers (about 1.4 GB for 2 SmolLM2 layers at batch 4 x 128) and frees them at the end of
# every call; with the plain heap allocator each step returns them to the OS and faults them
# in again (iree-benchmark-module on this machine: some steps stalled 10x longer than
# their compute, 28 s against 2.4 s); with the caching allocator the steps ran 2.2-2.5 s.
CACHING_ALLOCATOR_DRIVERS = _rtmod.HEAP_DRIVERS
_CACHING_DEVICES: dict[str, Any] = _rtmod.register_device_cache({})


def _caching_device(driver: str):
    import iree.runtime as rt

    if driver not in _CACHING_DEVICES:
        _CACHING_DEVICES[driver] = rt.get_driver(driver).create_default_device(allocators=["caching"])
    return _CACHING_DEVICES[driver]


class _CachingDeviceSession(DeviceSession):
    """A :class:`~pockjax.runtime.module.DeviceSession` on a device with the caching
    allocator, one per driver, shared by every in-process step."""

    def _open_device(self, driver: str):
        return _caching_device(driver)


class IreeExecutable(StatefulModule):
    """An IREE-compiled step bound to a device, state kept on the device.

    Call it like the flat JAX function (``exe(*flat_args) -> flat_outs``):
    state inputs are uploaded on the first call (and again when given a
    different host array), then the state outputs stay on the device and are
    fed back. Use :meth:`step` (batch inputs only; returns aux outputs) for the
    fast path, and :meth:`get_state` / :meth:`set_state` to read or write
    weights.
    """

    def __init__(self, compiled: CompiledModule, session=None, *, tool: Sequence[str] | None = None):
        meta = compiled.metadata
        if session is None and tool is not None:
            session = _rtmod.CommandLineSession(compiled.vmfb, meta.target["driver"], tool, function=meta.function)
        elif session is None and meta.target["driver"] in CACHING_ALLOCATOR_DRIVERS:
            session = _CachingDeviceSession(compiled.vmfb, meta.target["driver"], function=meta.function)
        elif session is None:
            session = _rtmod.DeviceSession(compiled.vmfb, meta.target["driver"], function=meta.function)
        super().__init__(session, meta)
        self.compiled = compiled
        # State index -> (the jax.Array last uploaded for it, its device buffer). JAX arrays are
        # immutable, so while the device state is still that buffer a call given the same array
        # (a frozen weight, forwarded unchanged by every step) skips the upload.
        self._uploaded: dict[int, tuple[Any, Any]] = {}

    def _release(self) -> None:
        self._uploaded.clear()
        super()._release()

    def __call__(self, *flat_args):
        """Flat call with the JAX function's signature: ``exe(*flat_args) -> flat_outs``.

        State outputs come back as :class:`pockjax.runtime.DeviceBuffer` (still on
        the device; ``np.asarray`` fetches them). Passing them back as the next
        call's state inputs costs no transfer, so a loop
        ``params, opt_state, loss = step(params, opt_state, batch)`` keeps the
        weights on the device like the XLA step does. Host arrays given as state
        are uploaded, except a ``jax.Array`` that is the very object uploaded for
        that input by the previous call while the device still holds that upload
        (a frozen weight, which the step forwards unchanged): JAX arrays are
        immutable, so it is on the device already. NumPy arrays are uploaded on
        every call, as they can change in place. Aux outputs (the loss) come back
        as NumPy arrays.
        """
        meta = self.metadata
        if len(flat_args) != len(meta.inputs):
            raise _rtmod.InputError(f"expected {len(meta.inputs)} flat inputs, got {len(flat_args)}")
        for i in meta.state_inputs:
            a = flat_args[i]
            if isinstance(a, _rtmod.DeviceBuffer) and a.session is self.session:
                self._state[i] = a.value
                continue
            last = self._uploaded.get(i)
            if last is not None and last[0] is a and self._state.get(i) is last[1]:
                continue  # the same immutable array as before, and its upload is still the device state
            self._state[i] = self.session.put(_rtmod._check_array(meta.inputs[i], np.asarray(a), "state"))
            if isinstance(a, jax.Array):
                self._uploaded[i] = (a, self._state[i])
            else:
                self._uploaded.pop(i, None)
        aux = iter(self.step(*[np.asarray(flat_args[i]) for i in meta.batch_inputs]))
        outs = []
        for spec in meta.outputs:
            if spec.role == "state":
                outs.append(_rtmod.DeviceBuffer(self.session, self._state[spec.state_index], spec.shape, spec.dtype))
            else:
                outs.append(next(aux))
        return outs

    def export(self, path: str | os.PathLike, *, with_weights: bool = True, extra: Mapping[str, Any] | None = None):
        """Writes the module (and, if set, the current state as weights) to a directory."""
        weights = self.get_state() if (with_weights and self._state) else None
        return export_module(self.compiled, path, weights=weights, extra=extra)


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
      target: a target name from :mod:`pockjax.backends.targets` or a ``Target``.
      options: target options (``cpu``, ``features``, ``arch``, ``triple``,
        ``static_library``, ``stack_allocation_limit``, ``extra_flags``).
      state_mask: which inputs are state kept on the device between steps.
      state_outputs: ``{output_index: state_input_index}``; default: the
        first outputs replace the state inputs in order.
      input_names, output_names: names for metadata and errors.
      workarounds: ``"default"`` (those registered for the target's backend),
        ``None``/``()`` (none) or a list of names from :data:`WORKAROUNDS`.
      extra: free-form metadata (pytree structure, scheme...).
      bind: return an :class:`IreeExecutable` on this machine's device; with
        ``False`` (or for targets this process cannot run) return the
        :class:`CompiledModule` only.
      emulate: for an aarch64 module on another host, bind it to the aarch64
        ``iree-run-module`` run under qemu (:mod:`pockjax.backends.arm64_runner`);
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
    for n in names:
        if WORKAROUNDS[n].fun_rewrite is not None:
            fun = WORKAROUNDS[n].fun_rewrite(fun, flat_avals)
    text = export_stablehlo(fun, flat_avals)
    if state_storage not in ("arguments", "parameters"):
        raise ValueError(f"state_storage must be 'arguments' or 'parameters', not {state_storage!r}")
    if state_storage == "parameters":
        text = wrap_state_as_parameters(text, inputs, outputs, parameter_scope)
        bind = False
    flags: list[str] = []
    for n in names:
        w = WORKAROUNDS[n]
        if w.rewrite is not None:
            text = w.rewrite(text)
        flags += list(w.flags)
    t0 = time.perf_counter()
    vmfb = compile_stablehlo(text, t, extra_flags=flags)
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
            from pockjax.backends import arm64_runner

            return IreeExecutable(compiled, tool=arm64_runner.command_prefix())
        return compiled
    return IreeExecutable(compiled)


def largest_matmul_macs(fun: Callable, flat_avals: Sequence[Any]) -> int:
    """Multiply-adds of the largest ``dot_general`` in ``fun`` (nested jaxprs included)."""
    avals = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in flat_avals]
    best = 0

    def visit(jaxpr):
        nonlocal best
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (lc, rc), _ = eqn.params["dimension_numbers"]
                lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
                k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
                best = max(best, int(np.prod(eqn.outvars[0].aval.shape, dtype=np.int64)) * k)
            for sub in _sub_jaxprs(eqn):
                visit(sub)

    visit(jax.make_jaxpr(fun)(*avals).jaxpr)
    return best


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if hasattr(x, "jaxpr") and hasattr(x, "consts"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


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
        return bool(t.triple) and t.triple.split("-")[0] == _rtmod.host_machine_triple_prefix() and \
            "static_library" not in t.options
    return True


def export_module(
    compiled: CompiledModule,
    path: str | os.PathLike,
    *,
    weights: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
    weights_file: str | os.PathLike | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Writes ``module.vmfb``, ``module.json`` and optionally ``weights.irpa`` to ``path``.

    Args:
      compiled: from :func:`compile_flat` (or ``IreeExecutable.compiled``).
      path: output directory (created).
      weights: initial state, by name or in state order; written as an IREE
        parameter archive next to the module.
      weights_file: instead of copying weights, reference an existing
        archive (absolute path or relative to ``path``) shared by several
        modules (for example a train step and a generate step of one model).
      extra: merged into the metadata's ``extra``.

    Returns:
      The directory path.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    meta = dataclasses.replace(compiled.metadata, extra={**compiled.metadata.extra, **dict(extra or {})})
    if weights is not None and weights_file is not None:
        raise ValueError("give weights or weights_file, not both")
    if weights is not None:
        state_specs = [meta.inputs[i] for i in meta.state_inputs]
        if not isinstance(weights, Mapping):
            weights = list(weights)
            if len(weights) != len(state_specs):
                raise ValueError(f"expected {len(state_specs)} state arrays, got {len(weights)}")
            weights = {s.name: w for s, w in zip(state_specs, weights)}
        checked = {}
        for s in state_specs:
            if s.name not in weights:
                raise ValueError(f"weights lack state entry {s.name!r}")
            checked[s.name] = _rtmod._check_array(s, np.asarray(weights[s.name]), "weight")
        _rtmod.save_weights(os.path.join(path, WEIGHTS_FILE), checked)
        meta.weights = {"file": WEIGHTS_FILE, "format": "irpa"}
    elif weights_file is not None:
        meta.weights = {"file": os.fspath(weights_file), "format": "irpa"}
    elif meta.state_storage == "parameters":
        raise ValueError("a module with parameter-backed state needs weights= or weights_file= to export")
    with open(os.path.join(path, MODULE_FILE), "wb") as f:
        f.write(compiled.vmfb)
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        json.dump(meta.to_json(), f, indent=1)
    return path

"""A compiled IREE module bound to a device, and its export to a directory.

:class:`CompiledModule` is what :func:`pockjax.backends.iree.compile_flat`
produces (the ``.vmfb``, its metadata, the StableHLO it came from);
:class:`IreeExecutable` runs it with the state kept on the device;
:func:`export_module` writes it for :func:`pockjax.runtime.load`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from pockjax import errors
from pockjax.io.atomic import atomic_directory, remove_stale_temporaries, write_bytes, write_json
from pockjax.runtime.heap import HEAP_DRIVERS
from pockjax.runtime.metadata import (
    METADATA_FILE,
    MODULE_FILE,
    WEIGHTS_FILE,
    InputError,
    ModuleMetadata,
    check_array,
)
from pockjax.runtime.module import StatefulModule
from pockjax.runtime.session import CommandLineSession, DeviceBuffer, DeviceSession, register_device_cache
from pockjax.runtime.weights import save_weights

__all__ = ["CompiledModule", "IreeExecutable", "export_module", "CACHING_ALLOCATOR_DRIVERS"]


def _is_python_scalar(a) -> bool:
    """A Python ``bool``/``int``/``float``/``complex`` (not a NumPy scalar, which has its own dtype)."""
    return isinstance(a, (bool, int, float, complex)) and not isinstance(a, np.generic)


def _python_scalar_as(spec, a) -> np.ndarray:
    """A Python number in the input's traced dtype, refused where that would change its value
    (a float into an integer input, a complex into a real one), which ``jax.jit`` would trace anew."""
    kind = np.dtype(spec.dtype).kind
    if (isinstance(a, complex) and kind != "c") or (isinstance(a, float) and kind in "biu"):
        raise InputError(f"input {spec.name!r} was traced as {spec.dtype}, but the call passes the Python"
                         f" {type(a).__name__} {a!r}: pass a number of the traced kind, or compile the step"
                         " again for the new argument")
    return np.asarray(a, dtype=spec.dtype)


@dataclass
class CompiledModule:
    """A compiled ``.vmfb`` plus everything needed to run or export it.

    ``stablehlo`` is the exported step's StableHLO text, after the text
    rewrites of its workarounds (before its state moved into parameters).
    """

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
CACHING_ALLOCATOR_DRIVERS = HEAP_DRIVERS
_CACHING_DEVICES: dict[str, Any] = register_device_cache({})


def _caching_device(driver: str):
    import iree.runtime as rt

    if driver not in _CACHING_DEVICES:
        _CACHING_DEVICES[driver] = rt.get_driver(driver).create_default_device(allocators=["caching"])
    return _CACHING_DEVICES[driver]


class _CachingDeviceSession(DeviceSession):
    """A :class:`~pockjax.runtime.DeviceSession` on a device with the caching
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
            session = CommandLineSession(compiled.vmfb, meta.target["driver"], tool, function=meta.function)
        elif session is None and meta.target["driver"] in CACHING_ALLOCATOR_DRIVERS:
            session = _CachingDeviceSession(compiled.vmfb, meta.target["driver"], function=meta.function)
        elif session is None:
            session = DeviceSession(compiled.vmfb, meta.target["driver"], function=meta.function)
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
            raise InputError(f"expected {len(meta.inputs)} flat inputs, got {len(flat_args)}")
        # A Python number (TrainState.create's step=0, a learning rate) takes the traced dtype,
        # as jax.jit gives it a weak type; numpy would make it int64 / float64.
        flat_args = [_python_scalar_as(spec, a) if _is_python_scalar(a) else a
                     for a, spec in zip(flat_args, meta.inputs)]
        for i in meta.state_inputs:
            a = flat_args[i]
            if isinstance(a, DeviceBuffer) and a.session is self.session:
                self._state[i] = a.value
                continue
            last = self._uploaded.get(i)
            if last is not None and last[0] is a and self._state.get(i) is last[1]:
                continue  # the same immutable array as before, and its upload is still the device state
            self._state[i] = self.session.put(check_array(meta.inputs[i], np.asarray(a), "state"))
            if isinstance(a, jax.Array):
                self._uploaded[i] = (a, self._state[i])
            else:
                self._uploaded.pop(i, None)
        aux = iter(self.step(*[np.asarray(flat_args[i]) for i in meta.batch_inputs]))
        outs = []
        for spec in meta.outputs:
            if spec.role == "state":
                outs.append(DeviceBuffer(self.session, self._state[spec.state_index], spec.shape, spec.dtype))
            else:
                outs.append(next(aux))
        return outs

    def adopt_host_copies(self, values: Sequence[Any]) -> list:
        """``values`` with each :class:`DeviceBuffer` of this module fetched as a ``jax.Array``.

        The array is marked as that input's upload, so passing it back as the
        next call's state costs no transfer (as a JAX array from an earlier
        call does). A compiled NNX step puts these into the model's variables,
        which then work with any JAX code, as after ``nnx.jit``.
        """
        import jax.numpy as jnp

        index = {id(v): i for i, v in self._state.items()}
        out = []
        for x in values:
            if isinstance(x, DeviceBuffer) and x.session is self.session and id(x.value) in index:
                arr = jnp.asarray(x.to_host())
                self._uploaded[index[id(x.value)]] = (arr, x.value)
                x = arr
            out.append(x)
        return out

    def export(self, path: str | os.PathLike, *, with_weights: bool = True, extra: Mapping[str, Any] | None = None):
        """Writes the module (and, if set, the current state as weights) to a directory."""
        weights = self.get_state() if (with_weights and self._state) else None
        return export_module(self.compiled, path, weights=weights, extra=extra)


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

    The export is atomic: a crash part way leaves the previous export as it
    was. Where ``path`` is new or holds only an export's files, the directory
    is built beside it and swapped in whole. Otherwise (it holds other files,
    or a ``weights_file`` is referenced) each file goes to a temporary sibling,
    is fsynced and renamed, the metadata last: it names the module's sha256,
    which :func:`pockjax.runtime.load` checks; when new weights are written
    there, the old metadata is removed first, so that an interrupted export
    is refused rather than run with the old module. Temporaries of killed
    exports in ``path`` and beside it are removed first.
    """
    path = os.fspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise errors.InputError(f"export path {path!r} is an existing file, not a directory: give a directory"
                                " (it is created), or remove the file")
    meta = dataclasses.replace(compiled.metadata, extra={**compiled.metadata.extra, **dict(extra or {})})
    if weights is not None and weights_file is not None:
        raise ValueError("give weights or weights_file, not both")
    checked: dict[str, np.ndarray] | None = None
    if weights is not None:
        state_specs = [meta.inputs[i] for i in meta.state_inputs]
        if not isinstance(weights, Mapping):
            weights = list(weights)
            if len(weights) != len(state_specs):
                names = ", ".join(s.name for s in state_specs[:3]) + (", ..." if len(state_specs) > 3 else "")
                raise errors.InputError(f"expected {len(state_specs)} state arrays, got {len(weights)}: give one"
                                        f" array per state input of the module, flat and in its state order"
                                        f" ({names})")
            weights = {s.name: w for s, w in zip(state_specs, weights)}
        checked = {}
        for s in state_specs:
            if s.name not in weights:
                raise ValueError(f"weights lack state entry {s.name!r}")
            checked[s.name] = check_array(s, np.asarray(weights[s.name]), "weight")
        meta.weights = {"file": WEIGHTS_FILE, "format": "irpa"}
    elif weights_file is not None:
        meta.weights = {"file": os.fspath(weights_file), "format": "irpa"}
    elif meta.state_storage == "parameters":
        raise ValueError("a module with parameter-backed state needs weights= or weights_file= to export")
    # Only now, with the weights checked: a refused export leaves no empty directory behind.
    os.makedirs(path, exist_ok=True)
    for d in (path, os.path.dirname(os.path.abspath(path))):  # what killed exports left
        remove_stale_temporaries(d)
    owned = (weights_file is None and not os.path.islink(path)
             and set(os.listdir(path)) <= {MODULE_FILE, METADATA_FILE, WEIGHTS_FILE})
    if owned:
        with atomic_directory(path) as tmp:
            _write_export(tmp, compiled.vmfb, meta, checked)
    else:
        if checked is not None and os.path.lexists(os.path.join(path, METADATA_FILE)):
            os.unlink(os.path.join(path, METADATA_FILE))
        _write_export(path, compiled.vmfb, meta, checked)
    return path


def _write_export(path: str, vmfb: bytes, meta: ModuleMetadata,
                  weights: Mapping[str, np.ndarray] | None) -> None:
    """Writes the export's files into ``path``, each atomically, the metadata last."""
    if weights is not None:
        save_weights(os.path.join(path, WEIGHTS_FILE), weights)
    write_bytes(os.path.join(path, MODULE_FILE), vmfb)
    write_json(os.path.join(path, METADATA_FILE), meta.to_json(), indent=1, ensure_ascii=True)

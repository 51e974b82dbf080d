"""Run IREE-compiled pockjax modules with ``iree.runtime`` and NumPy only.

This module must never import JAX (or anything from pockjax that does): it is
what ships to the device. A test runs it in a process where ``import jax``
fails.

Three layers, from low to high:

- :class:`DeviceSession`: one ``.vmfb`` loaded on one HAL device
  (``local-task``, ``local-sync``, ``vulkan``, ``cuda``...). It moves NumPy
  arrays to device buffers (:meth:`DeviceSession.put`), back
  (:meth:`DeviceSession.get`) and invokes the entry function on buffer views
  (:meth:`DeviceSession.invoke`), so outputs can be fed back as inputs without
  touching the host.
- :class:`CommandLineSession`: the same ``invoke`` contract, but every call
  runs ``iree-run-module`` as a subprocess (optionally under an emulator such as
  ``qemu-aarch64``), with inputs and outputs passed as ``.npy`` files. This is
  how a module compiled for another architecture (``arm64``) is run here.
- :class:`StatefulModule`: a train step with *state* (parameters, optimizer
  state) that stays on the device between calls; only batch inputs go
  host->device and only auxiliary outputs (the loss, metrics) come back.
  :func:`load` builds one from an exported directory.

The exported directory (written by ``pockjax.backends.iree.export_module``)::

    module.vmfb      the compiled IREE module (entry function ``main``)
    module.json      metadata, see :data:`METADATA_FORMAT`
    weights.irpa     optional IREE parameter archive holding the initial state
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np


__all__ = [
    "METADATA_FORMAT",
    "MODULE_FILE",
    "METADATA_FILE",
    "WEIGHTS_FILE",
    "TensorSpec",
    "ModuleMetadata",
    "ModuleError",
    "InputError",
    "TargetMismatchError",
    "DeviceSession",
    "CommandLineSession",
    "StatefulModule",
    "DeviceBuffer",
    "load",
    "read_metadata",
    "save_weights",
    "load_weights",
    "host_machine_triple_prefix",
    "process_rss_bytes",
    "MemoryGrowthWarning",
    "MEMORY_GROWTH_DRIVERS",
    "HEAP_DRIVERS",
    "RETAIN_HEAP_ENV",
    "heap_off_by_env",
    "retain_freed_heap",
    "heap_retained",
]

METADATA_FORMAT = "pockjax-iree-module"
METADATA_VERSION = 1
MODULE_FILE = "module.vmfb"
METADATA_FILE = "module.json"
WEIGHTS_FILE = "weights.irpa"

ROLE_STATE = "state"
ROLE_INPUT = "input"
ROLE_AUX = "aux"


class ModuleError(RuntimeError):
    """A module directory is missing, malformed, or cannot run here."""


class InputError(ValueError):
    """An input array does not match the module's signature."""


class TargetMismatchError(ModuleError):
    """The module was compiled for a target/driver other than the one requested."""


# ---------------------------------------------------------------------------
# Signature and metadata
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One flat input or output of a compiled step.

    Attributes:
      name: a human-readable name (dotted pytree path where known).
      shape: static shape.
      dtype: NumPy dtype name (``"float32"``, ``"int32"``...).
      role: inputs: ``"state"`` (lives on the device between steps) or
        ``"input"`` (fed from the host every step). Outputs: ``"state"`` (the
        new value of a state input) or ``"aux"`` (returned to the host).
      state_index: for a state output, the index of the input it replaces.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    state_index: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "role": self.role}
        if self.state_index is not None:
            d["state_index"] = self.state_index
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorSpec":
        return cls(
            name=str(d["name"]),
            shape=tuple(int(s) for s in d["shape"]),
            dtype=str(d["dtype"]),
            role=str(d["role"]),
            state_index=d.get("state_index"),
        )

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass
class ModuleMetadata:
    """Everything the runtime needs to know about an exported module.

    ``target`` holds ``name`` (cpu, arm64, vulkan, cuda, dsp), ``backend``
    (IREE HAL target backend), ``driver`` (IREE runtime driver),
    ``triple`` (for CPU targets) and the compile ``flags``. ``extra`` is free
    for the caller (pytree structure, update scheme...).
    """

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    target: dict[str, Any]
    function: str = "main"
    versions: dict[str, str] = field(default_factory=dict)
    module_sha256: str | None = None
    weights: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # "arguments": state is passed in and returned by ``function`` and the runtime keeps
    # the device buffers. "parameters": state lives in the module's mutable globals,
    # initialised by name from an IREE parameter archive (scope ``parameter_scope``);
    # ``function`` takes batch inputs only and the module exports get_state/set_state.
    state_storage: str = "arguments"
    parameter_scope: str = "model"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": METADATA_FORMAT,
            "format_version": METADATA_VERSION,
            "function": self.function,
            "target": self.target,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "versions": self.versions,
            "module_sha256": self.module_sha256,
            "weights": self.weights,
            "state_storage": self.state_storage,
            "parameter_scope": self.parameter_scope,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ModuleMetadata":
        if d.get("format") != METADATA_FORMAT:
            raise ModuleError(f"not a pockjax module metadata file (format={d.get('format')!r})")
        if int(d.get("format_version", -1)) > METADATA_VERSION:
            raise ModuleError(
                f"metadata format_version {d.get('format_version')} is newer than this runtime "
                f"understands ({METADATA_VERSION}); upgrade pockjax"
            )
        return cls(
            inputs=[TensorSpec.from_json(s) for s in d["inputs"]],
            outputs=[TensorSpec.from_json(s) for s in d["outputs"]],
            target=dict(d["target"]),
            function=d.get("function", "main"),
            versions=dict(d.get("versions") or {}),
            module_sha256=d.get("module_sha256"),
            weights=d.get("weights"),
            extra=dict(d.get("extra") or {}),
            state_storage=d.get("state_storage", "arguments"),
            parameter_scope=d.get("parameter_scope", "model"),
        )

    @property
    def state_inputs(self) -> list[int]:
        return [i for i, s in enumerate(self.inputs) if s.role == ROLE_STATE]

    @property
    def batch_inputs(self) -> list[int]:
        return [i for i, s in enumerate(self.inputs) if s.role != ROLE_STATE]

    @property
    def aux_outputs(self) -> list[int]:
        return [i for i, s in enumerate(self.outputs) if s.role != ROLE_STATE]

    @property
    def mutable_state_inputs(self) -> list[int]:
        """State inputs that some output replaces (the rest is read-only, e.g. frozen weights)."""
        replaced = {s.state_index for s in self.outputs if s.role == ROLE_STATE}
        return [i for i in self.state_inputs if i in replaced]


def read_metadata(path: str | os.PathLike) -> ModuleMetadata:
    """Reads ``module.json`` from an exported directory (or the file itself)."""
    path = os.fspath(path)
    meta_path = os.path.join(path, METADATA_FILE) if os.path.isdir(path) else path
    if not os.path.exists(meta_path):
        raise ModuleError(f"no module metadata at {meta_path!r} (expected {METADATA_FILE} in the export directory)")
    with open(meta_path) as f:
        try:
            return ModuleMetadata.from_json(json.load(f))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ModuleError(f"malformed module metadata {meta_path!r}: {e}") from e


def host_machine_triple_prefix() -> str:
    """The LLVM triple architecture of this machine (``x86_64``, ``aarch64``...)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


# ---------------------------------------------------------------------------
# Weights (IREE parameter archives)
# ---------------------------------------------------------------------------


def save_weights(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes named arrays to an IREE parameter archive (``.irpa``).

    Each entry's metadata holds its dtype and shape as JSON so that
    :func:`load_weights` can rebuild the arrays; the payload is the raw
    little-endian bytes, which is what IREE's parameter providers serve to
    modules that read parameters by name.
    """
    import iree.runtime as rt

    index = rt.ParameterIndex()
    keep = []
    for name, a in arrays.items():
        a = np.array(a, order="C", copy=True)  # (np.ascontiguousarray would make 0-d arrays 1-d)
        keep.append(a)
        meta = json.dumps({"dtype": a.dtype.name, "shape": list(a.shape)})
        # add_buffer needs a non-empty buffer; scalars are fine, empty arrays are not.
        index.add_buffer(name, a.reshape(-1).view(np.uint8) if a.size else np.zeros(1, np.uint8), metadata=meta)
    index.create_archive_file(os.fspath(path))


def load_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads an archive written by :func:`save_weights` into NumPy arrays (copies)."""
    import iree.runtime as rt

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModuleError(f"weights file {path!r} does not exist")
    if os.path.isdir(path):
        raise ModuleError(f"{path!r} is a directory; give the archive inside it (for an export: "
                          f"{os.path.join(path, 'weights.irpa')!r})")
    index = rt.ParameterIndex()
    index.load(path, mmap=False)
    out: dict[str, np.ndarray] = {}
    for key, entry in index.items():
        try:
            meta = json.loads(bytes(entry.metadata).decode())
            dtype, shape = np.dtype(meta["dtype"]), tuple(meta["shape"])
        except Exception as e:  # noqa: BLE001 - report any malformed entry the same way
            raise ModuleError(f"{path}: entry {key!r} has no pockjax dtype/shape metadata") from e
        raw = np.frombuffer(entry.file_view, dtype=np.uint8)
        n = int(np.prod(shape, dtype=np.int64))
        out[key] = raw[: n * dtype.itemsize].view(dtype).reshape(shape).copy()
    return out


# ---------------------------------------------------------------------------
# Sessions: the thing that actually runs the module
# ---------------------------------------------------------------------------


def _hal_element_type(dtype):
    from iree.runtime.dtypes import map_dtype_to_hal_element_type

    et = map_dtype_to_hal_element_type(np.dtype(dtype))
    if et is None:
        raise InputError(f"dtype {np.dtype(dtype)} has no IREE element type")
    return et


def _check_array(spec: TensorSpec, value: Any, what: str) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype != np.dtype(spec.dtype):
        # Python scalars and same-kind arrays are a common slip; be strict but clear.
        raise InputError(
            f"{what} {spec.name!r}: expected dtype {spec.dtype}, got {a.dtype} "
            f"(convert with np.asarray(x, dtype=np.{spec.dtype}))"
        )
    if tuple(a.shape) != tuple(spec.shape):
        raise InputError(f"{what} {spec.name!r}: expected shape {tuple(spec.shape)}, got {tuple(a.shape)}")
    return a


# -- the host heap of local CPU drivers ------------------------------------------------
#
# An IREE step on the local CPU drivers allocates its transient buffers from the host
# heap when it starts and frees them when it ends. glibc serves allocations above its
# mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh mmap, gives them back
# with munmap on free, and trims the top of the heap above 128 KiB of free space, so
# every step faulted its working memory in again, one zero-filled 4 KiB page at a time:
# SmolLM2-135M's `paper` step took about 172,000 minor faults (700 MB) per step, and
# 1.6-2.2 s against 1.3-1.5 s with the memory kept (2-core Xeon, docs/deploying.md).

#: Environment variable: ``0`` (or ``false``/``no``/``off``) keeps glibc's heap defaults.
RETAIN_HEAP_ENV = "POCKJAX_RETAIN_HEAP"
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
_heap = {"retained": False}


def retain_freed_heap() -> bool:
    """Makes glibc keep freed heap memory mapped, so IREE steps stop page-faulting.

    Sets glibc's ``M_MMAP_MAX`` to 0 (no ``mmap`` for allocations from the main
    heap) and ``M_TRIM_THRESHOLD`` to 2 GiB (no trimming below that much free
    memory at the top of the heap): freed blocks stay in the process and the
    next step's transient buffers reuse them instead of being faulted in again.
    The process then holds on to its peak heap between steps instead of giving
    it back to the system; the peak itself does not change. Allocations of
    other threads' glibc arenas (XLA's worker threads) are not affected: those
    arenas fall back to ``mmap`` for large blocks whatever the setting
    (:func:`pockjax.keep_step_memory` moves in-process XLA steps onto the
    calling thread, whose allocations come from the main heap).

    pockjax calls it when it opens a device on a local CPU driver
    (:data:`HEAP_DRIVERS`: the in-process ``pockjax.compile(...,
    target="cpu")`` step and :func:`load`). Idempotent and process-wide.

    Returns:
      True if the setting is in effect (now or from an earlier call); False
      when ``POCKJAX_RETAIN_HEAP=0`` turns it off or the C library has no
      ``mallopt`` (musl, macOS).

    Example:
      >>> on = retain_freed_heap()   # False off glibc, or with POCKJAX_RETAIN_HEAP=0
      >>> heap_retained() == on
      True
    """
    if _heap["retained"]:
        return True
    if heap_off_by_env():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _heap["retained"] = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _heap["retained"]


def heap_off_by_env() -> bool:
    """Whether ``POCKJAX_RETAIN_HEAP`` (:data:`RETAIN_HEAP_ENV`) turns the heap setting off.

    Example:
      >>> import os
      >>> from unittest import mock
      >>> with mock.patch.dict(os.environ, {"POCKJAX_RETAIN_HEAP": " Off"}):
      ...     heap_off_by_env()
      True
      >>> with mock.patch.dict(os.environ, {"POCKJAX_RETAIN_HEAP": "1"}):
      ...     heap_off_by_env()
      False
    """
    return os.environ.get(RETAIN_HEAP_ENV, "").strip().lower() in ("0", "false", "no", "off")


def heap_retained() -> bool:
    """Whether :func:`retain_freed_heap` is in effect in this process.

    Example:
      >>> heap_retained() in (True, False)
      True
    """
    return _heap["retained"]


#: Drivers whose buffers live in the host heap; opening one calls
#: :func:`retain_freed_heap` (``POCKJAX_RETAIN_HEAP=0`` to keep glibc's defaults).
HEAP_DRIVERS = ("local-task", "local-sync")


class DeviceSession:
    """One compiled module on one IREE HAL device, driven on buffer views.

    On the local CPU drivers (:data:`HEAP_DRIVERS`) it first makes glibc keep
    freed heap memory mapped, so that each step's transient buffers are not
    faulted in again (:func:`retain_freed_heap`).

    Args:
      vmfb: module bytes, or a path to a ``.vmfb`` file (memory-mapped).
      driver: IREE device URI, e.g. ``"local-task"``, ``"local-sync"``,
        ``"vulkan"``, ``"cuda"``.
      function: entry function name.
    """

    def __init__(
        self,
        vmfb: bytes | str | os.PathLike,
        driver: str,
        function: str = "main",
        parameters: Sequence[tuple[str, str]] = (),
    ):
        import iree.runtime as rt

        self._rt = rt
        self.driver = driver
        if driver.split(":")[0] in HEAP_DRIVERS:
            retain_freed_heap()
        self.device = self._open_device(driver)
        self.instance = rt.VmInstance()
        hal = rt.create_hal_module(self.instance, self.device)
        modules = [hal]
        if parameters:
            # Modules whose globals are initialised from named parameters import the
            # io_parameters module; each (scope, archive) pair becomes one provider.
            providers = []
            self._parameter_indices = []
            for scope, archive in parameters:
                if not os.path.exists(archive):
                    raise ModuleError(f"parameter archive {archive!r} does not exist")
                index = rt.ParameterIndex()
                index.load(os.fspath(archive))
                self._parameter_indices.append(index)
                providers.append(index.create_provider(scope=scope))
            modules.append(rt.create_io_parameters_module(self.instance, *providers))
        if isinstance(vmfb, (bytes, bytearray, memoryview)):
            self.module = rt.VmModule.copy_buffer(self.instance, vmfb)
        else:
            self.module = rt.VmModule.mmap(self.instance, os.fspath(vmfb))
        try:
            self.context = rt.VmContext(self.instance, modules + [self.module])
        except Exception as e:  # noqa: BLE001
            raise ModuleError(
                f"IREE could not load the module on device {driver!r}: {e}. Was it compiled for "
                "another target? (check the metadata's target.driver)"
            ) from e
        self.function = self.module.lookup_function(function)
        if self.function is None:
            raise ModuleError(f"module has no function {function!r}; it has {self.module.function_names}")
        _LIVE_SESSIONS.add(self)

    def _open_device(self, driver: str):
        """The HAL device the module runs on (a subclass may hand out a shared one)."""
        try:
            return self._rt.get_device(driver)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise ModuleError(
                f"cannot open IREE device {driver!r}: {e}. Available drivers: "
                f"{sorted(self._rt.query_available_drivers())}"
            ) from e

    def _release(self) -> None:
        # The module's context before the device it runs on (see release_device_objects).
        self.function = self.context = self.module = None
        self._parameter_indices = []
        self.device = None

    def call(self, name: str, args: Sequence[Any] = ()) -> list[Any]:
        """Calls another exported function of the module on buffer views."""
        rt = self._rt
        fn = self.module.lookup_function(name)
        if fn is None:
            raise ModuleError(f"module has no function {name!r}")
        arg_list = rt.VmVariantList(max(len(args), 1))
        for bv in args:
            arg_list.push_ref(bv)
        ret_list = rt.VmVariantList(8)
        self.context.invoke(fn, arg_list, ret_list)
        return [ret_list.get_as_object(i, rt.HalBufferView) for i in range(len(ret_list))]

    def put(self, array: np.ndarray):
        """Copies a host array into a new device-local buffer view."""
        rt = self._rt
        a = np.asarray(array)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
        bv = self.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL,
            allowed_usage=rt.BufferUsage.DEFAULT,
            device=self.device,
            buffer=a.reshape(-1) if a.ndim == 0 else a,
            element_type=_hal_element_type(a.dtype),
        )
        if a.ndim == 0:
            # The binding reads 0-d arrays as shape [1]; re-view the buffer as a scalar.
            bv = rt.HalBufferView(bv.get_buffer(), [], _hal_element_type(a.dtype))
        return bv

    def get(self, buffer_view, dtype: str | np.dtype | None = None) -> np.ndarray:
        """Copies a device buffer view back to a new host array."""
        rt = self._rt
        raw_dtype = rt.HalElementType.map_to_dtype(buffer_view.element_type)
        source = buffer_view.get_buffer()
        shape = list(buffer_view.shape)
        host_visible = int(rt.MemoryType.HOST_VISIBLE)
        mappable = int(rt.BufferUsage.MAPPING_SCOPED)
        if (source.memory_type() & host_visible) == host_visible and (source.allowed_usage() & mappable) == mappable:
            out = np.array(buffer_view.map().asarray(shape, raw_dtype), copy=True)
        else:
            # Device-only memory (GPU drivers): DMA into a driver-allocated staging
            # buffer. (iree.runtime's DeviceArray imports numpy memory instead, which
            # Vulkan refuses unless the pointer is 4096-byte aligned.)
            staging = self.device.allocator.allocate_buffer(
                memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
                allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
                allocation_size=source.byte_length(),
            )
            sem = self.device.create_semaphore(0)
            self.device.queue_copy(
                source,
                staging,
                wait_semaphores=rt.HalFence.create_at(sem, 0),
                signal_semaphores=rt.HalFence.create_at(sem, 1),
            )
            rt.HalFence.create_at(sem, 1).wait()
            out = np.array(staging.map().asarray(shape, raw_dtype), copy=True)
        if dtype is not None and np.dtype(dtype) == np.bool_ and out.dtype != np.bool_:
            out = out.astype(np.bool_)
        return out

    def invoke(self, args: Sequence[Any]) -> list[Any]:
        """Calls the entry function on buffer views; returns buffer views."""
        rt = self._rt
        arg_list = rt.VmVariantList(len(args))
        for bv in args:
            arg_list.push_ref(bv)
        ret_list = rt.VmVariantList(8)
        self.context.invoke(self.function, arg_list, ret_list)
        return [ret_list.get_as_object(i, rt.HalBufferView) for i in range(len(ret_list))]


_NPY_DTYPES = {
    "float32": "f32",
    "float16": "f16",
    "float64": "f64",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "ui8",
    "uint32": "ui32",
    "bool": "i1",
}


class CommandLineSession:
    """Runs each call through the ``iree-run-module`` tool, maybe under an emulator.

    "Device buffers" are host NumPy arrays here: every call writes inputs to
    ``.npy`` files and reads outputs back. This is the path for modules
    compiled for another architecture (the aarch64 ``iree-run-module`` run
    under ``qemu-aarch64``) and for checking a module with the stock tool.

    Args:
      vmfb: module bytes or path.
      driver: the ``--device`` for ``iree-run-module``.
      tool: command prefix, e.g. ``["qemu-aarch64", "/path/iree-run-module"]``.
      function: entry function name.
      env: extra environment variables for the subprocess.
    """

    def __init__(
        self,
        vmfb: bytes | str | os.PathLike,
        driver: str,
        tool: Sequence[str],
        function: str = "main",
        env: Mapping[str, str] | None = None,
        timeout: float = 600.0,
    ):
        self.driver = driver
        self.tool = list(tool)
        self.function = function
        self.env = dict(env or {})
        self.timeout = timeout
        self._dir = tempfile.mkdtemp(prefix="pockjax-iree-run-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)
        if isinstance(vmfb, (bytes, bytearray, memoryview)):
            self.module_path = os.path.join(self._dir, "module.vmfb")
            with open(self.module_path, "wb") as f:
                f.write(vmfb)
        else:
            self.module_path = os.fspath(vmfb)
        self.last_wall_time = 0.0

    def put(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True)

    def get(self, value: np.ndarray, dtype=None) -> np.ndarray:
        return np.array(value, copy=True)

    def invoke(self, args: Sequence[np.ndarray], num_outputs: int | None = None) -> list[np.ndarray]:
        import time

        cmd = self.tool + [f"--module={self.module_path}", f"--device={self.driver}", f"--function={self.function}"]
        for i, a in enumerate(args):
            p = os.path.join(self._dir, f"in{i}.npy")
            a = np.asarray(a)
            np.save(p, a.astype(np.uint8) if a.dtype == np.bool_ else a)
            cmd.append(f"--input=@{p}")
        if num_outputs is None:
            raise ValueError("CommandLineSession.invoke needs num_outputs")
        outs = [os.path.join(self._dir, f"out{i}.npy") for i in range(num_outputs)]
        for p in outs:
            if os.path.exists(p):
                os.remove(p)
            cmd.append(f"--output=@{p}")
        env = dict(os.environ)
        env.update(self.env)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=self.timeout)
        self.last_wall_time = time.perf_counter() - t0
        if proc.returncode != 0:
            raise ModuleError(
                f"{' '.join(self.tool)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}{proc.stdout[-2000:]}"
            )
        return [np.load(p) for p in outs]


# -- release at exit -----------------------------------------------------------------
#
# Left to interpreter shutdown, IREE objects are destroyed in whatever order module
# globals are cleared: a device buffer that outlives the runtime's own teardown
# crashed the process on exit (a train loop's returned params, still on the device).
# An atexit handler releases them first, in dependency order: buffer views, then the
# module contexts and sessions, then the cached devices.
_LIVE_BUFFERS: "weakref.WeakSet[DeviceBuffer]" = weakref.WeakSet()
_LIVE_MODULES: "weakref.WeakSet[StatefulModule]" = weakref.WeakSet()
_LIVE_SESSIONS: "weakref.WeakSet[DeviceSession]" = weakref.WeakSet()
_DEVICE_CACHES: list[dict] = []


def register_device_cache(cache: dict) -> dict:
    """Registers a dict of cached IREE devices to be emptied, last, at exit."""
    _DEVICE_CACHES.append(cache)
    return cache


def release_device_objects() -> None:
    """Releases every live IREE buffer view, module context and cached device.

    Runs at interpreter exit (``atexit``). Afterwards the released objects
    cannot be used; :class:`DeviceBuffer` values already fetched to the host
    stay readable.
    """
    for buf in list(_LIVE_BUFFERS):
        buf.value = None
    for mod in list(_LIVE_MODULES):
        mod._release()
    for session in list(_LIVE_SESSIONS):
        session._release()
    gc.collect()
    for cache in _DEVICE_CACHES:
        cache.clear()
    gc.collect()


atexit.register(release_device_objects)


class DeviceBuffer:
    """A lazily fetched device array: state returned by a call, still on the device.

    ``np.asarray(buf)`` (or :meth:`to_host`) copies it to the host once; passing
    it back as a state input of the session that made it costs no transfer.
    """

    # "value" before "session": slots are cleared in this order, so the buffer view is
    # released while its session (and the device whose allocator owns it) is still alive.
    __slots__ = ("value", "session", "shape", "dtype", "_host", "__weakref__")

    def __init__(self, session, value, shape, dtype):
        self.value = value
        self.session = session
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._host = None
        _LIVE_BUFFERS.add(self)

    def to_host(self) -> np.ndarray:
        if self._host is None:
            self._host = self.session.get(self.value, self.dtype)
        return self._host

    def __array__(self, dtype=None, copy=None):
        a = self.to_host()
        return a if dtype is None else a.astype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"DeviceBuffer(shape={self.shape}, dtype={self.dtype.name})"


# IREE 3.13's local-task device serves each queue allocation larger than its 64 MiB pool
# slab from a pass-through pool, and a train step's transient slabs above that size are
# not given back: the process grows by about one such slab per step, without bound
# (SmolLM2-135M's `paper` step at batch 4 x 128: 360-380 MB per step; none at batch 1,
# whose transients fit a slab, nor on local-sync, whose allocations bypass the pools).
# Destroying the device frees it. StatefulModule warns once when it sees this growth.
MEMORY_GROWTH_DRIVERS = ("local-task",)
MEMORY_GROWTH_ENV = "POCKJAX_IREE_GROWTH_WARN_MB"
MEMORY_GROWTH_DEFAULT_MB = 2048


class MemoryGrowthWarning(ResourceWarning):
    """The process kept growing while an IREE step ran (see ``MEMORY_GROWTH_DRIVERS``)."""


def _growth_warn_bytes() -> int:
    raw = os.environ.get(MEMORY_GROWTH_ENV, "")
    try:
        mb = float(raw) if raw.strip() else MEMORY_GROWTH_DEFAULT_MB
    except ValueError as e:
        raise ModuleError(f"{MEMORY_GROWTH_ENV}={raw!r} is not a number of MiB (0 turns the check off)") from e
    return max(0, int(mb * 2**20))


def process_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (``None`` where ``/proc`` is missing).

    Example:
      >>> rss = process_rss_bytes()
      >>> rss is None or rss > 0
      True
    """
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class StatefulModule:
    """A compiled step whose state inputs stay on the device between calls.

    ``inputs`` with role ``"state"`` are uploaded once (from the metadata's
    weights file, or :meth:`set_state`) and replaced on the device by the
    matching ``"state"`` outputs after each :meth:`step`; other inputs are
    batch inputs, copied host->device each step; other outputs are returned.

    Args:
      session: a :class:`DeviceSession` or :class:`CommandLineSession`.
      metadata: the module's :class:`ModuleMetadata`.
    """

    def __init__(self, session, metadata: ModuleMetadata):
        # _state first: attributes are released in this order, buffer views before their session.
        self._state: dict[int, Any] = {}
        self.session = session
        self.metadata = metadata
        self.steps_run = 0
        #: Growth of the process (bytes) since the first step after which a
        #: :class:`MemoryGrowthWarning` is issued once, on ``local-task``; 0 turns
        #: the check off. Default from ``POCKJAX_IREE_GROWTH_WARN_MB``, else 2048 MiB.
        self.growth_warn_bytes = _growth_warn_bytes()
        self._rss_after_first_step: int | None = None
        self._growth_warned = False
        self._in_module = metadata.state_storage == "parameters"
        if self._in_module and not isinstance(session, DeviceSession):
            raise ModuleError("modules that keep state in parameter-backed globals run in-process only")
        _LIVE_MODULES.add(self)

    def _release(self) -> None:
        # Device state before the session (see release_device_objects).
        self._state.clear()

    # -- state ---------------------------------------------------------------

    @property
    def state_names(self) -> list[str]:
        return [self.metadata.inputs[i].name for i in self.metadata.state_inputs]

    @property
    def batch_names(self) -> list[str]:
        return [self.metadata.inputs[i].name for i in self.metadata.batch_inputs]

    def set_state(self, values: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> None:
        """Uploads state (weights, optimizer state) by name or in order.

        A mapping may set a subset of the state; a sequence must give all of it.
        """
        idx = self.metadata.state_inputs
        if isinstance(values, Mapping):
            by_name = {self.metadata.inputs[i].name: i for i in idx}
            unknown = [k for k in values if k not in by_name]
            if unknown:
                raise InputError(f"unknown state names {unknown}; the module's state is {list(by_name)}")
            items = [(by_name[k], v) for k, v in values.items()]
        else:
            values = list(values)
            if len(values) != len(idx):
                raise InputError(f"expected {len(idx)} state arrays, got {len(values)}")
            items = list(zip(idx, values))
        if self._in_module:
            mutable = self.metadata.mutable_state_inputs
            read_only = [self.metadata.inputs[i].name for i, _ in items if i not in mutable]
            if read_only:
                raise InputError(
                    f"state {read_only[:4]} is read-only in this module (frozen weights are read from "
                    "the parameter archive); write a new archive and reload to change them"
                )
            current = dict(zip(mutable, self.session.call("get_state")[: len(mutable)]))
            for i, v in items:
                current[i] = self.session.put(_check_array(self.metadata.inputs[i], v, "state"))
            self.session.call("set_state", [current[i] for i in mutable])
            return
        for i, v in items:
            a = _check_array(self.metadata.inputs[i], v, "state")
            self._state[i] = self.session.put(a)

    def get_state(self) -> dict[str, np.ndarray]:
        """Copies the current state back to the host, keyed by name."""
        if self._in_module:
            values = self.session.call("get_state")
            return {
                self.metadata.inputs[i].name: self.session.get(v, self.metadata.inputs[i].dtype)
                for i, v in zip(self.metadata.state_inputs, values)
            }
        self._require_state()
        return {
            self.metadata.inputs[i].name: self.session.get(self._state[i], self.metadata.inputs[i].dtype)
            for i in self.metadata.state_inputs
        }

    def save_weights(self, path: str | os.PathLike) -> None:
        """Writes the current state to an IREE parameter archive."""
        save_weights(path, self.get_state())

    def load_weights(self, path: str | os.PathLike) -> None:
        """Reads state from a parameter archive (entries matched by name)."""
        arrays = load_weights(path)
        names = set(self.state_names)
        if self._in_module:
            # Read-only state (frozen weights) comes from the archive the module was loaded with.
            names = {self.metadata.inputs[i].name for i in self.metadata.mutable_state_inputs}
        missing = sorted(names - set(arrays))
        if missing:
            raise ModuleError(f"weights file {os.fspath(path)!r} lacks state entries {missing[:8]}")
        self.set_state({k: v for k, v in arrays.items() if k in names})

    def _require_state(self):
        if self._in_module:
            return
        missing = [self.metadata.inputs[i].name for i in self.metadata.state_inputs if i not in self._state]
        if missing:
            raise ModuleError(
                f"state not initialised: {missing[:8]}{'...' if len(missing) > 8 else ''}; "
                "call set_state(...) or load_weights(path) first"
            )

    def _note_step_done(self) -> None:
        self.steps_run += 1
        if not self.growth_warn_bytes or self._growth_warned:
            return
        if getattr(self.session, "driver", None) not in MEMORY_GROWTH_DRIVERS:
            return
        rss = process_rss_bytes()
        if rss is None:
            return
        if self._rss_after_first_step is None:
            self._rss_after_first_step = rss
        elif rss - self._rss_after_first_step > self.growth_warn_bytes:
            self._growth_warned = True
            grown = (rss - self._rss_after_first_step) / 2**20
            warnings.warn(
                f"the process grew by {grown:.0f} MiB over {self.steps_run - 1} steps of this IREE module on "
                f"{self.session.driver!r}. IREE 3.13's local-task device does not give back transient "
                "allocations larger than its 64 MiB pool slab, so a step whose activations exceed that grows "
                "the process every step. Keep the batch small enough, run on 'local-sync', or save_weights(), "
                f"reload the module and load_weights() every few hundred MiB (set {MEMORY_GROWTH_ENV}=0 to "
                "silence this check)",
                MemoryGrowthWarning,
                stacklevel=3,
            )

    # -- running -------------------------------------------------------------

    def step(self, *batch, **named_batch) -> list[np.ndarray]:
        """Runs one step; returns the auxiliary outputs (e.g. the loss) as arrays.

        Batch inputs are given positionally in metadata order or by name.
        """
        self._require_state()
        meta = self.metadata
        bidx = meta.batch_inputs
        if batch and named_batch:
            raise InputError("give batch inputs either positionally or by name, not both")
        if named_batch:
            names = [meta.inputs[i].name for i in bidx]
            unknown = [k for k in named_batch if k not in names]
            missing = [n for n in names if n not in named_batch]
            if unknown or missing:
                raise InputError(f"batch inputs: unknown {unknown}, missing {missing}; expected {names}")
            batch = tuple(named_batch[n] for n in names)
        if len(batch) != len(bidx):
            raise InputError(
                f"expected {len(bidx)} batch inputs {[meta.inputs[i].name for i in bidx]}, got {len(batch)}"
            )
        args: list[Any] = [None] * len(meta.inputs)
        for i, v in zip(bidx, batch):
            args[i] = self.session.put(_check_array(meta.inputs[i], v, "input"))
        if self._in_module:
            outs = self.session.invoke([args[i] for i in bidx])
            self._note_step_done()
            return [self.session.get(o, meta.outputs[j].dtype) for o, j in zip(outs, meta.aux_outputs)]
        for i in meta.state_inputs:
            args[i] = self._state[i]
        if isinstance(self.session, CommandLineSession):
            outs = self.session.invoke(args, num_outputs=len(meta.outputs))
        else:
            outs = self.session.invoke(args)
        if len(outs) != len(meta.outputs):
            raise ModuleError(f"module returned {len(outs)} outputs, metadata says {len(meta.outputs)}")
        aux = []
        for spec, o in zip(meta.outputs, outs):
            if spec.role == ROLE_STATE:
                self._state[spec.state_index] = o
            else:
                aux.append(self.session.get(o, spec.dtype))
        self._note_step_done()
        return aux

    def __call__(self, *batch, **named_batch):
        return self.step(*batch, **named_batch)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(
    path: str | os.PathLike,
    *,
    driver: str | None = None,
    target: str | None = None,
    tool: Sequence[str] | None = None,
    load_initial_weights: bool = True,
    verify_checksum: bool = True,
) -> StatefulModule:
    """Loads an exported module directory for running steps from NumPy arrays.

    Args:
      path: directory written by ``export_module`` (or its ``module.json``).
      driver: IREE device to run on; defaults to the metadata's driver. A
        driver other than the one the module was compiled for is an error.
      target: if given, the module must have been compiled for this target
        name (``cpu``, ``arm64``, ``vulkan``, ``cuda``, ``dsp``).
      tool: run through the ``iree-run-module`` command (this list is the
        command prefix, e.g. ``["qemu-aarch64", ".../iree-run-module"]``)
        instead of in-process; needed for modules built for another CPU
        architecture.
      load_initial_weights: upload ``weights.irpa`` if the export has one.
      verify_checksum: check the module file against the metadata's sha256.

    Raises:
      ModuleError: missing files, malformed metadata, checksum mismatch.
      TargetMismatchError: the module was built for another target/driver or
        another CPU architecture than this process can run.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) if path.endswith(".json") else path
    if not os.path.isdir(directory):
        raise ModuleError(f"module directory {directory!r} does not exist")
    meta = read_metadata(directory)
    module_path = os.path.join(directory, MODULE_FILE)
    if not os.path.exists(module_path):
        raise ModuleError(f"module file {module_path!r} is missing (metadata found, .vmfb not)")
    if verify_checksum and meta.module_sha256 and _file_sha256(module_path) != meta.module_sha256:
        raise ModuleError(f"{module_path!r} does not match the checksum in its metadata (was it replaced?)")
    tgt = meta.target
    if target is not None and target != tgt.get("name"):
        raise TargetMismatchError(
            f"module was compiled for target {tgt.get('name')!r}, not {target!r}; re-export it for {target!r}"
        )
    want_driver = tgt.get("driver")
    if driver is not None and driver != want_driver and not (
        {driver, want_driver} <= {"local-task", "local-sync"}
    ):
        raise TargetMismatchError(
            f"module was compiled for target {tgt.get('name')!r} (backend {tgt.get('backend')!r}), which runs on "
            f"driver {want_driver!r}, not {driver!r}"
        )
    driver = driver or want_driver
    triple = tgt.get("triple")
    if tool is None and triple and tgt.get("backend") == "llvm-cpu":
        arch = triple.split("-")[0]
        if arch != host_machine_triple_prefix():
            raise TargetMismatchError(
                f"module was compiled for {triple!r} but this machine is {host_machine_triple_prefix()!r}; "
                "run it on such a device, or pass tool=[emulator, iree-run-module] (see "
                "pockjax.backends.arm64_runner)"
            )
    wpath = None
    if meta.weights:
        wpath = os.path.join(directory, meta.weights.get("file", WEIGHTS_FILE))
        if (load_initial_weights or meta.state_storage == "parameters") and not os.path.exists(wpath):
            raise ModuleError(f"weights file {wpath!r} named in the metadata is missing")
    if meta.state_storage == "parameters":
        if tool is not None:
            raise ModuleError("modules with parameter-backed state run in-process only (not via iree-run-module)")
        if wpath is None:
            raise ModuleError("module keeps its state in parameters but the metadata names no weights file")
        session = DeviceSession(module_path, driver, function=meta.function,
                                parameters=[(meta.parameter_scope, wpath)])
        return StatefulModule(session, meta)
    if tool is not None:
        session = CommandLineSession(module_path, driver, tool, function=meta.function)
    else:
        session = DeviceSession(module_path, driver, function=meta.function)
    mod = StatefulModule(session, meta)
    if load_initial_weights and wpath is not None:
        mod.load_weights(wpath)
    return mod

"""Sessions: one compiled module loaded where it runs, driven on device buffers.

- :class:`DeviceSession`: one ``.vmfb`` on one HAL device (``local-task``,
  ``local-sync``, ``vulkan``, ``cuda``...), in process.
- :class:`CommandLineSession`: the same contract through ``iree-run-module``
  (optionally under an emulator such as ``qemu-aarch64``).
- :class:`DeviceBuffer`: an output still on the device.

Every live buffer view, module and session is released at interpreter exit,
in dependency order (:func:`release_device_objects`).
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import subprocess
import tempfile
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from .heap import HEAP_DRIVERS, retain_freed_heap
from .metadata import InputError, ModuleError


def _hal_element_type(dtype):
    from iree.runtime.dtypes import map_dtype_to_hal_element_type

    et = map_dtype_to_hal_element_type(np.dtype(dtype))
    if et is None:
        raise InputError(f"dtype {np.dtype(dtype)} has no IREE element type")
    return et


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
_LIVE_MODULES: weakref.WeakSet = weakref.WeakSet()  # of pockjax.runtime.module.StatefulModule
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
        """The value on the host, read-only (as a ``jax.Array``'s): it is the device buffer's copy,
        fetched once, and an edit of it would change what later reads see but not what the next
        step reads. Edit a copy (``np.array(buf)``) and pass that instead."""
        if self._host is None:
            host = self.session.get(self.value, self.dtype)
            host.flags.writeable = False
            self._host = host
        return self._host

    def __array__(self, dtype=None, copy=None):
        a = self.to_host()
        if copy:
            return np.array(a, dtype=dtype)
        return a if dtype is None else a.astype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"DeviceBuffer(shape={self.shape}, dtype={self.dtype.name})"

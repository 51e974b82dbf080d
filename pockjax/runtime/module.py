"""A stateful step loaded from an exported directory: :class:`StatefulModule` and :func:`load`.

A train step with *state* (parameters, optimizer state) that stays on the
device between calls; only batch inputs go host->device and only auxiliary
outputs (the loss, metrics) come back. :func:`load` builds one from an
exported directory (written by ``pockjax.backends.iree.export_module``)::

    module.vmfb      the compiled IREE module (entry function ``main``)
    module.json      metadata, see :data:`~pockjax.runtime.metadata.METADATA_FORMAT`
    weights.irpa     optional IREE parameter archive holding the initial state
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from .heap import (
    MEMORY_GROWTH_DRIVERS,
    MEMORY_GROWTH_ENV,
    MemoryGrowthWarning,
    _growth_warn_bytes,
    process_rss_bytes,
)
from .metadata import (
    MODULE_FILE,
    WEIGHTS_FILE,
    InputError,
    ModuleError,
    ROLE_STATE,
    ModuleMetadata,
    TargetMismatchError,
    check_array,
    host_machine_triple_prefix,
    read_metadata,
)
from .session import _LIVE_MODULES, CommandLineSession, DeviceSession
from .weights import load_weights, save_weights


_ELEMENT_TYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "i1": "bool",
                  "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "ui8": "uint8", "ui16": "uint16",
                  "ui32": "uint32", "ui64": "uint64", "si8": "int8", "si16": "int16", "si32": "int32",
                  "si64": "int64"}


def _declared(declaration: str) -> tuple[list, list] | None:
    """``(inputs, outputs)`` as ``(shape, dtype)`` pairs from IREE's ``iree.abi.declaration``
    (``sync func @main(%input0: tensor<6x8xf32>, ...) -> (%output0: tensor<i32>, ...)``); None
    for a form this reader does not know."""
    import re

    head, arrow, tail = declaration.partition(") -> (")
    if not arrow:
        return None
    sides = []
    for text in (head, tail):
        types = re.findall(r"%\w+: ([^,()]+)", text)
        pairs = []
        for t in types:
            m = re.fullmatch(r"tensor<((?:\d+x)*)(\w+)>", t.strip())
            if m is None or m.group(2) not in _ELEMENT_TYPES:
                return None
            pairs.append((tuple(int(d) for d in m.group(1).split("x") if d), _ELEMENT_TYPES[m.group(2)]))
        sides.append(pairs)
    return sides[0], sides[1]


def _check_signature(session, meta: ModuleMetadata, in_module: bool) -> None:
    """Refuses a ``module.json`` that does not describe the module's own function (an input's
    shape edited, outputs reordered): the runtime would file a returned buffer as the wrong
    state leaf. The module's declaration is compared where IREE gives one (in-process)."""
    function = getattr(session, "function", None)
    reflection = getattr(function, "reflection", None) or {}
    declared = _declared(reflection.get("iree.abi.declaration", ""))
    if declared is None:
        return
    ins = [meta.inputs[i] for i in (meta.batch_inputs if in_module else range(len(meta.inputs)))]
    outs = [meta.outputs[i] for i in (meta.aux_outputs if in_module else range(len(meta.outputs)))]
    for kind, specs, types in (("input", ins, declared[0]), ("output", outs, declared[1])):
        if len(specs) != len(types):
            raise ModuleError(f"module.json lists {len(specs)} {kind}s, the module's function has {len(types)}:"
                              f" the metadata does not describe this module (re-export it)")
        for k, (spec, (shape, dtype)) in enumerate(zip(specs, types)):
            if tuple(spec.shape) != shape or str(spec.dtype) != dtype:
                raise ModuleError(f"module.json says {kind} {k} ({spec.name!r}) is {tuple(spec.shape)}"
                                  f" {spec.dtype}, the module's function has {shape} {dtype} there: the"
                                  f" metadata does not describe this module (re-export it)")


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
        _check_signature(session, metadata, self._in_module)
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
                current[i] = self.session.put(check_array(self.metadata.inputs[i], v, "state"))
            self.session.call("set_state", [current[i] for i in mutable])
            return
        for i, v in items:
            a = check_array(self.metadata.inputs[i], v, "state")
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

    @property
    def has_state(self) -> bool:
        """Whether every state input holds a value (set, loaded or kept in the module)."""
        return self._in_module or all(i in self._state for i in self.metadata.state_inputs)

    def _require_state(self):
        if self.has_state:
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
            args[i] = self.session.put(check_array(meta.inputs[i], v, "input"))
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


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, as hex, read in 1 MiB chunks."""
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
    if verify_checksum and meta.module_sha256 and file_sha256(module_path) != meta.module_sha256:
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
                "pockjax.backends.iree.arm64)"
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

"""What an exported module is: its files, its signature and its metadata (``module.json``).

NumPy only (no JAX, no ``iree.runtime``).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

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


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _once_each(pairs: list) -> dict:
    # the runtime reads JSON on its own (it imports nothing of pockjax outside itself)
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        raise ValueError(f"key {', '.join(map(repr, twice))} given twice in one object")
    return out


def read_metadata(path: str | os.PathLike) -> ModuleMetadata:
    """Reads ``module.json`` from an exported directory (or the file itself)."""
    path = os.fspath(path)
    meta_path = os.path.join(path, METADATA_FILE) if os.path.isdir(path) else path
    if not os.path.exists(meta_path):
        raise ModuleError(f"no module metadata at {meta_path!r} (expected {METADATA_FILE} in the export directory)")
    try:
        with open(meta_path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ModuleError(f"cannot read module metadata {meta_path!r}: {e.strerror or e}") from None
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_once_each)
    except UnicodeDecodeError as e:
        raise ModuleError(f"malformed module metadata {meta_path!r}: not UTF-8 text (byte "
                          f"0x{raw[e.start]:02x} at offset {e.start}); is it a binary file?") from None
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise ModuleError(f"malformed module metadata {meta_path!r}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModuleError(f"malformed module metadata {meta_path!r}: expected a JSON object, got "
                          f"{type(data).__name__}")
    try:
        return ModuleMetadata.from_json(data)
    except ModuleError as e:
        raise type(e)(f"{meta_path!r}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModuleError(f"malformed module metadata {meta_path!r}: {type(e).__name__}: {e}") from None


def host_machine_triple_prefix() -> str:
    """The LLVM triple architecture of this machine (``x86_64``, ``aarch64``...)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def check_array(spec: TensorSpec, value: Any, what: str) -> np.ndarray:
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

"""A safe reader of PyTorch tensor checkpoints (``.pth`` / ``.pt``), without torch.

``torch.save`` writes one of two layouts:

* the zip format (torch >= 1.6): a zip archive whose members share a folder
  ``<prefix>/``: ``data.pkl`` (a pickle of the state dict), ``data/<key>``
  (the raw bytes of each storage), ``byteorder`` and ``version``;
* the legacy format (older files, e.g. torchvision's ImageNet weights): a
  stream of pickles: a magic number, the protocol version (1001), a system-info
  dict (byte order), the state dict, the list of storage keys, then each
  storage as an 8-byte element count followed by its bytes.

The state-dict pickle is read by a restricted unpickler: the only globals it
resolves are ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``
(and the older ``_rebuild_tensor``),
``torch._utils._rebuild_parameter`` (and ``_with_state``) and the typed storage
classes (``torch.FloatStorage``, ...), each mapped to a pure-numpy stand-in;
any other global, opcode ``BUILD`` on anything but an ``OrderedDict``, or a persistent id
that is not a storage raises :class:`TorchCheckpointError`. Nothing from the
file is executed and torch is never imported. Every tensor's offset, sizes and
strides are checked against its storage, and every storage against the bytes
the file holds.

Example:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "bad.pth")
    >>> with open(p, "wb") as f:
    ...     _ = f.write(b"not a checkpoint")
    >>> read_torch_checkpoint(p)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pockjax.errors.TorchCheckpointError: ...bad.pth: not a PyTorch checkpoint: ...
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from typing import Any

import numpy as np

from pockjax.errors import FileMissingError, TorchCheckpointError

__all__ = ["TORCH_STORAGE_DTYPES", "TorchCheckpointError", "read_torch_checkpoint"]


#: ``torch.<Name>Storage`` -> numpy dtype name (the file's byte order is applied).
TORCH_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool",
}

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_ZIP_MAGIC = b"PK\x03\x04"


def _dtype(name: str, byteorder: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # a JAX dependency

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(name)
    if dt.itemsize > 1:
        dt = dt.newbyteorder("<" if byteorder == "little" else ">")
    return dt


# -- stand-ins for what the pickle names ---------------------------------------------


class _StorageType:
    """Stands for ``torch.FloatStorage`` & co.: only names a dtype; not callable."""

    def __init__(self, name: str, dtype_name: str):
        self.name = name
        self.dtype_name = dtype_name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _Storage:
    """A storage named by a persistent id; its bytes are attached after unpickling."""

    def __init__(self, key: str, dtype_name: str, numel: int, view: tuple[int, int] | None = None,
                 root: "_Storage | None" = None):
        self.key = key
        self.dtype_name = dtype_name
        self.numel = numel
        self.view = view  # (offset, size) in elements into root (legacy storage views)
        self.root = root
        self.data: np.ndarray | None = None

    def array(self) -> np.ndarray:
        if self.root is not None:
            offset, size = self.view
            return self.root.array()[offset:offset + size]
        assert self.data is not None
        return self.data


class _Tensor:
    """What ``_rebuild_tensor_v2`` returns: a strided view, materialised later."""

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


class _Refused(Exception):
    pass


class _RestrictedUnpickler(pickle._Unpickler):  # the Python implementation: its opcodes are ours to restrict
    """Resolves only the globals a tensor state dict needs; refuses everything else."""

    _ALLOWED = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor_v2,  # torch < 0.4: no requires_grad
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    }

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, persistent_load=None, **kw):
        super().__init__(file, encoding="utf-8", **kw)
        self._persistent = persistent_load

    def find_class(self, module, name):
        found = self._ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in TORCH_STORAGE_DTYPES:
            return _StorageType(name, TORCH_STORAGE_DTYPES[name])
        if (module, name) in (("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage")):
            return _StorageType("UntypedStorage", "uint8")
        raise _Refused(f"it names the global {module}.{name}, which a tensor state dict does"
                       f" not use (refused; nothing from the file was run)")

    def persistent_load(self, pid):
        if self._persistent is None:
            raise _Refused(f"unexpected persistent id {pid!r}")
        return self._persistent(pid)

    def load_build(self):
        # BUILD sets an object's state; only OrderedDicts (torch's _metadata) may get one
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is not collections.OrderedDict or not isinstance(state, dict):
            raise _Refused(f"BUILD on a {type(inst).__name__} (only a state dict's metadata"
                           f" may be set)")
        meta = state.get("_metadata")
        if meta is not None:
            inst._metadata = meta

    dispatch[pickle.BUILD[0]] = load_build


def _unpickle(data: bytes, where: str, persistent_load=None) -> Any:
    up = _RestrictedUnpickler(io.BytesIO(data), persistent_load=persistent_load)
    return _call_unpickler(up, where)


def _call_unpickler(up: _RestrictedUnpickler, where: str) -> Any:
    try:
        return up.load()
    except TorchCheckpointError:
        raise
    except _Refused as e:
        raise TorchCheckpointError(f"{where}: {e}") from None
    except RecursionError:
        raise TorchCheckpointError(f"{where}: the pickle nests too deeply") from None
    except Exception as e:  # a malformed pickle: nothing ran but our stand-ins
        raise TorchCheckpointError(f"{where}: malformed pickle ({type(e).__name__}: {e})") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _storage_from_pid(pid: Any, where: str, storages: dict[str, _Storage], legacy: bool) -> _Storage:
    n = 6 if legacy else 5
    if not (isinstance(pid, tuple) and len(pid) == n and pid[0] == "storage"):
        raise _Refused(f"persistent id {pid!r:.200} is not a storage reference")
    stype, key, _location, numel = pid[1:5]
    if not isinstance(stype, _StorageType):
        raise _Refused(f"storage {key!r}: type {stype!r:.100} is not a storage class")
    if not isinstance(key, str) or not _is_int(numel) or numel < 0:
        raise _Refused(f"malformed storage reference {pid!r:.200}")
    st = storages.get(key)
    if st is None:
        st = storages[key] = _Storage(key, stype.dtype_name, numel)
    elif st.dtype_name != stype.dtype_name or st.numel != numel:
        raise _Refused(f"storage {key!r} is referenced as {stype.dtype_name}[{numel}] and as"
                       f" {st.dtype_name}[{st.numel}]")
    view = pid[5] if legacy else None
    if view is None:
        return st
    if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
            and _is_int(view[1]) and _is_int(view[2])):
        raise _Refused(f"storage {key!r}: malformed view {view!r:.200}")
    _, offset, size = view
    if not (0 <= offset and 0 <= size and offset + size <= numel):
        raise _Refused(f"storage {key!r}: view [{offset}, {offset + size}) outside its"
                       f" {numel} elements")
    return _Storage(view[0], st.dtype_name, size, (offset, size), root=st)


def _materialise(name: str, t: _Tensor, where: str) -> np.ndarray:
    what = f"{where}: tensor {name!r}"
    if not isinstance(t.storage, _Storage):
        raise TorchCheckpointError(f"{what}: its storage is not a storage reference")
    offset, size, stride = t.offset, t.size, t.stride
    if not _is_int(offset) or offset < 0:
        raise TorchCheckpointError(f"{what}: storage offset {offset!r} must be a non-negative int")
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
            and all(_is_int(s) and s >= 0 for s in size)
            and all(_is_int(s) and s >= 0 for s in stride)):
        raise TorchCheckpointError(f"{what}: size {size!r:.100} and stride {stride!r:.100} must"
                                   f" be tuples of equal length of non-negative ints")
    data = t.storage.array()
    count = math.prod(size)
    if count == 0:
        return np.zeros(size, data.dtype.newbyteorder("="))
    if count > data.size:  # a broadcast (stride-0) view would materialise more than the file holds
        raise TorchCheckpointError(f"{what}: size {size} has {count} elements, more than its"
                                   f" storage's {data.size} (a broadcast view; not read)")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= data.size:
        raise TorchCheckpointError(
            f"{what}: size {size} with stride {stride} at offset {offset} reaches element"
            f" {last}, its storage holds {data.size}")
    item = data.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(data[offset:], shape=size,
                                           strides=tuple(s * item for s in stride), writeable=False)
    return np.array(view, dtype=data.dtype.newbyteorder("="), order="C")


def _to_state_dict(obj: Any, where: str) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict):
        raise TorchCheckpointError(f"{where}: holds a {type(obj).__name__}, not a state dict"
                                   f" (a dict of tensors)")
    out = {}
    for name, value in obj.items():
        if not isinstance(name, str):
            raise TorchCheckpointError(f"{where}: state dict key {name!r:.100} is not a string")
        if not isinstance(value, _Tensor):
            raise TorchCheckpointError(f"{where}: {name!r} holds a {type(value).__name__}, not a"
                                       f" tensor (only flat state dicts of tensors are read)")
        out[name] = _materialise(name, value, where)
    return out


# -- the two layouts -------------------------------------------------------------------


def _read_zip(path: str) -> dict[str, np.ndarray]:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise TorchCheckpointError(f"{path}: a truncated or corrupt zip archive ({e})") from None
    with zf:
        names = zf.namelist()
        pkls = [n for n in names if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise TorchCheckpointError(f"{path}: a zip archive but not a PyTorch checkpoint:"
                                       f" expected one <prefix>/data.pkl, found {len(pkls)}")
        prefix = pkls[0][: -len("data.pkl")]
        members = set(names)

        def read(member: str) -> bytes:
            try:
                return zf.read(member)
            except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError) as e:
                raise TorchCheckpointError(f"{path}: member {member} is truncated or corrupt"
                                           f" ({e})") from None

        byteorder = "little"
        if prefix + "byteorder" in members:
            byteorder = read(prefix + "byteorder").decode("ascii", "replace").strip()
            if byteorder not in ("little", "big"):
                raise TorchCheckpointError(f"{path}: unknown byteorder {byteorder!r}")
        storages: dict[str, _Storage] = {}
        where = f"{path}: {pkls[0]}"
        obj = _unpickle(read(pkls[0]), where,
                        lambda pid: _storage_from_pid(pid, where, storages, legacy=False))
        for key, st in storages.items():
            member = f"{prefix}data/{key}"
            if member not in members:
                raise TorchCheckpointError(f"{path}: storage {key!r} is missing (no member"
                                           f" {member})")
            dt = _dtype(st.dtype_name, byteorder)
            info = zf.getinfo(member)
            need = st.numel * dt.itemsize
            if info.file_size != need:
                raise TorchCheckpointError(f"{path}: storage {key!r} of {st.numel}"
                                           f" {st.dtype_name} needs {need} bytes, member"
                                           f" {member} holds {info.file_size}")
            st.data = np.frombuffer(read(member), dtype=dt)
        return _to_state_dict(obj, path)


def _read_legacy(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        raw = f.read()
    buf = io.BytesIO(raw)

    def load(what: str, persistent_load=None):
        up = _RestrictedUnpickler(buf, persistent_load=persistent_load)
        return _call_unpickler(up, f"{path}: {what}")

    try:
        magic = _RestrictedUnpickler(buf).load()
    except Exception:
        magic = None
    if magic != _LEGACY_MAGIC:
        raise TorchCheckpointError(f"{path}: not a PyTorch checkpoint: neither a zip archive nor"
                                   f" a legacy torch.save stream (no magic number)")
    protocol = load("protocol version")
    if protocol != _LEGACY_PROTOCOL:
        raise TorchCheckpointError(f"{path}: unsupported legacy protocol version {protocol!r}"
                                   f" (expected {_LEGACY_PROTOCOL})")
    info = load("system info")
    if not isinstance(info, dict) or not isinstance(info.get("little_endian"), bool):
        raise TorchCheckpointError(f"{path}: malformed system info {info!r:.200}")
    byteorder = "little" if info["little_endian"] else "big"
    storages: dict[str, _Storage] = {}
    where = f"{path}: state dict"
    obj = load("state dict", lambda pid: _storage_from_pid(pid, where, storages, legacy=True))
    keys = load("storage keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TorchCheckpointError(f"{path}: the storage key list is malformed")
    if len(set(keys)) != len(keys):
        raise TorchCheckpointError(f"{path}: the storage key list repeats a key")
    missing = sorted(set(storages) - set(keys))
    if missing:
        raise TorchCheckpointError(f"{path}: storage {missing[0]!r} is referenced but missing"
                                   f" from the file")
    pos = buf.tell()
    fmt = "<q" if byteorder == "little" else ">q"
    for key in keys:
        st = storages.get(key)
        if st is None:
            raise TorchCheckpointError(f"{path}: the file holds storage {key!r}, which no tensor"
                                       f" uses")
        if pos + 8 > len(raw):
            raise TorchCheckpointError(f"{path} is truncated: storage {key!r} starts at byte"
                                       f" {pos}, the file has {len(raw)}")
        (numel,) = struct.unpack_from(fmt, raw, pos)
        if numel != st.numel:
            raise TorchCheckpointError(f"{path}: storage {key!r} holds {numel} elements, the"
                                       f" state dict expects {st.numel}")
        dt = _dtype(st.dtype_name, byteorder)
        begin, end = pos + 8, pos + 8 + numel * dt.itemsize
        if end > len(raw):
            raise TorchCheckpointError(f"{path} is truncated: storage {key!r} needs bytes"
                                       f" [{begin}, {end}), the file has {len(raw)}")
        st.data = np.frombuffer(raw, dtype=dt, count=numel, offset=begin)
        pos = end
    if pos != len(raw):
        raise TorchCheckpointError(f"{path}: {len(raw) - pos} bytes after the last storage;"
                                   f" the file is corrupt")
    return _to_state_dict(obj, path)


def read_torch_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a PyTorch state dict (zip or legacy ``torch.save`` format) as numpy arrays.

    Args:
        path: a ``.pth`` / ``.pt`` file holding a flat dict of tensors.

    Returns:
        ``{name: array}`` in the file's order: C-contiguous, native byte order,
        the tensor's dtype (``bfloat16`` through ``ml_dtypes``).

    Raises:
        FileMissingError: no such file.
        TorchCheckpointError: not a checkpoint, truncated, a missing or
            short storage, a tensor outside its storage, or a pickle naming
            anything but tensors (which is refused, never run).

    Example:
        >>> read_torch_checkpoint("/no/such.pth")
        Traceback (most recent call last):
        ...
        pockjax.errors.FileMissingError: PyTorch checkpoint not found: /no/such.pth
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileMissingError(f"PyTorch checkpoint not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC or zipfile.is_zipfile(path):
        return _read_zip(path)
    return _read_legacy(path)

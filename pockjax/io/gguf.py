"""A validated reader of GGUF files (llama.cpp's model format), versions 2 and 3.

Every count, length and offset in the header is checked against the bytes
that are actually there before it is used, so a truncated or corrupt file
raises :class:`~pockjax.errors.GGUFError` naming the file and the fault,
never another exception and never a tensor read from the wrong bytes. The
tensor layout is checked as llama.cpp checks it: tensors follow each other in
header order, each at the next multiple of the alignment, inside the file.
Tensor data are returned as read-only views of a memory map; nothing is
executed from the file.

Example:
    >>> import os, tempfile, numpy as np
    >>> import gguf  # the writer of llama.cpp's Python package
    >>> p = os.path.join(tempfile.mkdtemp(), "t.gguf")
    >>> w = gguf.GGUFWriter(p, "llama")
    >>> w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    >>> f = open_gguf(p)
    >>> f.metadata["general.architecture"], f.tensors[0].shape, f.tensors[0].type_name
    ('llama', (2, 3), 'F32')
    >>> f.tensor_bytes(f.tensors[0]).view(np.float32).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import numpy as np

from pockjax.errors import FileMissingError, GGUFError

__all__ = ["GGML_TYPES", "GGUFFile", "GGUFTensor", "Typed", "open_gguf", "write_gguf"]

#: ggml tensor type id -> (name, values per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}

# GGUF metadata value types: id -> (struct code, size); 8 = string, 9 = array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
            5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8),
            12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8",
          11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_MAX_DIMS = 4          # GGML_MAX_DIMS
_MAX_VALUES = 1 << 60  # values in one tensor (float32: 4 EiB), far above any real one
_MAX_ARRAY_DEPTH = 4   # nested arrays deeper than this are not real models
_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry.

    Attributes:
        name: The tensor's name (``blk.0.attn_q.weight``).
        shape: The numpy shape (GGUF's dimension list reversed).
        type_name: The ggml type (``F32``, ``Q4_1``, ...).
        offset: Absolute byte offset of the data in the file.
        n_bytes: Size of the data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    n_bytes: int


class GGUFFile:
    """A parsed, validated GGUF file: metadata, tensor entries and their bytes.

    Attributes:
        path: The file.
        version: The GGUF version (2 or 3).
        metadata: Key -> value (``str``, ``int``, ``float``, ``bool`` or lists of them).
        tensors: The :class:`GGUFTensor` entries in file order.
        alignment: The data alignment in bytes.
    """

    def __init__(self, path: str, buf: Any, version: int, metadata: dict[str, Any],
                 tensors: list[GGUFTensor], alignment: int):
        self.path = path
        self._buf = buf
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def tensor_bytes(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's raw bytes as a read-only ``uint8`` array (a view of the file)."""
        if tensor.n_bytes == 0:
            return np.zeros(0, np.uint8)
        return np.frombuffer(self._buf, np.uint8, count=tensor.n_bytes, offset=tensor.offset)

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)})"


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, path: str, buf: Any, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path} is truncated or corrupt: {what} needs {n} bytes at"
                            f" offset {self.pos}, the file has {self.size}")

    def scalar(self, code: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e.reason} at byte"
                            f" {e.start})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            value = self.scalar(*_SCALARS[vtype], what)
            return bool(value) if vtype == _BOOL else value
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                raise GGUFError(f"{self.path}: {what} nests arrays more than"
                                f" {_MAX_ARRAY_DEPTH} deep")
            etype = self.u32(f"the element type of {what}")
            count = self.u64(f"the length of {what}")
            if etype in _NUMPY:
                size = _SCALARS[etype][1]
                self.need(count * size, f"{count} elements of {what}")
                arr = np.frombuffer(self.buf, _NUMPY[etype], count=count, offset=self.pos)
                self.pos += count * size
                return arr.tolist()
            if etype == _BOOL:
                self.need(count, f"{count} elements of {what}")
                out = [b != 0 for b in bytes(self.buf[self.pos:self.pos + count])]
                self.pos += count
                return out
            if etype in (_STRING, _ARRAY):
                # each element takes at least 8 bytes: bound the count before looping
                self.need(count * 8, f"{count} elements of {what}")
                return [self.value(etype, f"element {i} of {what}", depth + 1)
                        for i in range(count)]
            raise GGUFError(f"{self.path}: {what} has unknown element type {etype}")
        raise GGUFError(f"{self.path}: {what} has unknown value type {vtype}")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Opens and validates a GGUF file.

    Args:
        path: The ``.gguf`` file.

    Returns:
        A :class:`GGUFFile`; tensor bytes are read lazily from a memory map.

    Raises:
        FileMissingError: ``path`` does not exist (a ``FileNotFoundError``).
        GGUFError: not a GGUF file, an unsupported version, truncated, or a
            header that contradicts itself (duplicate names, a tensor outside
            the file or overlapping another, a bad alignment, ...).

    Example:
        >>> open_gguf("/no/such/model.gguf")
        Traceback (most recent call last):
        ...
        pockjax.errors.FileMissingError: GGUF file not found: /no/such/model.gguf
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise GGUFError(f"{path} is a directory, not a GGUF file")
    if not os.path.exists(path):
        raise FileMissingError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise GGUFError(f"{path} is not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (magic bytes {magic!r},"
                            f" expected b'GGUF')")
        size = os.fstat(f.fileno()).st_size
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(path, buf, size)
    cur.pos = 4
    version = cur.u32("the version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3 are);"
                        f" convert the model again with a current llama.cpp")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    # every metadata entry takes at least 12 bytes, every tensor entry at least 24
    cur.need(n_kv * 12 + n_tensors * 24, f"{n_kv} metadata entries and {n_tensors} tensors")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in metadata:
            raise GGUFError(f"{path}: metadata key {key!r} appears twice")
        vtype = cur.u32(f"the type of metadata {key!r}")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1)):
        raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")
    entries = []
    names = set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        if name in names:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        n_dims = cur.u32(f"the dimension count of tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions (at most"
                            f" {_MAX_DIMS})")
        dims = [cur.u64(f"dimension {j} of tensor {name!r}") for j in range(n_dims)]
        type_id = cur.u32(f"the type of tensor {name!r}")
        offset = cur.u64(f"the offset of tensor {name!r}")
        if type_id not in GGML_TYPES:
            raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type {type_id}")
        type_name, block, block_bytes = GGML_TYPES[type_id]
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} ({type_name}) has a first dimension"
                            f" {dims[0]} that is not a multiple of its block size {block}")
        count = nonzero = 1
        for d in dims:
            count *= d
            nonzero *= max(d, 1)
        if nonzero > _MAX_VALUES:  # (an array of these dimensions cannot exist, even with a 0 among them)
            raise GGUFError(f"{path}: tensor {name!r} has dimensions {dims}, more values than any array"
                            f" can hold; the file is corrupt")
        n_bytes = count // block * block_bytes
        entries.append((name, tuple(reversed(dims)), type_name, offset, n_bytes))
    data_start = -(-cur.pos // alignment) * alignment
    expected = 0
    tensors = []
    for name, shape, type_name, offset, n_bytes in entries:
        if offset != expected:
            raise GGUFError(f"{path}: tensor {name!r} has data offset {offset}, expected"
                            f" {expected}; the header is corrupt")
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFError(f"GGUF file {path} is truncated: tensor {name!r} needs bytes up to"
                            f" {start + n_bytes}, the file has {size}")
        tensors.append(GGUFTensor(name, shape, type_name, start, n_bytes))
        expected += -(-n_bytes // alignment) * alignment
    return GGUFFile(path, buf, version, metadata, tensors, alignment)


# -- writing ---------------------------------------------------------------------------
_TYPE_IDS = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}
_CODES = {"u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "f32": 6, "bool": 7,
          "u64": 10, "i64": 11, "f64": 12}


@dataclasses.dataclass(frozen=True)
class Typed:
    """A metadata value with its GGUF type (``"u32"``, ``"i32"``, ``"f32"``, ...).

    Untyped values are written as: ``str`` a string, ``bool`` a bool, ``int``
    ``u32`` (``i64`` if negative or too large), ``float`` ``f32``, a list of
    those an array of them.
    """

    kind: str
    value: Any


def _value_bytes(value: Any, key: str) -> tuple[int, bytes]:
    """(GGUF type id, encoded value) of one metadata value."""
    if isinstance(value, Typed):
        if isinstance(value.value, (list, tuple)):
            code = _CODES[value.kind]
            items = b"".join(struct.pack(_SCALARS[code][0], v) for v in value.value)
            return _ARRAY, struct.pack("<IQ", code, len(value.value)) + items
        code = _CODES[value.kind]
        return code, struct.pack(_SCALARS[code][0], value.value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _STRING, struct.pack("<Q", len(raw)) + raw
    if isinstance(value, (bool, np.bool_)):
        return _BOOL, struct.pack("<?", bool(value))
    if isinstance(value, (int, np.integer)):
        v = int(value)
        return (4, struct.pack("<I", v)) if 0 <= v < 2 ** 32 else (11, struct.pack("<q", v))
    if isinstance(value, (float, np.floating)):
        return 6, struct.pack("<f", float(value))
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, str) for v in value):
            items = [_value_bytes(v, key)[1] for v in value]
            return _ARRAY, struct.pack("<IQ", _STRING, len(value)) + b"".join(items)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            return _value_bytes(Typed("i32", [int(v) for v in value]), key)
        if all(isinstance(v, (float, np.floating)) for v in value):
            return _value_bytes(Typed("f32", [float(v) for v in value]), key)
    raise GGUFError(f"metadata {key!r}: cannot write a value of type {type(value).__name__} to GGUF")


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any],
               tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]], *, alignment: int = 32) -> None:
    """Writes a GGUF (version 3) file atomically: a temporary sibling, fsync'd, renamed.

    Args:
      path: the ``.gguf`` file.
      metadata: ``{key: value}`` in order (``general.architecture`` first,
        as llama.cpp expects); values as :class:`Typed` describes.
      tensors: ``(name, type name, numpy shape, data)``: the data is the
        tensor's values (``F32``/``F16``) or its block bytes (``Q8_0``...),
        in the numpy shape's row-major order; GGUF stores the dimensions
        reversed.
      alignment: the data alignment (``general.alignment``).

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "t.gguf")
        >>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
        >>> write_gguf(p, {"general.architecture": "llama", "n": Typed("i32", [1, -2])}, [("x", "F32", (2, 3), x)])
        >>> f = open_gguf(p)
        >>> f.metadata["n"], f.tensors[0].shape, f.tensor_bytes(f.tensors[0]).view(np.float32).tolist()
        ([1, -2], (2, 3), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    """
    from pockjax.io.atomic import atomic_open

    header = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, value in metadata.items():
        raw = key.encode("utf-8")
        code, body = _value_bytes(value, key)
        header.append(struct.pack("<Q", len(raw)) + raw + struct.pack("<I", code) + body)
    offset, blobs = 0, []
    for name, type_name, shape, data in tensors:
        if type_name not in _TYPE_IDS:
            raise GGUFError(f"tensor {name!r}: unknown GGML type {type_name!r}")
        _, per_block, block_bytes = GGML_TYPES[_TYPE_IDS[type_name]]
        count = int(np.prod(shape))
        blob = np.ascontiguousarray(data).tobytes()
        if shape and shape[-1] % per_block or len(blob) != count // per_block * block_bytes:
            raise GGUFError(f"tensor {name!r}: {len(blob)} bytes do not hold a {type_name} tensor of"
                            f" shape {tuple(shape)}")
        raw = name.encode("utf-8")
        dims = tuple(int(d) for d in shape[::-1]) or (1,)
        header.append(struct.pack("<Q", len(raw)) + raw + struct.pack("<I", len(dims))
                      + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", _TYPE_IDS[type_name], offset))
        blobs.append(blob)
        offset += len(blob) + (-len(blob)) % alignment
    head = b"".join(header)
    with atomic_open(path, "wb") as f:
        f.write(head + b"\0" * ((-len(head)) % alignment))
        for blob in blobs:
            f.write(blob + b"\0" * ((-len(blob)) % alignment))

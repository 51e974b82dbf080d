"""A validated reader and an atomic writer of ``.safetensors`` files.

The format: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(an object mapping each tensor name to ``{"dtype", "shape", "data_offsets"}``
plus an optional ``"__metadata__"`` object of strings), then the data. The
reader checks everything the format promises before it maps a byte: the
header is a JSON object of objects, each dtype is known, each shape is a list
of non-negative integers, each ``data_offsets`` is two integers with
``0 <= begin <= end <= data size`` and ``end - begin`` equal to the tensor's
size, and the tensors tile the data without overlap or gaps. Any fault raises
:class:`~pockjax.errors.SafetensorsError` naming the file and the tensor.
Tensors are read-only numpy memory maps; nothing is executed from the file.

Example:
    >>> import os, tempfile, numpy as np
    >>> p = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> write_safetensors(p, {"w": np.eye(2, dtype=np.float32)})
    >>> read_safetensors(p)["w"].tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import numpy as np

from pockjax.errors import FileMissingError, SafetensorsError
from pockjax.io.atomic import atomic_open
from pockjax.io.jsonfile import loads_checked

__all__ = ["SAFETENSORS_DTYPES", "read_safetensors", "read_safetensors_header",
           "write_safetensors"]

#: safetensors dtype name -> numpy dtype name (BF16 through ml_dtypes).
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                      "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
                      "BOOL": "bool"}

# A header larger than this is not a real checkpoint (the reference reader's limit).
_MAX_HEADER = 100_000_000
_MAX_VALUES = 1 << 60  # values in one tensor (float64: 8 EiB), far above any real one


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # a JAX dependency

        return np.dtype(ml_dtypes.bfloat16)
    native = np.dtype(name)
    little = native.newbyteorder("<")
    return native if native == little else little  # the file is little-endian


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_safetensors_header(path: str | os.PathLike
                            ) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int, int]],
                                       dict[str, str], int]:
    """Reads and validates a safetensors header.

    Returns:
        ``(tensors, metadata, data_start)``: ``tensors`` maps each name to
        ``(dtype, shape, begin, end)`` with offsets relative to ``data_start``,
        the absolute offset of the data.

    Raises:
        FileMissingError: no such file.
        SafetensorsError: any fault in the header or a truncated file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileMissingError(f"safetensors file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path} is too short to be a safetensors file"
                                   f" ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size};"
                                   f" the file is truncated or not safetensors")
        if n > _MAX_HEADER:
            raise SafetensorsError(f"{path}: header length {n} is larger than {_MAX_HEADER}")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"{path}: the header is not UTF-8 ({e.reason} at byte"
                               f" {e.start})") from None
    # a tensor named twice (json keeps the last silently), NaN: a SafetensorsError naming the file
    header = loads_checked(text, f"{path}: the header", SafetensorsError, line_numbers=False)
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header must be a JSON object, not"
                               f" {type(header).__name__}")
    data_start, data_size = 8 + n, size - 8 - n
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError(f"{path}: __metadata__ must be an object of strings")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise SafetensorsError(f"{where}: its entry must be an object, not"
                                   f" {type(info).__name__}")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
        if missing:
            raise SafetensorsError(f"{where}: its entry lacks {', '.join(missing)}")
        extra = sorted(set(info) - {"dtype", "shape", "data_offsets"})
        if extra:
            raise SafetensorsError(f"{where}: its entry has unknown fields {extra}")
        dt = info["dtype"]
        if not isinstance(dt, str) or dt not in SAFETENSORS_DTYPES:
            raise SafetensorsError(f"{where}: dtype {dt!r} is not one of"
                                   f" {sorted(SAFETENSORS_DTYPES)}")
        shape = info["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise SafetensorsError(f"{where}: shape {shape!r} must be a list of"
                                   f" non-negative integers")
        offsets = info["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_int(o) for o in offsets)):
            raise SafetensorsError(f"{where}: data_offsets {offsets!r} must be two integers")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise SafetensorsError(f"{where}: data_offsets {offsets} must satisfy"
                                   f" 0 <= begin <= end")
        if end > data_size:
            raise SafetensorsError(f"{path} is truncated: tensor {name!r} ends at data byte"
                                   f" {end}, the file holds {data_size} data bytes")
        dtype = _numpy_dtype(SAFETENSORS_DTYPES[dt])
        count = nonzero = 1
        for d in shape:
            count *= d
            nonzero *= max(d, 1)
        if nonzero > _MAX_VALUES:  # (an array of this shape cannot exist, even with a 0 in it)
            raise SafetensorsError(f"{where}: shape {tuple(shape)} has more values than any array can"
                                   f" hold; the file is corrupt")
        if count * dtype.itemsize != end - begin:
            raise SafetensorsError(f"{where}: shape {tuple(shape)} of {dt} needs"
                                   f" {count * dtype.itemsize} bytes, data_offsets give"
                                   f" {end - begin}")
        tensors[name] = (dtype, tuple(shape), begin, end)
    # the tensors must tile the data: no overlap (two names for one byte) and no hole
    pos = 0
    for name, (_, _, begin, end) in sorted(tensors.items(), key=lambda kv: kv[1][2:]):
        if begin != pos:
            what = "overlaps the tensor before it" if begin < pos else "leaves a gap before it"
            raise SafetensorsError(f"{path}: tensor {name!r} at data bytes [{begin}, {end})"
                                   f" {what} (expected to start at {pos})")
        pos = end
    if pos != data_size:
        raise SafetensorsError(f"{path}: the tensors cover {pos} data bytes, the file holds"
                               f" {data_size}; the file is corrupt")
    return tensors, dict(metadata), data_start


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a ``.safetensors`` file as read-only numpy memory maps.

    Raises:
        FileMissingError: no such file.
        SafetensorsError: a malformed header or a truncated file (see the module doc).

    Example:
        >>> import os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "bad.safetensors")
        >>> with open(p, "wb") as f:
        ...     _ = f.write(struct.pack("<Q", 2) + b"[]")
        >>> read_safetensors(p)
        Traceback (most recent call last):
        ...
        pockjax.errors.SafetensorsError: ...bad.safetensors: the header must be a JSON object, not list
    """
    path = os.fspath(path)
    tensors, _, data_start = read_safetensors_header(path)
    out = {}
    for name, (dtype, shape, begin, end) in tensors.items():
        if begin == end:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin,
                                  shape=shape)
    return out


class LazyTensor:
    """A tensor :func:`write_safetensors` computes only when it writes it (one at a time).

    Attributes:
      shape, dtype: what ``fn()`` returns (checked).
      fn: computes the array.
    """

    def __init__(self, shape, dtype, fn):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = _little_endian(np.dtype(dtype))  # what the file stores
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.fn = fn

    def materialize(self) -> np.ndarray:
        a = _stored_form(self.fn())
        if a.shape != self.shape or a.dtype != self.dtype:
            raise ValueError(f"lazy tensor computed {a.dtype}{list(a.shape)}, declared"
                             f" {self.dtype}{list(self.shape)}")
        return a


def _little_endian(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


def _stored_form(x: Any) -> np.ndarray:
    """``x`` as the file stores it: C order, little-endian, its shape kept (a 0-d array stays 0-d,
    which ``np.ascontiguousarray`` would make 1-d)."""
    a = np.asarray(x)
    if a.dtype.byteorder == ">":
        a = a.astype(_little_endian(a.dtype))
    return a if a.flags.c_contiguous else np.array(a, order="C")


def write_safetensors(path: str | os.PathLike, tensors: dict[str, Any],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes numpy-convertible arrays to a ``.safetensors`` file, atomically and durably.

    A :class:`LazyTensor` value is computed only when its bytes are written,
    so a file larger than memory in float can be written from smaller forms.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> write_safetensors(p, {"b": np.ones(3, np.float16)})
        >>> read_safetensors(p)["b"].dtype
        dtype('float16')
    """
    names = {_numpy_dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:  # (str() would write None as "None")
            raise ValueError(f"safetensors metadata maps strings to strings; not {bad!r}")
        header["__metadata__"] = dict(metadata)
    arrays = []
    offset = 0
    for name in sorted(tensors):
        a = tensors[name]
        if not isinstance(name, str):
            raise ValueError(f"safetensors tensor names are strings; not {name!r}")
        if not isinstance(a, LazyTensor):
            # (each array takes its stored form only when written: the transposed views of a
            # model's matrices, copied all at once, were a second copy of the model)
            a = np.asarray(a)
        dtype = a.dtype if isinstance(a, LazyTensor) else _little_endian(a.dtype)
        dt = names.get(dtype)
        if dt is None or name == "__metadata__":
            raise ValueError(f"cannot store {name!r} of dtype {a.dtype} in safetensors")
        nbytes = math.prod(a.shape) * dtype.itemsize
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with atomic_open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            a = a.materialize() if isinstance(a, LazyTensor) else _stored_form(a)
            f.write(a.reshape(-1).view(np.uint8))

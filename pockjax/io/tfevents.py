"""TensorBoard event files of scalars, written and read without TensorFlow.

An event file (``events.out.tfevents.<time>.<host>``) is a sequence of
TFRecords, each framing one serialized ``tensorflow.Event`` protobuf::

    uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes
    payload (length bytes)        | uint32 masked CRC32C of the payload

with CRC32C the Castagnoli CRC and ``masked(c) = ((c >> 15 | c << 17) +
0xa282ead8) & 0xffffffff``. The first event holds ``file_version =
"brain.Event:2"``; each later one a step's scalars::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The protobufs are encoded by hand here (no protobuf or TensorFlow
dependency); :func:`read_events` is the reader the tests use, and the test
suite also reads the files with TensorBoard's own loader.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), events_file_name(1700000000, "host"))
    >>> write_events(path, [(1, {"train/loss": 2.5}), (2, {"train/loss": 2.0, "val/loss": 2.25})],
    ...              wall_time=1700000000.0)
    >>> os.path.basename(path)
    'events.out.tfevents.1700000000.host'
    >>> [(e["step"], e["scalars"]) for e in read_events(path)]
    [(0, {}), (1, {'train/loss': 2.5}), (2, {'train/loss': 2.0, 'val/loss': 2.25})]
    >>> read_events(path)[0]["file_version"]
    'brain.Event:2'
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Iterable, Mapping

from pockjax.errors import FileFormatError
from pockjax.io.atomic import write_bytes

__all__ = ["FILE_VERSION", "crc32c", "masked_crc32c", "events_file_name", "scalar_event",
           "version_event", "tfrecord", "encode_events", "write_events", "read_events"]

#: The ``file_version`` of the first event of every file.
FILE_VERSION = "brain.Event:2"
#: The prefix TensorBoard recognises event files by.
PREFIX = "events.out.tfevents."


def _crc_table() -> list[int]:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """The CRC32C (Castagnoli) of ``data``.

    Example:
        >>> hex(crc32c(b"123456789"))
        '0xe3069283'
    """
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The masked CRC32C that TFRecord framing stores.

    Example:
        >>> hex(masked_crc32c(b""))
        '0xa282ead8'
    """
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
    """``payload`` framed as one TFRecord (length, its CRC, payload, its CRC).

    Example:
        >>> len(tfrecord(b"abc"))
        19
    """
    header = struct.pack("<Q", len(payload))
    return (header + struct.pack("<I", masked_crc32c(header)) + payload
            + struct.pack("<I", masked_crc32c(payload)))


# -- protobuf wire format ---------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64: two's complement, 10 bytes
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int, rest: bytes) -> bytes:
    return _key(1, 1) + struct.pack("<d", float(wall_time)) + _key(2, 0) + _varint(int(step)) + rest


def version_event(wall_time: float) -> bytes:
    """The first ``Event`` of a file: ``file_version = "brain.Event:2"`` at step 0.

    Example:
        >>> version_event(0.0)[-len(FILE_VERSION):]
        b'brain.Event:2'
    """
    return _event(wall_time, 0, _bytes_field(3, FILE_VERSION.encode()))


def scalar_event(step: int, scalars: Mapping[str, float], wall_time: float) -> bytes:
    """One serialized ``Event`` holding ``scalars`` (``{tag: value}``, float32) at ``step``.

    Raises:
      ValueError: a tag is empty or not a string, or a value is not a real number.

    Example:
        >>> scalar_event(3, {"a": 1.0}, wall_time=0.0).hex()
        '09000000000000000010032a0a0a080a0161150000803f'
    """
    values = b""
    for tag, value in scalars.items():
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"a scalar's tag must be a non-empty string, got {tag!r}")
        try:
            if isinstance(value, (bool, str, bytes)):
                raise TypeError
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"the scalar {tag!r} must be a real number, got {value!r}") from None
        v = _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value)
        values += _bytes_field(1, v)
    return _event(wall_time, step, _bytes_field(5, values))


def encode_events(rows: Iterable[tuple[int, Mapping[str, float]]], *,
                  wall_time: float | Mapping[int, float] | None = None) -> bytes:
    """A whole event file's bytes: the version record, then one record per ``(step, scalars)`` row.

    Args:
      rows: ``(step, {tag: value})`` pairs, in step order.
      wall_time: Seconds since the epoch of every event, or ``{step: seconds}``
        (a step without one, and the version record, take the earliest given
        time), or None (now).

    Example:
        >>> data = encode_events([(1, {"loss": 2.0})], wall_time={1: 5.0})
        >>> len(data) == len(tfrecord(version_event(5.0))) + len(tfrecord(scalar_event(1, {"loss": 2.0}, 5.0)))
        True
    """
    rows = list(rows)
    if isinstance(wall_time, Mapping):
        times = dict(wall_time)
        first = min(times.values(), default=time.time())
    else:
        first = time.time() if wall_time is None else float(wall_time)
        times = {}
    out = bytearray(tfrecord(version_event(first)))
    for step, scalars in rows:
        out += tfrecord(scalar_event(step, scalars, times.get(step, first)))
    return bytes(out)


def events_file_name(wall_time: float | None = None, host: str | None = None) -> str:
    """``events.out.tfevents.<seconds>.<host>``, the name TensorBoard looks for.

    Example:
        >>> events_file_name(1700000000.7, "box")
        'events.out.tfevents.1700000000.box'
    """
    t = int(time.time() if wall_time is None else wall_time)
    host = host if host is not None else socket.gethostname() or "localhost"
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in host)
    return f"{PREFIX}{t:010d}.{host}"


def write_events(path: str | os.PathLike, rows: Iterable[tuple[int, Mapping[str, float]]], *,
                 wall_time: float | Mapping[int, float] | None = None) -> None:
    """Writes an event file of ``rows`` (see :func:`encode_events`) atomically and durably.

    Example: see the module docstring.
    """
    write_bytes(path, encode_events(rows, wall_time=wall_time))


# -- reading ---------------------------------------------------------------------------


def _read_varint(buf: bytes, pos: int, where: str) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(buf):
            raise FileFormatError(f"{where}: a protobuf varint runs past the end of its message")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7
        if shift > 63:
            raise FileFormatError(f"{where}: a protobuf varint is longer than 10 bytes")


def _fields(buf: bytes, where: str):
    """``(field, wire type, value)`` of each field of a protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos, where)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos, where)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _read_varint(buf, pos, where)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise FileFormatError(f"{where}: protobuf wire type {wire} (field {field}) is not supported")
        if pos > len(buf):
            raise FileFormatError(f"{where}: field {field} runs past the end of its message")
        yield field, wire, value


def _decode_event(payload: bytes, where: str) -> dict:
    event = {"wall_time": None, "step": 0, "file_version": None, "scalars": {}}
    for field, wire, value in _fields(payload, where):
        if field == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif field == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 3 and wire == 2:
            event["file_version"] = value.decode("utf-8", "replace")
        elif field == 5 and wire == 2:
            for f, w, v in _fields(value, where):
                if f != 1 or w != 2:
                    continue
                tag, simple = None, None
                for f2, w2, v2 in _fields(v, where):
                    if f2 == 1 and w2 == 2:
                        tag = v2.decode("utf-8", "replace")
                    elif f2 == 2 and w2 == 5:
                        simple = struct.unpack("<f", v2)[0]
                if tag is not None and simple is not None:
                    event["scalars"][tag] = simple
    return event


def read_events(path: str | os.PathLike) -> list[dict]:
    """The events of a file: ``{"wall_time", "step", "file_version", "scalars": {tag: value}}`` each.

    Checks every record's framing and both CRCs; reads the scalar summaries
    (``simple_value``) and skips other fields.

    Raises:
      FileFormatError: a truncated record or a CRC mismatch (naming the file
        and the record's byte offset), or a malformed protobuf.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "events.out.tfevents.0.x")
        >>> _ = open(path, "wb").write(encode_events([(7, {"a": 0.5})], wall_time=1.0)[:-1])
        >>> read_events(path)
        Traceback (most recent call last):
        ...
        pockjax.errors.FileFormatError: ...: record at byte 42: truncated, ...
    """
    with open(path, "rb") as f:
        data = f.read()
    events, pos = [], 0
    while pos < len(data):
        where = f"{path}: record at byte {pos}"
        if pos + 12 > len(data):
            raise FileFormatError(f"{where}: truncated header ({len(data) - pos} bytes)")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if crc != masked_crc32c(header):
            raise FileFormatError(f"{where}: the length's CRC does not match (a corrupt or non-TFRecord file)")
        end = pos + 12 + length + 4
        if end > len(data):
            raise FileFormatError(f"{where}: truncated, {length} payload bytes announced, the file ends first")
        payload = data[pos + 12:pos + 12 + length]
        (crc,) = struct.unpack("<I", data[end - 4:end])
        if crc != masked_crc32c(payload):
            raise FileFormatError(f"{where}: the payload's CRC does not match")
        events.append(_decode_event(payload, where))
        pos = end
    return events

"""Attacks on the file readers: mutated GGUF and safetensors headers and JSONL files.

Every example either loads, and then gives exactly what an independent reader
(llama.cpp's ``gguf`` package, the ``safetensors`` package, or the plain
format semantics) gives for the same bytes, or raises the reader's
``PockjaxError`` subclass. Any other exception, or different data, fails.
The runs are bounded and derandomized, so the suite stays fast and repeatable.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import struct
import tempfile

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pockjax.data import Example, alpaca_prompt, load_alpaca_jsonl
from pockjax.errors import DataError, GGUFError, PockjaxError, SafetensorsError
from pockjax.io.gguf import open_gguf
from pockjax.io.safetensors import read_safetensors

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

_WORKDIR = tempfile.mkdtemp(prefix="pockjax-fuzz-")
atexit.register(shutil.rmtree, _WORKDIR, True)


def _note(outcome: str) -> None:
    """Counts outcomes for ``--hypothesis-show-statistics`` (loaded vs each kind of rejection)."""
    from hypothesis import event
    from hypothesis.control import currently_in_test_context

    if currently_in_test_context():
        event(re.sub(r"'[^']*'|\d+", "_", outcome.split(": ", 1)[-1])[:48])


def _scratch(name: str, data: bytes) -> str:
    path = os.path.join(_WORKDIR, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


# -- GGUF ------------------------------------------------------------------------------


def _base_gguf() -> tuple[bytes, int]:
    """A small GGUF file with every kind of metadata and three tensor types."""
    path = os.path.join(_WORKDIR, "base.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_uint64("test.u64", 7)
    w.add_float32("test.f32", 0.5)
    w.add_bool("test.flag", True)
    w.add_array("test.tokens", ["a", "bc", "<|im_end|>"])
    w.add_array("test.ids", [1, 2, 3])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((2, 8)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal(4).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = open(path, "rb").read()
    return data, open_gguf(path).tensors[0].offset  # where the data section starts


GGUF_BYTES, GGUF_DATA_START = _base_gguf()


def _ours(path):
    f = open_gguf(path)
    return {k: v for k, v in f.metadata.items()}, [
        (t.name, t.shape, t.type_name, t.offset, t.n_bytes, f.tensor_bytes(t).tobytes())
        for t in f.tensors]


def _reference(path):
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, tuple(int(d) for d in reversed(list(t.shape))), t.tensor_type.name,
                int(t.data_offset), int(t.n_bytes),
                np.asarray(t.data).view(np.uint8).reshape(-1).tobytes()) for t in r.tensors]
    return meta, tensors


def _same_meta(a, b):
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, float) or isinstance(y, float):
            if not (np.float32(x) == np.float32(y) or (np.isnan(x) and np.isnan(y))):
                return False
        elif x != y:
            return False
    return True


def _check_gguf(data: bytes) -> None:
    path = _scratch("mutated.gguf", data)
    try:
        ours = _ours(path)
    except GGUFError as e:
        _note(f"rejected: {e}")
        return
    _note("loaded")
    if data == GGUF_BYTES:
        assert ours == _ours(_scratch("base.gguf", GGUF_BYTES))
    # loaded: llama.cpp's own reader must see exactly the same file
    ref = _reference(path)
    assert _same_meta(ours[0], ref[0])
    assert ours[1] == ref[1]


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, GGUF_DATA_START - 1), st.integers(0, 255)),
                      min_size=1, max_size=4))
def test_gguf_header_byte_edits(edits):
    data = bytearray(GGUF_BYTES)
    for pos, value in edits:
        data[pos] = value
    _check_gguf(bytes(data))


# the u32/u64 fields worth attacking: counts, lengths, dims, types, offsets
def _gguf_fields() -> list[tuple[int, int]]:
    out = []
    data = GGUF_BYTES
    pos = 8
    out += [(pos, 8), (pos + 8, 8)]  # tensor count, kv count
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def string(p):
        out.append((p, 8))
        (n,) = struct.unpack_from("<Q", data, p)
        return p + 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(p, vtype):
        if vtype in sizes:
            return p + sizes[vtype]
        if vtype == 8:
            return string(p)
        out.append((p, 4))
        out.append((p + 4, 8))
        etype, count = struct.unpack_from("<IQ", data, p)
        p += 12
        for _ in range(count):
            p = value(p, etype)
        return p

    for _ in range(n_kv):
        pos = string(pos)
        out.append((pos, 4))
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos = value(pos + 4, vtype)
    for _ in range(n_tensors):
        pos = string(pos)
        out.append((pos, 4))
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4
        for _ in range(n_dims):
            out.append((pos, 8))
            pos += 8
        out += [(pos, 4), (pos + 4, 8)]  # type, offset
        pos += 12
    return out


GGUF_FIELDS = _gguf_fields()
_BOUNDARY = st.sampled_from([0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 64, 255, 256, 2**31 - 1, 2**31,
                             2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1])


@FUZZ
@given(field=st.sampled_from(GGUF_FIELDS),
       value=st.one_of(_BOUNDARY, st.integers(0, 2**64 - 1)))
def test_gguf_header_field_values(field, value):
    pos, size = field
    value &= (1 << (8 * size)) - 1
    data = bytearray(GGUF_BYTES)
    data[pos:pos + size] = value.to_bytes(size, "little")
    _check_gguf(bytes(data))


@FUZZ
@given(cut=st.integers(0, len(GGUF_BYTES)))
def test_gguf_truncated_anywhere(cut):
    data = GGUF_BYTES[:cut]
    path = _scratch("cut.gguf", data)
    if cut == len(GGUF_BYTES):
        assert _ours(path) == _ours(_scratch("base.gguf", GGUF_BYTES))
        return
    try:
        ours = _ours(path)
    except GGUFError:
        return
    # only the padding after the last tensor may be missing
    assert cut >= max(t[3] + t[4] for t in ours[1])
    assert ours == _ours(_scratch("base.gguf", GGUF_BYTES))


# -- safetensors -------------------------------------------------------------------------


ST_TENSORS = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.array([-1, 2**40], np.int64),
    "c": np.arange(5, dtype=np.uint8),
    "d": np.zeros((0, 3), np.float16),
    "e": np.array([1.5, -2.25], np.float16),
}
_DTYPES = {"F32": np.float32, "I64": np.int64, "U8": np.uint8, "F16": np.float16,
           "F64": np.float64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
           "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}


def _st_layout():
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(ST_TENSORS):
        a = ST_TENSORS[name]
        header[name] = {"dtype": {np.float32: "F32", np.int64: "I64", np.uint8: "U8",
                                  np.float16: "F16"}[a.dtype.type],
                        "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    return header, b"".join(blobs)


ST_HEADER, ST_DATA = _st_layout()


def _st_file(header_bytes: bytes, data: bytes = ST_DATA) -> bytes:
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data


def _plain_decode(header, data):
    """The format's meaning, stated plainly: used only after the reader accepted the file."""
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(data[begin:end], dtype).reshape(info["shape"])
    return out


def _check_safetensors(raw: bytes, original: bool = False) -> None:
    path = _scratch("mutated.safetensors", raw)
    try:
        got = {k: np.array(v) for k, v in read_safetensors(path).items()}
    except SafetensorsError as e:
        _note(f"rejected: {e}")
        assert not original
        return
    _note("loaded")
    n = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + n])
    expected = _plain_decode(header, raw[8 + n:])
    assert got.keys() == expected.keys()
    for k in got:
        assert got[k].dtype == expected[k].dtype and got[k].shape == expected[k].shape
        assert got[k].tobytes() == expected[k].tobytes()
    if original:
        for k, v in ST_TENSORS.items():
            np.testing.assert_array_equal(got[k], v)
    # and the reference implementation reads the same file the same way
    from safetensors.numpy import load_file

    ref = load_file(path)
    assert ref.keys() == got.keys()
    for k in got:
        assert ref[k].tobytes() == got[k].tobytes() and ref[k].shape == got[k].shape


_JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), _BOUNDARY,
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(list(_DTYPES) + ["BF16",
                                                                                         "Q4", ""]),
    st.text(max_size=5))
_JSON = st.recursive(_JSON_SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=4), kids, max_size=3)),
    max_leaves=8)
_OFFSETS = st.lists(st.one_of(st.integers(-64, 128), _BOUNDARY, _JSON_SCALARS), max_size=3)


@st.composite
def _mutated_header(draw):
    header = json.loads(json.dumps(ST_HEADER))
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["field", "drop", "extra", "entry", "whole", "offsets",
                                   "shape", "dtype", "metadata", "rename"]))
        name = draw(st.sampled_from(names))
        if name not in header:
            continue
        entry = header[name]
        if op == "field" and isinstance(entry, dict):
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(_JSON)
        elif op == "drop" and isinstance(entry, dict):
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif op == "extra" and isinstance(entry, dict):
            entry[draw(st.text(max_size=4))] = draw(_JSON)
        elif op == "entry":
            header[name] = draw(_JSON)
        elif op == "whole":
            return draw(_JSON)
        elif op == "offsets" and isinstance(entry, dict):
            entry["data_offsets"] = draw(_OFFSETS)
        elif op == "shape" and isinstance(entry, dict):
            entry["shape"] = draw(st.lists(st.one_of(st.integers(-3, 8), _BOUNDARY), max_size=4))
        elif op == "dtype" and isinstance(entry, dict):
            entry["dtype"] = draw(st.sampled_from(list(_DTYPES) + ["BF16", "f32", "Q4"]))
        elif op == "metadata":
            header["__metadata__"] = draw(_JSON)
        elif op == "rename":
            header[draw(st.text(max_size=4))] = header.pop(name)
    return header


@FUZZ
@given(header=_mutated_header())
def test_safetensors_structured_header_mutations(header):
    raw = _st_file(json.dumps(header).encode())
    try:
        _check_safetensors(raw, original=(header == ST_HEADER))
    except SafetensorsError:  # pragma: no cover - _check_safetensors catches it
        raise


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 8 + len(json.dumps(ST_HEADER)) - 1),
                                st.integers(0, 255)), min_size=1, max_size=4))
def test_safetensors_header_byte_edits(edits):
    raw = bytearray(_st_file(json.dumps(ST_HEADER).encode()))
    for pos, value in edits:
        raw[pos] = value
    _check_safetensors(bytes(raw), original=bytes(raw) == _st_file(json.dumps(ST_HEADER).encode()))


@FUZZ
@given(cut=st.integers(0, len(_st_file(json.dumps(ST_HEADER).encode())) - 1))
def test_safetensors_truncated_anywhere(cut):
    raw = _st_file(json.dumps(ST_HEADER).encode())[:cut]
    with pytest.raises(SafetensorsError):
        read_safetensors(_scratch("cut.safetensors", raw))


# -- JSONL -------------------------------------------------------------------------------


_RECORD = st.fixed_dictionaries(
    {"instruction": st.text(min_size=1, max_size=12).filter(str.strip),
     "output": st.text(min_size=1, max_size=12).filter(str.strip)},
    optional={"input": st.one_of(st.none(), st.text(max_size=12))})


def _expected_examples(text: str) -> list[Example]:
    out = []
    for line in text.split("\n"):
        if line.strip():
            r = json.loads(line)
            out.append(Example(alpaca_prompt(r["instruction"], r.get("input") or ""),
                               r["output"], "jsonl"))  # text as written
    return out


@FUZZ
@given(records=st.lists(_RECORD, min_size=1, max_size=5),
       edits=st.lists(st.tuples(st.integers(0, 10_000), st.binary(min_size=0, max_size=3)),
                      max_size=3),
       cut=st.one_of(st.none(), st.integers(0, 10_000)))
def test_jsonl_mutations(records, edits, cut):
    clean = "\n".join(json.dumps(r, ensure_ascii=bool(len(r) % 2)) for r in records) + "\n"
    raw = bytearray(clean.encode("utf-8"))
    for pos, patch in edits:
        pos %= len(raw) + 1
        raw[pos:pos + len(patch)] = patch
    if cut is not None:
        raw = raw[:cut % (len(raw) + 1)]
    path = _scratch("mutated.jsonl", bytes(raw))
    try:
        got = load_alpaca_jsonl(path)
    except DataError as e:
        _note(f"rejected: {e}")
        assert "mutated.jsonl" in str(e)
        assert bytes(raw) != clean.encode("utf-8")
        return
    _note("loaded")
    text = bytes(raw).decode("utf-8-sig")
    assert got == _expected_examples(text)
    if bytes(raw) == clean.encode("utf-8"):
        assert got == _expected_examples(clean)


def test_fuzz_base_files_load():
    """The unmutated inputs load and equal what was written (the oracle's anchor)."""
    _check_gguf(GGUF_BYTES)
    _check_safetensors(_st_file(json.dumps(ST_HEADER).encode()), original=True)
    assert isinstance(PockjaxError, type)

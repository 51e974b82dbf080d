"""TensorBoard event files: pockjax's writer checked by TensorBoard's own reader, and finetune's tb/ output."""

import os
import struct

import pytest
from flax import nnx

from pockjax.errors import FileFormatError
from pockjax.io.tfevents import (FILE_VERSION, crc32c, encode_events, masked_crc32c, read_events,
                                 write_events)
from pockjax.models import llama
from pockjax.train import FinetuneConfig, finetune

TINY = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256)


def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(bytes(range(32))) == 0x46DD794E  # RFC 3720 B.4: 0x00 .. 0x1f
    c = crc32c(b"123456789")
    assert masked_crc32c(b"123456789") == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _tensorboard_scalars(path):
    """``[(step, {tag: value})]`` read by TensorBoard's event file loader (protobuf), and the file version."""
    # installed by `make test` (the test extras): a missing loader fails, it does not skip
    from tensorboard.backend.event_processing import event_file_loader as loader
    events = list(loader.LegacyEventFileLoader(str(path)).Load())
    version = events[0].file_version
    rows = [(e.step, {v.tag: v.simple_value for v in e.summary.value}) for e in events[1:]]
    return version, rows, [e.wall_time for e in events]


def test_tensorboard_reads_what_we_write(tmp_path):
    rows = [(1, {"train/loss": 2.5, "train/lr": 0.0625}), (2, {"train/loss": 2.25, "val/loss": 3.0}),
            (10**12, {"x": -1.5})]  # a step beyond 32 bits
    path = tmp_path / "events.out.tfevents.1.test"
    write_events(path, rows, wall_time={1: 100.5, 2: 101.25, 10**12: 102.0})
    version, got, times = _tensorboard_scalars(path)
    assert version == FILE_VERSION
    assert got == rows  # float32 values chosen exact
    assert times == [100.5, 100.5, 101.25, 102.0]
    ours = read_events(path)
    assert [(e["step"], e["scalars"]) for e in ours[1:]] == rows and ours[0]["file_version"] == FILE_VERSION


def test_corrupt_files_are_named(tmp_path):
    data = encode_events([(1, {"a": 1.0}), (2, {"a": 2.0})], wall_time=0.0)
    path = tmp_path / "events.out.tfevents.1.bad"
    flipped = bytearray(data)
    flipped[-6] ^= 1  # in the last record's payload
    path.write_bytes(bytes(flipped))
    first = len(data) - len(encode_events([(2, {"a": 2.0})], wall_time=0.0)) + len(encode_events([], wall_time=0.0))
    with pytest.raises(FileFormatError, match=f"record at byte {first}: the payload's CRC"):
        read_events(path)
    path.write_bytes(data[:-3])
    with pytest.raises(FileFormatError, match="truncated"):
        read_events(path)
    path.write_bytes(struct.pack("<Q", 5) + b"\0\0\0\0" + b"hello\0\0\0\0")
    with pytest.raises(FileFormatError, match="length's CRC"):
        read_events(path)
    with pytest.raises(ValueError, match="must be a real number"):
        encode_events([(1, {"a": "high"})])


def _csv(out):
    lines = open(os.path.join(out, "metrics.csv")).read().split()[1:]
    return [(int(s), float(loss), float(lr), float(v) if v else None)
            for s, loss, lr, v in (line.split(",") for line in lines)]


@pytest.mark.slow  # about 20 s on a 2-core CPU: two runs
def test_finetune_writes_tensorboard_and_resume_adds_a_file(tmp_path):
    """tb/ holds metrics.csv's curves (TensorBoard's reader agrees); a resumed run appends a new file."""
    tok = llama.Tokenizer.byte_level_for_tests()
    out = str(tmp_path / "run")
    base = dict(task="uppercase", steps=4, batch_size=2, train_examples=16, eval_examples=1, eval_max_new_tokens=2,
                save_every=2, show=0, progress=False, blocks=1, eval_every=2, schedule="linear", out=out)

    def crash(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(FinetuneConfig(**base), model=llama.Llama(TINY, rngs=nnx.Rngs(0)), tokenizer=tok,
                 log=lambda s: None, on_step=crash)
    (first,) = os.listdir(os.path.join(out, "tb"))
    assert first.startswith("events.out.tfevents.")
    before = open(os.path.join(out, "tb", first), "rb").read()
    finetune(FinetuneConfig(**base, resume=True), log=lambda s: None)
    files = sorted(os.listdir(os.path.join(out, "tb")))
    assert len(files) == 2 and files[0] == first  # name order is run order
    assert open(os.path.join(out, "tb", first), "rb").read() == before  # the first run's file is kept as is
    seen = []
    for name in files:
        version, rows, times = _tensorboard_scalars(os.path.join(out, "tb", name))
        assert version == FILE_VERSION and times == sorted(times)
        seen.append(rows)
    assert [[s for s, _ in rows] for rows in seen] == [[1, 2], [3, 4]]
    expected = _csv(out)
    assert [s for s, *_ in expected] == [1, 2, 3, 4]
    for (step, scalars), (s, loss, lr, val) in zip(seen[0] + seen[1], expected):
        assert step == s
        assert scalars.keys() == ({"train/loss", "train/lr"} | ({"val/loss"} if val is not None else set()))
        assert scalars["train/loss"] == pytest.approx(loss, rel=1e-6)
        assert scalars["train/lr"] == pytest.approx(lr, rel=1e-6)
        if val is not None:
            assert scalars["val/loss"] == pytest.approx(val, rel=1e-6)
    assert [lr for _, _, lr, _ in expected] == sorted((lr for _, _, lr, _ in expected), reverse=True)  # linear decay

"""The safe PyTorch checkpoint reader: same tensors as torch.load, refuses anything else."""

from __future__ import annotations

import os
import pickle
import struct
import zipfile

import numpy as np
import pytest

from pockjax.errors import CheckpointError, FileMissingError
from pockjax.io.torch_checkpoint import TorchCheckpointError, read_torch_checkpoint

torch = pytest.importorskip("torch")


def _weights() -> str:
    from pockjax.models.mobilenetv2.pretrained import pretrained_path

    return pretrained_path()  # installed by make setup: missing fails the test


def _assert_same(ours: dict, ref: dict) -> None:
    assert list(ours) == list(ref)
    for k, t in ref.items():
        t = t.detach()
        want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        got = ours[k].astype(np.float32) if t.dtype == torch.bfloat16 else ours[k]
        assert got.dtype == want.dtype, k
        assert got.shape == want.shape, k
        np.testing.assert_array_equal(got, want, err_msg=k)


def test_reads_torchvision_checkpoint_like_torch_load():
    path = _weights()  # torchvision's legacy (pre-zip) torch.save format
    ours = read_torch_checkpoint(path)
    _assert_same(ours, torch.load(path, map_location="cpu", weights_only=True))
    assert ours["features.0.0.weight"].shape == (32, 3, 3, 3)
    assert ours["features.0.0.weight"].flags.c_contiguous


def test_reads_zip_format_like_torch_load(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = torch.arange(10, dtype=torch.int64)
    sd = {
        "f32": torch.randn(3, 5),
        "transposed": base.t(),                 # strides (1, 6)
        "sliced": shared[3:7],                  # offset 3 into a shared storage
        "shared": shared,
        "f16": torch.randn(4).half(),
        "bf16": torch.randn(4).bfloat16(),
        "f64": torch.randn(2, 2).double(),
        "i32": torch.tensor([1, -2], dtype=torch.int32),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    path = tmp_path / "sd.pth"
    torch.save(sd, path)
    assert zipfile.is_zipfile(path)
    _assert_same(read_torch_checkpoint(path), torch.load(path, weights_only=True))


# -- crafted and broken files ---------------------------------------------------------


class _Evil:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _rewrite_zip(src, dst, replace: dict) -> None:
    """Copies a zip, replacing members (bytes) or dropping them (None)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            key = info.filename.split("/", 1)[1]
            if key in replace:
                if replace[key] is not None:
                    zout.writestr(info.filename, replace[key])
            else:
                zout.writestr(info.filename, zin.read(info.filename))


def _zip_members(path) -> dict:
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


@pytest.fixture()
def small_zip(tmp_path):
    path = tmp_path / "small.pth"
    torch.save({"w": torch.ones(2, 3), "b": torch.arange(2)}, path)
    return path


def test_refuses_os_system_in_zip_pickle(tmp_path, small_zip):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pth"
    payload = pickle.dumps({"w": _Evil(f"touch {marker}")}, protocol=2)
    _rewrite_zip(small_zip, bad, {"data.pkl": payload})
    with pytest.raises(TorchCheckpointError, match=r"evil\.pth.*global (posix|os)\.system"):
        read_torch_checkpoint(bad)
    assert not marker.exists()


def test_refuses_os_system_in_legacy_stream(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil_legacy.pth"
    with open(bad, "wb") as f:
        for obj in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
            pickle.dump(obj, f, protocol=2)
        pickle.dump({"w": _Evil(f"touch {marker}")}, f, protocol=2)
    with pytest.raises(TorchCheckpointError, match=r"evil_legacy\.pth: state dict: .*system"):
        read_torch_checkpoint(bad)
    assert not marker.exists()
    # in place of the magic number: not even the first pickle may name a global
    with open(bad, "wb") as f:
        pickle.dump(_Evil(f"touch {marker}"), f, protocol=2)
    with pytest.raises(TorchCheckpointError, match="not a PyTorch checkpoint"):
        read_torch_checkpoint(bad)
    assert not marker.exists()


def test_refuses_build_and_non_tensor_values(tmp_path, small_zip):
    bad = tmp_path / "odd.pth"
    _rewrite_zip(small_zip, bad, {"data.pkl": pickle.dumps({"w": [1, 2]}, protocol=2)})
    with pytest.raises(TorchCheckpointError, match=r"'w' holds a list, not a tensor"):
        read_torch_checkpoint(bad)
    _rewrite_zip(small_zip, bad, {"data.pkl": pickle.dumps([1], protocol=2)})
    with pytest.raises(TorchCheckpointError, match="holds a list, not a state dict"):
        read_torch_checkpoint(bad)


def test_truncated_zip(tmp_path, small_zip):
    data = small_zip.read_bytes()
    bad = tmp_path / "cut.pth"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(TorchCheckpointError, match=r"cut\.pth: a truncated or corrupt zip"):
        read_torch_checkpoint(bad)


def test_missing_and_short_storage(tmp_path, small_zip):
    members = _zip_members(small_zip)
    keys = sorted(k for k in members if k.startswith("data/"))
    bad = tmp_path / "nostorage.pth"
    _rewrite_zip(small_zip, bad, {keys[0]: None})
    with pytest.raises(TorchCheckpointError, match=r"storage '\w+' is missing"):
        read_torch_checkpoint(bad)
    _rewrite_zip(small_zip, bad, {keys[0]: members[keys[0]][:-1]})
    with pytest.raises(TorchCheckpointError, match=r"needs \d+ bytes, member .* holds \d+"):
        read_torch_checkpoint(bad)


def test_tensor_outside_its_storage(tmp_path):
    src = tmp_path / "one.pth"
    torch.save({"b": torch.arange(2)}, src)
    pkl = _zip_members(src)["data.pkl"]
    # offset 0 -> 1 with size (2,): past the storage's 2 elements
    assert pkl.count(b"K\x00K\x02\x85") == 1
    bad = tmp_path / "outside.pth"
    _rewrite_zip(src, bad, {"data.pkl": pkl.replace(b"K\x00K\x02\x85", b"K\x01K\x02\x85")})
    with pytest.raises(TorchCheckpointError, match=r"'b': size \(2,\) .* at offset 1 reaches element 2, its storage holds 2"):
        read_torch_checkpoint(bad)


def test_broadcast_view_is_refused(tmp_path):
    path = tmp_path / "expanded.pth"
    torch.save({"e": torch.ones(3).expand(1000, 3)}, path)  # stride (0, 1) over 3 elements
    with pytest.raises(TorchCheckpointError, match=r"'e': size \(1000, 3\) has 3000 elements,"
                                                   r" more than its storage's 3"):
        read_torch_checkpoint(path)


def test_not_a_checkpoint_and_missing_file(tmp_path):
    bad = tmp_path / "noise.pth"
    bad.write_bytes(os.urandom(64))
    with pytest.raises(TorchCheckpointError, match=r"noise\.pth: not a PyTorch checkpoint"):
        read_torch_checkpoint(bad)
    with pytest.raises(FileMissingError, match="not found"):
        read_torch_checkpoint(tmp_path / "absent.pth")
    assert issubclass(TorchCheckpointError, CheckpointError)


def test_truncated_legacy_checkpoint(tmp_path):
    data = open(_weights(), "rb").read()
    bad = tmp_path / "cut_legacy.pth"
    bad.write_bytes(data[:-100])
    with pytest.raises(TorchCheckpointError, match=r"cut_legacy\.pth is truncated: storage"):
        read_torch_checkpoint(bad)
    bad.write_bytes(data + struct.pack("<q", 0))
    with pytest.raises(TorchCheckpointError, match="8 bytes after the last storage"):
        read_torch_checkpoint(bad)

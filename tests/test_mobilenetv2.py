"""MobileNetV2: torchvision parity (eval and train mode), heads, loading errors, schemes.

torchvision runs in a subprocess (benchmarks.harness.torchvision_ref): it is
imported from outside the venv with stub operator schemas, which must never
meet ``transformers`` in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pockjax
from pockjax.errors import CheckpointError, FileMissingError
from pockjax.models import mobilenetv2 as mnv2
from pockjax.models.mobilenetv2 import (
    MobileNetV2,
    MobileNetV2Config,
    load_pretrained,
    normalize,
    replace_head,
)
from pockjax.scheme import ChannelSelect, Frozen, Full
from pockjax.schemes import get_scheme, scheme_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _weights() -> str:
    return mnv2.pretrained_path()  # installed by make setup: missing fails the test


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """Two seeded 224x224 RGB images, normalised, NHWC float32."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(2, 224, 224, 3), dtype=np.uint8)
    return np.asarray(normalize(raw))


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> dict:
    """torchvision's outputs on ``images``, from one subprocess."""
    from benchmarks.harness.torchvision_ref import torchvision_ref_dir

    weights = _weights()
    # the reference is part of `make test`: a missing install fails, it does not skip
    assert os.path.isdir(os.path.join(torchvision_ref_dir(), "torchvision")), (
        f"torchvision is not installed in {torchvision_ref_dir()}; run make setup")
    d = tmp_path_factory.mktemp("tvref")
    np.save(d / "x.npy", images.transpose(0, 3, 1, 2))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.harness.torchvision_ref",
                           "--inputs", str(d / "x.npy"), "--out", str(d / "ref.npz"),
                           "--weights", weights],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(d / "ref.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def model() -> MobileNetV2:
    _weights()
    return load_pretrained()


def _forward(m, x):
    return m(x)


_jit_forward = nnx.jit(_forward)


def _stats(m) -> dict[str, np.ndarray]:
    state = nnx.state(m, nnx.BatchStat)
    return {p: np.asarray(v) for p, v in zip(pockjax.leaf_paths(state), jax.tree.leaves(state))}


def test_eval_logits_match_torchvision(model, images, reference):
    logits = np.asarray(_jit_forward(model, images))
    ref = reference["eval_logits"]
    assert logits.shape == (2, 1000)
    diff = float(np.abs(logits - ref).max())
    assert diff <= 1e-3, diff
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))
    # eval mode is deterministic (running statistics, no dropout)
    np.testing.assert_array_equal(np.asarray(_jit_forward(model, images)), logits)


def test_train_mode_updates_running_stats_like_torch(model, images, reference):
    m = nnx.clone(model)
    before = _stats(m)
    m.train()
    assert m.dropout.deterministic is False and m.stem.norm.use_running_average is False
    m.dropout.deterministic = True  # torch's reference ran with dropout off
    logits = np.asarray(_jit_forward(m, images))
    np.testing.assert_allclose(logits, reference["train_logits"], atol=1e-3, rtol=0)
    after = _stats(m)
    mapping = [(t, p) for t, p, _ in mnv2.torch_to_pockjax(m.config)
               if t.endswith(("running_mean", "running_var"))]
    assert len(mapping) == 2 * 52
    for tname, path in mapping:
        module, stat = tname.rsplit(".", 1)
        assert not np.array_equal(after[path], before[path]), path
        np.testing.assert_allclose(after[path], reference[f"{stat}/{module}"], rtol=1e-4,
                                   atol=1e-5, err_msg=path)
    # back in eval mode: running statistics again, and they are the updated ones
    m.eval()
    assert m.stem.norm.use_running_average is True and m.dropout.deterministic is True


def test_replace_head_and_num_classes(model, images):
    m = load_pretrained(num_classes=7, rngs=nnx.Rngs(3))
    assert m.config.num_classes == 7 and m.head.kernel.shape == (1280, 7)
    # the backbone is ImageNet's
    np.testing.assert_array_equal(np.asarray(m.last.conv.kernel[...]),
                                  np.asarray(model.last.conv.kernel[...]))
    logits = _jit_forward(m, images[:1])
    assert logits.shape == (1, 7)
    replace_head(m, 4, rngs=nnx.Rngs(0))
    assert m.head.kernel.shape == (1280, 4) and m.config.num_classes == 4
    with pytest.raises(ValueError, match="positive int"):
        replace_head(m, 0, rngs=nnx.Rngs(0))


def test_wrong_checkpoint_gives_clear_errors(tmp_path):
    path = _weights()
    from pockjax.io.torch_checkpoint import read_torch_checkpoint

    sd = read_torch_checkpoint(path)
    abstract = lambda: nnx.eval_shape(lambda: MobileNetV2(MobileNetV2Config(), rngs=nnx.Rngs(0)))  # noqa: E731

    missing = {k: v for k, v in sd.items() if k != "features.5.conv.1.0.weight"}
    with pytest.raises(CheckpointError, match=r"src: tensor 'features.5.conv.1.0.weight' \(for"
                                              r" blocks.4.depthwise.conv.kernel\) is missing"):
        mnv2.load_torch_state_dict(abstract(), missing, source="src")
    wrong = dict(sd, **{"classifier.1.weight": np.zeros((1000, 1000), np.float32)})
    with pytest.raises(CheckpointError, match=r"'classifier.1.weight' has shape \(1000, 1000\),"
                                              r" the model's head.kernel needs \(1000, 1280\)"):
        mnv2.load_torch_state_dict(abstract(), wrong, source="src")
    extra = dict(sd, **{"features.19.0.weight": np.zeros((1,), np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['features.19.0.weight'\]"):
        mnv2.load_torch_state_dict(abstract(), extra, source="src")
    # end to end, through a file torch wrote
    torch = pytest.importorskip("torch")
    bad = tmp_path / "missing.pth"
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in missing.items()}, bad)
    with pytest.raises(CheckpointError, match=r"missing\.pth: tensor 'features.5.conv.1.0.weight'"):
        load_pretrained(bad)
    with pytest.raises(FileMissingError, match="not found"):
        load_pretrained(tmp_path / "absent.pth")


def test_missing_weights_package_says_make_setup(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileMissingError, match="make setup"):
        mnv2.pretrained_path()


def test_architecture_and_paths():
    cfg = MobileNetV2Config()
    m = nnx.eval_shape(lambda: MobileNetV2(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(m, nnx.Param)
    shapes = dict(zip(pockjax.leaf_paths(params), (v.shape for v in jax.tree.leaves(params))))
    assert len(shapes) == 158
    assert sum(int(np.prod(s)) for s in shapes.values()) == 3_504_872  # torchvision's count
    assert shapes["stem.conv.kernel"] == (3, 3, 3, 32)
    assert shapes["blocks.0.depthwise.conv.kernel"] == (3, 3, 1, 32)
    assert "blocks.0.expand.conv.kernel" not in shapes
    assert shapes["blocks.1.expand.conv.kernel"] == (1, 1, 16, 96)
    assert shapes["blocks.16.project.conv.kernel"] == (1, 1, 960, 320)
    assert shapes["last.conv.kernel"] == (1, 1, 320, 1280)
    assert shapes["head.kernel"] == (1280, 1000) and shapes["head.bias"] == (1000,)
    # every 3x3 conv pads one pixel each side, like torch (not "SAME")
    assert m.blocks[1].depthwise.conv.pad == 1 and m.stem.conv.pad == 1
    assert m.stem.conv.stride == 2 and m.blocks[1].depthwise.conv.groups == 96
    assert m.stem.norm.momentum == 0.9 and m.stem.norm.epsilon == 1e-5


@pytest.mark.parametrize("train", [False, True])
def test_both_conv_lowerings_compute_the_same_model(train):
    # "matmul" (the default: 1x1 as matmuls, depth-wise as shifted multiply-adds)
    # against XLA convolutions throughout, with the same weights; five blocks (one
    # without an expand conv, strided ones, residual ones) and one compiled forward each
    small = dict(width_mult=0.35, num_classes=7,
                 inverted_residual_setting=((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2)))
    a = MobileNetV2(MobileNetV2Config(**small), rngs=nnx.Rngs(3))
    b = MobileNetV2(MobileNetV2Config(conv_lowering="conv", **small), rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 32, 32, 3)), jnp.float32)
    if train:
        a.train(), b.train()
        for m in (a, b):
            m.dropout.deterministic = True
    forward = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(np.asarray(forward(a, x)), np.asarray(forward(b, x)), atol=1e-4, rtol=1e-4)
    if train:  # the running statistics moved alike
        np.testing.assert_allclose(np.asarray(a.blocks[3].depthwise.norm.var[...]),
                                   np.asarray(b.blocks[3].depthwise.norm.var[...]), rtol=1e-4, atol=1e-6)
        assert not np.allclose(np.asarray(a.blocks[3].depthwise.norm.var[...]), 1.0)  # from their initial 1


def test_unknown_conv_lowering_is_refused():
    with pytest.raises(ValueError, match="conv_lowering must be one of"):
        MobileNetV2Config(conv_lowering="winograd")


# -- schemes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    m = nnx.eval_shape(lambda: MobileNetV2(MobileNetV2Config(), rngs=nnx.Rngs(0)))
    return nnx.state(m, nnx.Param)


def _selected(name: str, params, **kw) -> dict:
    scheme = get_scheme(name, MobileNetV2Config(), **kw)
    out = {}
    for path, res in zip(pockjax.leaf_paths(params), scheme.resolve_tree(params)):
        if not isinstance(res, Frozen):
            out[path] = res
    return out


def test_schemes_registered():
    assert set(scheme_names("mobilenetv2")) == {"full", "norm-only", "paper", "channels",
                                                 "bias-only", "last-blocks", "head-only"}


def test_paper_scheme_selects_expected_tensors(params):
    paths = pockjax.leaf_paths(params)
    biases = {p for p in paths if p.endswith(".norm.bias")}
    assert len(biases) == 52
    head = {"head.kernel", "head.bias"}
    expand = {f"blocks.{i}.expand.conv.kernel" for i in range(7, 17)}
    # the biases of the trained blocks only (and of the last conv): the backward
    # pass stops at blocks.7
    late = {p for p in biases if p.startswith("last.")
            or p.startswith("blocks.") and int(p.split(".")[1]) >= 7}
    assert len(late) == 31
    sel = _selected("paper", params)
    assert set(sel) == expand | late | head
    assert all(isinstance(r, Full) for r in sel.values())
    assert get_scheme("paper", MobileNetV2Config()).name == "paper (last 10 blocks)"
    last2 = {p for p in biases if p.startswith(("blocks.15.", "blocks.16.", "last."))}
    assert set(_selected("paper", params, blocks=2)) == {
        "blocks.15.expand.conv.kernel", "blocks.16.expand.conv.kernel"} | last2 | head
    # every block: the 16 with an expand conv
    assert len([p for p in _selected("paper", params, blocks=17) if p.endswith("expand.conv.kernel")]) == 16


def test_other_schemes(params):
    paths = pockjax.leaf_paths(params)
    biases = {p for p in paths if p.endswith(".norm.bias")}
    head = {"head.kernel", "head.bias"}
    sel = _selected("channels", params, fraction=0.25)
    assert set(sel) == set(_selected("paper", params))
    k = sel["blocks.16.expand.conv.kernel"]
    assert isinstance(k, ChannelSelect) and k.axis == 3 and k.size == 960 and k.count == 240
    assert set(_selected("bias-only", params)) == biases | head
    assert set(_selected("head-only", params)) == head
    last = _selected("last-blocks", params, blocks=2)
    assert set(last) == {p for p in paths if p.startswith(("blocks.15.", "blocks.16.", "last."))} | head
    norms = _selected("norm-only", params)  # every BatchNorm scale and bias
    assert set(norms) == {p for p in paths if ".norm." in p} and len(norms) == 104
    assert len(_selected("full", params)) == len(paths)


def test_scheme_trains_with_nnx_optimizer_filter(params):
    # the scheme's NNX filter picks exactly the selected Param variables
    m = nnx.eval_shape(lambda: MobileNetV2(MobileNetV2Config(), rngs=nnx.Rngs(0)))
    wrt = get_scheme("paper", MobileNetV2Config()).nnx_wrt()
    chosen = pockjax.leaf_paths(nnx.state(m, wrt))
    assert set(chosen) == set(_selected("paper", params))

"""Classifier fine-tuning (pockjax/train/classify.py): MobileNetV2 and BERT through pockjax.compile.

Small random models (no weight loading) for the step's guarantees; the CLI runs
on the real pretrained weights and shipped data at a tiny budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax.models.bert import BertClassifier, BertConfig
from pockjax.models.mobilenetv2 import MobileNetV2, MobileNetV2Config
from pockjax.schemes import get_scheme
from pockjax.train.classify import classify_train_step, evaluate_classifier, train_classifier

# five blocks (the first without an expand conv), so that each step compiles in seconds
SMALL = MobileNetV2Config(width_mult=0.5, num_classes=5, dropout=0.0,
                          inverted_residual_setting=((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2)))


def _images(n=6, size=32, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(n, size, size, 3)), jnp.float32),
            jnp.asarray(np.arange(n) % 5, jnp.int32))


def _flat(tree):
    return dict(zip(pockjax.leaf_paths(tree), (np.asarray(x) for x in jax.tree.leaves(tree))))


@pytest.fixture(scope="module")
def plain_forward_statistics():
    """Images, labels, and the BatchNorm statistics of the initial model before and after
    one plain train-mode forward on them (shared by the schemes' tests)."""
    x, y = _images()
    twin = MobileNetV2(SMALL, rngs=nnx.Rngs(0))
    before = _flat(nnx.state(twin, nnx.BatchStat))
    twin.train()
    # the statistics one train-mode forward gives (the update does not change them); a
    # jitted forward, since op-by-op dispatch of the whole forward takes longer
    nnx.jit(lambda m, x: m(x))(twin, x)
    return x, y, before, _flat(nnx.state(twin, nnx.BatchStat))


@pytest.mark.parametrize("name", ["paper", "channels", "head-only", "bias-only"])
def test_batchnorm_statistics_update_under_every_scheme(name, plain_forward_statistics):
    # Running statistics are state the step does not differentiate: they move in
    # train mode whatever the scheme trains, exactly as a plain forward moves them.
    x, y, before, want = plain_forward_statistics
    model = MobileNetV2(SMALL, rngs=nnx.Rngs(0))
    model.train()
    scheme = get_scheme(name, SMALL)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=scheme.nnx_wrt())
    pockjax.compile(classify_train_step, scheme=scheme)(model, opt, x, y)
    got = _flat(nnx.state(model, nnx.BatchStat))
    assert len(got) == 2 * 16 and set(got) == set(want) == set(before)  # mean and var of 16 BatchNorms
    for path in got:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-4, atol=1e-6, err_msg=path)
        assert not np.array_equal(got[path], before[path]), f"{path} did not update under {name}"


def test_paper_step_trains_its_tensors_only_and_keeps_state_for_them_only():
    x, y = _images()
    model = MobileNetV2(SMALL, rngs=nnx.Rngs(0))
    model.train()
    scheme = get_scheme("paper", SMALL)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=scheme.nnx_wrt())
    before = _flat(nnx.state(model, nnx.Param))
    trained = {p for p, r in zip(before, scheme.resolve_tree(nnx.state(model, nnx.Param)))
               if not isinstance(r, pockjax.scheme.Frozen)}
    step = pockjax.compile(classify_train_step, scheme=scheme)
    losses = [float(step(model, opt, x, y)) for _ in range(4)]
    after = _flat(nnx.state(model, nnx.Param))
    assert losses[-1] < losses[0]
    for path in before:
        if path in trained:
            assert not np.array_equal(before[path], after[path]), path
        else:
            assert np.array_equal(before[path], after[path]), path  # bitwise
    # Adam's moments exist for the trained tensors only
    mu = [p for p in pockjax.leaf_paths(nnx.state(opt.opt_state)) if ".mu." in f".{p}."]
    assert {p.split("mu.", 1)[1] for p in mu} == trained


def test_channel_rule_halves_the_trained_convs_weight_gradient():
    # The trained conv's weight gradient is what the rule prunes: measured as the
    # step's FLOPs with the conv trained (full / half its output channels) minus
    # the same step with it frozen (the backward reaches it either way).
    x, y = _images(8, 48)
    conv = "blocks.3.expand.conv.kernel"
    base = [("blocks.1.*.norm.bias", "full"), ("head.*", "full")]

    def flops(rule):
        scheme = pockjax.UpdateScheme(([(conv, rule)] if rule else []) + base)
        model = MobileNetV2(SMALL, rngs=nnx.Rngs(0))
        model.train()
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=scheme.nnx_wrt())
        # the rewritten graph, which the backend compiles as it is (no XLA compile needed here)
        lowered = pockjax.compile(classify_train_step, scheme=scheme).lower(model, opt, x, y)
        return pockjax.count_flops(lowered.graph.closed_jaxpr), lowered

    frozen, _ = flops(None)
    full, _ = flops("full")
    half, lowered = flops(pockjax.channels(0.5))
    cut = 1 - (half - frozen) / (full - frozen)
    assert cut >= 0.45, (frozen, full, half)
    # the rewritten graph's weight-gradient product has half the output channels
    hidden, cin = SMALL.block_channels()[3][0], SMALL.block_channels()[2][1]
    shapes = {tuple(v.aval.shape) for e in lowered.graph.closed_jaxpr.jaxpr.eqns
              if e.primitive.name == "dot_general" for v in e.outvars}
    assert (cin, hidden // 2) in shapes and (cin, hidden) not in shapes


def test_bert_classifier_step_with_dropout_trains_the_paper_tensors():
    config = BertConfig.tiny()
    model = BertClassifier(config, 3, rngs=nnx.Rngs(0, dropout=1))
    scheme = get_scheme("paper", model.config)
    ids = jnp.asarray(np.random.default_rng(0).integers(4, config.vocab, (4, 12)), jnp.int32)
    mask = jnp.ones_like(ids).at[:, 9:].set(0)
    y = jnp.asarray([0, 1, 2, 0], jnp.int32)
    before = _flat(nnx.state(model, nnx.Param))
    losses = train_classifier(model, scheme, [(ids, mask, y)] * 3, optimizer="adam", lr=1e-2)
    assert len(losses) == 3 and all(np.isfinite(losses))
    after = _flat(nnx.state(model, nnx.Param))
    resolved = dict(zip(before, scheme.resolve_tree(nnx.state(model, nnx.Param))))
    for path, rule in resolved.items():
        same = np.array_equal(before[path], after[path])
        assert same == isinstance(rule, pockjax.scheme.Frozen), path
    acc = evaluate_classifier(model, [ids, mask], np.asarray(y))
    assert 0.0 <= acc <= 1.0


def test_non_finite_loss_stops_training_with_a_clear_error():
    x, y = _images()
    model = MobileNetV2(SMALL, rngs=nnx.Rngs(0))
    bad = x.at[0, 0, 0, 0].set(jnp.nan)
    with pytest.raises(pockjax.NonFiniteError, match="the loss is nan"):
        train_classifier(model, get_scheme("head-only", SMALL), [(bad, y)], optimizer="adam", lr=1e-3)


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "pockjax.cli", "finetune", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_cli_refuses_a_task_of_another_kind_and_llama_options(capsys):
    from pockjax.cli import main as cli_main

    assert cli_main(["finetune", "--model", "mobilenetv2", "--task", "tweet_polarity"]) == 2
    assert "unknown vision task 'tweet_polarity'" in capsys.readouterr().err
    assert cli_main(["finetune", "--model", "all-minilm-l6-v2", "--resume", "--out", "x"]) == 2
    assert "--resume is not available for --model all-minilm-l6-v2" in capsys.readouterr().err
    assert cli_main(["finetune", "--task", "mnist5k", "--steps", "1"]) == 2
    assert "--task 'mnist5k' is not a LLaMA task" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--warmup", "5"], "--warmup is for the LLaMA models"),
    (["--schedule", "cosine", "--grad-clip", "1"], "--schedule, --grad-clip are for the LLaMA models"),
    (["--eval-every", "10"], "--eval-every is for the LLaMA models"),
    (["--save-every", "10"], "--save-every is for the LLaMA models"),
])
def test_cli_refuses_llama_training_options_for_a_classifier(argv, message, capsys):
    """Not accepted and ignored: a classifier trains at a constant rate, unclipped, writing --out at the end."""
    from pockjax.cli import main as cli_main

    assert cli_main(["finetune", "--model", "mobilenetv2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_an_out_that_holds_files(tmp_path, capsys):
    # the run's directory took the place of a non-empty --out whole: a user's file, or another
    # run (a LLaMA run's weights and resume state), was deleted without a word
    from pockjax.cli import main as cli_main

    out = tmp_path / "victim"
    out.mkdir()
    (out / "IMPORTANT.txt").write_text("precious")
    argv = ["finetune", "--model", "mobilenetv2", "--steps", "1", "--no-progress", "--out", str(out)]
    assert cli_main(argv) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    assert (out / "IMPORTANT.txt").read_text() == "precious"
    (tmp_path / "a-file").write_text("x")
    assert cli_main([*argv[:-1], str(tmp_path / "a-file")]) == 2
    assert (tmp_path / "a-file").read_text() == "x"


@pytest.mark.parametrize("model,extra", [
    ("mobilenetv2", ["--image-size", "32", "--train-per-class", "8", "--batch-size", "16"]),
    ("all-minilm-l6-v2", ["--seq-len", "24", "--train-per-class", "16", "--batch-size", "8"]),
])
def test_cli_finetunes_a_pretrained_classifier_on_shipped_data(tmp_path, model, extra):
    out_dir = tmp_path / "run"
    out = _cli("--model", model, "--steps", "3", "--eval-examples", "24", "--no-progress",
               "--out", str(out_dir), *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out   accuracy" in out.stdout
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["model"] == model and metrics["steps"] == 3 and len(metrics["losses"]) == 3
    assert 0.0 <= metrics["accuracy_before"] <= 1.0 and 0.0 <= metrics["accuracy_after"] <= 1.0
    assert metrics["scheme"].startswith("paper")
    scheme = pockjax.schemes.load_scheme_file(out_dir / "scheme.json")
    assert scheme.name == metrics["scheme"]
    from pockjax.io.safetensors import read_safetensors

    weights = read_safetensors(out_dir / "model.safetensors")
    assert "head.kernel" in weights
    if model == "mobilenetv2":
        assert "blocks.3.depthwise.norm.mean" in weights  # BatchNorm statistics saved too
    assert not [p for p in os.listdir(tmp_path) if p != "run"]  # no temporaries left


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.config = type("Config", (), {"num_classes": 3})()
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


@pytest.mark.parametrize("labels, message", [
    (np.zeros(9, np.int32), "input 0 has 10 examples, the labels 9"),      # was an accuracy of 1.11
    (np.zeros((10, 1), np.int32), r"one per example \(1-D\), got shape \(10, 1\)"),  # was 3.6
    (np.full(10, 3), r"class indices in \[0, 3\), got 3"),
    (np.full(10, -1), r"class indices in \[0, 3\), got -1"),                # -1 trained as the last class
])
def test_classifier_labels_are_checked(labels, message):
    m = _Tiny(nnx.Rngs(0))
    x = np.ones((10, 4), np.float32)
    with pytest.raises(pockjax.errors.InputError, match=message):
        evaluate_classifier(m, [x], labels, batch_size=4)
    if len(labels) == 10 and labels.ndim == 1:
        with pytest.raises(pockjax.errors.InputError, match="training batch 1: .*" + message):
            train_classifier(m, pockjax.UpdateScheme.full(), [(x, labels)], optimizer="sgd", lr=0.1)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_evaluation_leaves_the_model_in_the_mode_it_came_in(mode):
    # it always ended in train mode: dropout on and batch statistics updating in a later inference
    m = _Tiny(nnx.Rngs(0))
    getattr(m, mode)()
    assert 0.0 <= evaluate_classifier(m, [np.ones((5, 4), np.float32)], np.zeros(5, np.int32)) <= 1.0
    assert m.drop.deterministic == (mode == "eval") and m.bn.use_running_average == (mode == "eval")


@pytest.mark.parametrize("field, value, message", [
    ("train_per_class", -3, "--train-per-class must be a whole number >= 0, got -3"),  # dropped 3 of each class
    ("eval_examples", 2.5, "--eval-examples must be a whole number >= 0, got 2.5"),
    ("seed", -1, "--seed must be a whole number >= 0, got -1"),
    ("out", "", "--out is empty"),  # trained, saved nothing
])
def test_classifier_config_is_checked_before_anything_loads(field, value, message):
    from pockjax.train.classify import ClassifierConfig, finetune_classifier

    with pytest.raises(pockjax.errors.InputError, match=message):
        finetune_classifier(ClassifierConfig(model="mobilenetv2", **{field: value}))


def test_evaluation_batch_size_must_be_positive():
    m = _Tiny(nnx.Rngs(0))
    with pytest.raises(pockjax.errors.InputError, match="batch_size must be a whole number >= 1, got -1"):
        evaluate_classifier(m, [np.ones((5, 4), np.float32)], np.zeros(5, np.int32), batch_size=-1)  # was 0.0

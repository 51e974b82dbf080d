"""pockjax.search.classifier: the per-unit sensitivity analysis of MobileNetV2 and BERT classifiers."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pockjax
from pockjax.models.bert import BertClassifier, BertConfig
from pockjax.models.mobilenetv2 import MobileNetV2, MobileNetV2Config
from pockjax.search.classifier import (ClassifierSearchConfig, ClassifierUnit, _budgets, classifier_scheme,
                                       classifier_units, run)
from pockjax.search.cli import SearchError, main
from pockjax.train.classify import _optimizer, classify_train_step, resolve_classifier_scheme


def _images(n, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    y = (np.arange(n) % classes).astype(np.int32)
    x = rng.random((n, 16, 16, 3), np.float32) * 0.2 + y[:, None, None, None] / classes  # learnable
    return [x], y


#: MobileNetV2 at width 0.35 cut to its first four blocks (every kind of conv, strides 1 and 2):
#: the whole model's random init alone compiles some 70 small XLA programs.
SMALL = MobileNetV2Config(width_mult=0.35, num_classes=10, inverted_residual_setting=((1, 16, 1, 1), (6, 24, 2, 2),
                                                                                      (6, 32, 1, 2)))


@pytest.fixture(scope="module")
def mobilenet():
    return MobileNetV2(SMALL, rngs=nnx.Rngs(0))


def test_units_and_schemes(mobilenet):
    units = classifier_units(mobilenet.config, blocks=[0, 1])
    assert [u.name for u in units] == ["B0.depthwise", "B0.project", "B1.expand", "B1.depthwise", "B1.project"]
    bert = classifier_units(BertConfig.tiny(num_classes=2), kinds=["q", "down"], blocks=[1])
    assert [u.path for u in bert] == ["layers.1.attn.q.*", "layers.1.mlp.down.*"]
    s = classifier_scheme(units[2:3], mobilenet.config)
    assert [p for p, _ in s.rules] == ["blocks.1.expand.conv.kernel", "head.kernel", "head.bias"]
    with pytest.raises(pockjax.SchemeError):
        classifier_units(mobilenet.config, kinds=["wq"])
    assert _budgets("params=2k", {"step_flops": 1.0, "params": 1.0}, dict) == (None, 2000.0)
    with pytest.raises(SearchError):
        _budgets("memory=1", {"step_flops": 1.0, "params": 1.0}, dict)
    with pytest.raises(SearchError):
        _budgets("none", {"step_flops": 1.0, "params": 1.0}, dict)


def test_mobilenet_search_files_and_scheme_roundtrip(mobilenet, tmp_path):
    out = str(tmp_path / "s")
    data = (*_images(64), *_images(40, seed=1))
    cfg = ClassifierSearchConfig(model="mobilenetv2", blocks="2-3", steps=2, batch_size=16, budget="params=paper",
                                 lr=1e-2, out=out, progress=False, top=6)
    lines = []
    before = np.asarray(mobilenet.head.kernel[...]).copy()
    report = run(cfg, model=mobilenet, data=data, log=lines.append)
    assert np.array_equal(before, np.asarray(mobilenet.head.kernel[...]))  # the model is left as it was
    assert sorted(os.listdir(out)) == ["gain_by_block.png", "report.json", "scheme.json", "units.tsv"]
    rows = report["units"]
    assert {r["unit"] for r in rows} == {f"B{b}.{k}" for b in (2, 3) for k in ("expand", "depthwise", "project")}
    assert [(r["gain"], r["loss_gain"]) for r in rows] == sorted(((r["gain"], r["loss_gain"]) for r in rows),
                                                                  reverse=True)
    head = report["head_only"]
    for r in rows:  # cost: the unit's step costs more than head-only's; params = unit + head
        assert r["backward_flops"] > head["backward_flops"] > 0
        assert r["params"] > head["params"] == mobilenet.head.kernel.size + mobilenet.head.bias.size
    assert any("B3.expand" in line for line in lines) and "kinds by mean accuracy gain" in "\n".join(lines)
    assert json.load(open(os.path.join(out, "report.json")))["searched"]["units"] == report["searched"]["units"]
    assert len(open(os.path.join(out, "units.tsv")).read().splitlines()) == 1 + len(rows)
    # the scheme file is what pockjax finetune --scheme FILE resolves
    scheme = resolve_classifier_scheme(os.path.join(out, "scheme.json"), mobilenet.config)
    trained = {p for p in pockjax.leaf_paths(nnx.state(mobilenet, nnx.Param))
               if str(scheme.rule_for(p)[0]) != "frozen"}
    chosen = {ClassifierUnit(int(u.split(".")[0][1:]), u.split(".")[1]).path for u in report["searched"]["units"]}
    assert trained == {"head.kernel", "head.bias"} | chosen
    assert report["searched"]["params"] <= report["budget"]["params"]


def test_unit_cost_is_the_compiled_sparse_step(mobilenet):
    """The cost read off the one trace equals count_flops of the step pockjax.compile builds for the unit."""
    from pockjax.search.classifier import _Costs

    x, y = jnp.zeros((4, 16, 16, 3)), jnp.zeros(4, jnp.int32)
    model = nnx.merge(*nnx.split(mobilenet))
    model.train()
    tx = _optimizer("adam", 1e-3)
    costs = _Costs(model, tx, (x, y))
    scheme = classifier_scheme([ClassifierUnit(2, "depthwise")], model.config)
    opt = nnx.Optimizer(model, tx, wrt=scheme.nnx_wrt())
    # the rewritten graph, which the backend compiles as it is (no XLA compile needed here)
    lowered = pockjax.compile(classify_train_step, scheme=scheme, donate=False).lower(model, opt, x, y)
    assert pockjax.count_flops(lowered.jaxpr) == costs.flops(scheme)


def test_bert_search(tmp_path):
    model = BertClassifier(BertConfig.tiny(), 2, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 100, (48, 12)).astype(np.int32)
    y = (ids[:, 0] > 50).astype(np.int32)
    mask = np.ones_like(ids)
    data = ([ids[:32], mask[:32]], y[:32], [ids[32:], mask[32:]], y[32:])
    cfg = ClassifierSearchConfig(model="all-minilm-l6-v2", kinds="q,down", blocks="1", steps=2, batch_size=8,
                                 budget="flops=full", out=str(tmp_path), plot=False, progress=False, top=0)
    report = run(cfg, model=model, data=data, log=lambda s: None)
    assert [r["unit"] for r in sorted(report["units"], key=lambda r: r["unit"])] == ["L1.down", "L1.q"]
    assert report["family"] == "bert" and report["paper_finding"] is None
    assert report["reference"]["units"] == ["L1.q"]  # paper: q, k, v, o, up of the last half
    scheme = resolve_classifier_scheme(str(tmp_path / "scheme.json"), model.config)
    assert str(scheme.rule_for("head.kernel")[0]) == "full"


def test_cli_routing_refuses_mixed_options(capsys):
    assert main(["--model", "tiny", "--steps", "3"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["--model", "mobilenetv2", "--time-budget", "none"]) == 2
    assert "--time-budget" in capsys.readouterr().err

"""pockjax.search: cost model vs exact pruned graphs, the gain proxy, the budgeted search, the CLI."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax.models import llama
from pockjax.search.contribution import gradient_proxy, short_finetunes, spearman
from pockjax.search.cost import StepGraph, _step_for, calibrate
from pockjax.search.search import BudgetError, search
from pockjax.search.units import Unit, all_units, scheme_for, units_of_scheme
from pockjax.search.cli import SearchError, main, parse_budget
from pockjax.train.schemes import llama_scheme, load_scheme_file

CFG = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256).replace(n_layers=2)
B, T, W = 2, 32, 8


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(1, CFG.vocab, (B, T + 1)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    mask[:, T - W:] = 1
    return {"tokens": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:]),
            "loss_mask": jnp.asarray(mask), "loss_start": jnp.full((B,), T - W, jnp.int32)}


@pytest.fixture(scope="module")
def model():
    return llama.Llama(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sg(model):
    return StepGraph.for_model(model, batch=B, seq=T, window=W)


@pytest.fixture(scope="module")
def cm(sg):
    return calibrate(sg)


def test_step_graph_equals_the_compiled_step(model, sg):
    """StepGraph prunes exactly as pockjax.compile does, and deeper schemes cost XLA more."""
    units = [Unit(0, "wq"), Unit(1, "w2")]
    tx = optax.adamw(3e-4, weight_decay=0.0)
    graphdef, params = llama.split(model)
    params = jax.tree.map(jnp.copy, params)
    scheme = scheme_for(units)
    step = pockjax.compile(_step_for(graphdef, tx, W), scheme=scheme)
    compiled = step.lower(params, pockjax.init_opt_state(tx, params, scheme), _batch()).compile()
    assert pockjax.count_flops(compiled.jaxpr) == sg.evaluate(units).flops
    shallow = pockjax.compile(_step_for(graphdef, tx, W), scheme=scheme_for([Unit(1, "w2")]))
    c2 = shallow.lower(params, pockjax.init_opt_state(tx, params, scheme_for([Unit(1, "w2")])), _batch()).compile()
    assert c2.cost_analysis()["flops"] < compiled.cost_analysis()["flops"]


def test_cost_model_matches_exact_graphs_with_depth_coupling(sg, cm):
    units = all_units(CFG)
    rng = random.Random(1)
    for _ in range(6):
        s = rng.sample(units, rng.randint(1, 8))
        ex = sg.evaluate(s)
        assert abs(cm.flops(s) - ex.flops) / ex.flops < 1e-3, s
        assert abs(cm.memory(s) - ex.peak_bytes) / ex.peak_bytes < 0.05, s
    # not additive: the second tensor of an already-reached depth adds only its weight gradient
    a, b = Unit(0, "wq"), Unit(1, "wq")
    f0 = sg.evaluate([]).flops
    pair = sg.evaluate([a, b]).flops - f0
    alone = (sg.evaluate([a]).flops - f0) + (sg.evaluate([b]).flops - f0)
    assert pair < 0.9 * alone
    assert abs(pair - (cm.depth(a) + cm.weight(a) + cm.weight(b))) / pair < 1e-3
    assert cm.depth(Unit(0, "wq")) > cm.depth(Unit(0, "w2")) > cm.depth(Unit(1, "wq"))
    # siblings of one block: wq and wk each add their own branch off the attention scores
    both = sg.evaluate([Unit(0, "wq"), Unit(0, "wk")]).flops
    assert cm.extra(0, "wq", "wk") > 0 and cm.flops([Unit(0, "wq"), Unit(0, "wk")]) == both


def test_proxy_ranks_a_unit_that_matters_above_one_that_does_not():
    # with block 1's value projection zeroed, the attention output of that block is
    # zero whatever wq, wk, wo are: their gradients vanish, wv's does not
    m = llama.Llama(CFG, rngs=nnx.Rngs(1))
    m.layers[1].attn.wv.kernel.set_value(jnp.zeros_like(m.layers[1].attn.wv.kernel.get_value()))
    units = [Unit(1, "wq"), Unit(1, "wv"), Unit(1, "wo"), Unit(1, "w1")]
    c = gradient_proxy(m, [_batch(0), _batch(1)], W, units)
    assert c.gain[Unit(1, "wv")] > 0 and c.gain[Unit(1, "wo")] == 0 and c.gain[Unit(1, "wq")] == 0
    real = short_finetunes(m, [_batch(0), _batch(1)], [_batch(0)], W, units, steps=3, lr=1e-2)
    assert real["gain"][Unit(1, "wo")] == 0 and real["gain"][Unit(1, "wv")] > 0
    assert spearman([c.gain[u] for u in units], [real["gain"][u] for u in units]) > 0.5


def test_search_respects_budgets_and_beats_the_reference(sg, cm):
    units = all_units(CFG)
    rng = np.random.default_rng(0)
    gains = {u: float(rng.uniform(0.1, 1.0)) for u in units}
    ref = units_of_scheme(llama_scheme("paper", CFG, blocks=1), CFG)
    ex = sg.evaluate(ref)
    r0 = search(gains, cm, flops_budget=ex.flops, memory_budget=ex.peak_bytes, step_graph=sg)
    assert r0.exact.flops <= ex.flops and r0.exact.peak_bytes <= ex.peak_bytes
    r = search(gains, cm, flops_budget=ex.flops, memory_budget=ex.peak_bytes, step_graph=sg, incumbents=[ref])
    assert r.exact.flops <= ex.flops and r.exact.peak_bytes <= ex.peak_bytes
    assert r.gain >= max(r0.gain, sum(gains[u] for u in ref))
    # a bigger budget never gains less; a memory-only budget works too
    r2 = search(gains, cm, flops_budget=1.5 * ex.flops, step_graph=sg)
    assert r2.gain >= r.gain and r2.exact.flops <= 1.5 * ex.flops
    with pytest.raises(BudgetError, match="no unit fits"):
        search(gains, cm, flops_budget=sg.evaluate([]).flops)
    with pytest.raises(BudgetError, match="give"):
        search(gains, cm)


def test_parse_budget():
    assert parse_budget("0.8*paper", "time", 10.0) == 8.0
    assert parse_budget("1.5GiB", "memory", 1.0) == 1.5 * 2**30
    for bad in ("lots", "-1GB", "0*paper", "3 parsecs"):
        with pytest.raises(SearchError):
            parse_budget(bad, "memory", 1.0)


_TINY = ["--model", "tiny", "--task", "uppercase", "--batch-size", "2", "--train-examples", "16",
         "--eval-examples", "2", "--reference-blocks", "1", "--proxy-batches", "1", "--no-progress", "--top", "3"]


def test_cli_writes_a_scheme_that_finetune_and_compile_accept(tmp_path, capsys):
    out = tmp_path / "s"
    assert main([*_TINY, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kinds by mean gain" in text and "searched:" in text
    report = json.loads((out / "report.json").read_text())
    assert report["searched"]["flops"] <= report["budget"]["flops"]
    assert report["searched"]["planned_peak_bytes"] <= report["budget"]["memory_bytes"]
    assert len(report["units"]) == 14 and (out / "gain_vs_cost.png").stat().st_size > 1000
    scheme = load_scheme_file(out / "scheme.json")
    assert sorted(u.name for u in units_of_scheme(scheme, llama.LlamaConfig.tiny())) == \
        sorted(report["searched"]["units"])
    from pockjax.train import FinetuneConfig, finetune

    res = finetune(FinetuneConfig(task="uppercase", steps=1, batch_size=2, train_examples=8, eval_examples=0,
                                  scheme=str(out / "scheme.json"), progress=False, save_every=0),
                   model=llama.Llama(llama.LlamaConfig.tiny(vocab=259, max_seq_len=256), rngs=nnx.Rngs(0)),
                   tokenizer=llama.Tokenizer.byte_level_for_tests(), log=lambda s: None)
    assert res.metrics["trainable_params"] == report["searched"]["trainable"]


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown pretrained model"),
    (["--memory-budget", "1KiB"], "no unit fits"),
    (["--time-budget", "fast"], "bad --time-budget"),
    (["--kinds", "wq,w9"], "unknown tensor kind"),
    (["--blocks", "5-9"], "outside the model"),
    (["--time-budget", "none", "--memory-budget", "none"], "at least one"),
])
def test_cli_errors(args, message, capsys):
    argv = [*_TINY, *args] if args[0] != "--model" else [*args, *_TINY[2:]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_report_with_an_undefined_gain_is_written_with_nulls(tmp_path):
    # a validation run that diverges makes a gain inf or NaN; write_json refuses those, which
    # lost report.json and units.tsv at the end of a finished search
    from pockjax.search.cli import write_outputs

    report = {"searched": {"predicted_gain": float("inf"), "held_out_loss_gain": float("nan")},
              "units": [{"name": "u0", "gain": 1.5}]}
    write_outputs(str(tmp_path), pockjax.UpdateScheme({"w": "full"}), report, ["name", "gain"])
    back = json.loads((tmp_path / "report.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert back["searched"] == {"predicted_gain": None, "held_out_loss_gain": None}
    assert (tmp_path / "units.tsv").read_text() == "name\tgain\nu0\t1.5\n"

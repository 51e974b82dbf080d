"""The one registry of named schemes (pockjax.schemes): every command's "paper" is the same.

``pockjax finetune`` trains it, ``pockjax plan`` and ``pockjax memory`` report figures for
it, ``pockjax search`` measures its budgets against it, and the benchmark harness trains
it as its sparse row: the same tensors everywhere, and the same trainable count printed.
"""

from __future__ import annotations

import re

import pytest
from flax import nnx

import pockjax
from pockjax.errors import SchemeError
from pockjax.memory.llama_plan import abstract_llama_step
from pockjax.models import llama
from pockjax.schemes import (
    DEFAULT_BLOCKS,
    PAPER_TENSORS,
    get_scheme,
    paper_blocks,
    register_scheme,
    resolve_scheme,
    scheme_names,
    schemes,
)
from pockjax.train.schemes import SCHEMES, llama_scheme

SMOL = llama.LlamaConfig.smollm2_135m()
DEEP = llama.LlamaConfig.llama2_7b()


def abstract_params(config):
    return llama.split(nnx.eval_shape(lambda: llama.Llama(config, rngs=nnx.Rngs(0))))[1]


def trained(scheme, params) -> set[str]:
    return {row.path for row in scheme.describe(params).rows if row.trainable}


def paper_paths(config, blocks) -> set[str]:
    return {f"layers.{i}.{t}.kernel" for i in range(config.n_layers - blocks, config.n_layers)
            for t in PAPER_TENSORS}


def test_registry_names_and_depth_rule():
    assert scheme_names() == ("full", "paper", "norm-only", "channels", "lora")
    assert tuple(SCHEMES) == scheme_names()  # pockjax.train.schemes shows the registry
    assert DEFAULT_BLOCKS == 10
    assert [paper_blocks(n) for n in (1, 2, 10, 24, 30, 32, 40, 80)] == [1, 2, 10, 10, 10, 11, 14, 27]
    assert paper_blocks(32, 4) == 4 and paper_blocks(2, 2) == 2
    with pytest.raises(SchemeError, match="at least 1"):
        paper_blocks(30, 0)
    # once quietly capped: --blocks 10 on a 2-block model trained 2
    with pytest.raises(SchemeError, match=r"--blocks 10 is more than the model's 2 blocks: give at most 2"):
        paper_blocks(2, 10)


@pytest.mark.parametrize("config", [SMOL, DEEP, llama.LlamaConfig.tiny()], ids=["smollm2", "llama2-7b", "tiny"])
def test_paper_trains_attention_and_w1_w3_of_the_last_blocks(config):
    params = abstract_params(config)
    scheme = get_scheme("paper", config)
    assert trained(scheme, params) == paper_paths(config, paper_blocks(config.n_layers))
    # the other names are defined once too
    assert trained(get_scheme("channels", config), params) == trained(scheme, params)
    assert trained(get_scheme("full", config), params) == set(pockjax.leaf_paths(params))
    assert all("norm" in p for p in trained(get_scheme("norm-only", config), params))


def test_every_command_resolves_the_same_paper():
    from pockjax.search.cli import SearchConfig
    from pockjax.train.finetune import FinetuneConfig

    params = abstract_params(SMOL)
    expected = paper_paths(SMOL, 10)
    fc = FinetuneConfig()
    assert fc.scheme == "paper"
    finetune = trained(llama_scheme(fc.scheme, SMOL, blocks=fc.blocks), params)  # what finetune calls
    memory = trained(abstract_llama_step(SMOL, "paper", seq=8).scheme, params)  # pockjax memory / plan
    sc = SearchConfig()
    search = trained(resolve_scheme(sc.reference, SMOL, blocks=sc.reference_blocks), params)
    assert finetune == memory == search == expected
    from benchmarks.harness.common import BenchConfig
    from benchmarks.harness.rows import _scheme as bench_scheme

    bench = trained(bench_scheme("paper", SMOL, BenchConfig()), params)
    assert bench == expected


@pytest.mark.slow
def test_plan_prints_the_trainable_count_finetune_prints(capsys):
    """``pockjax plan --model smollm2-135m --scheme paper`` and what ``pockjax finetune``
    states for the SmolLM2 GGUF it trains (scheme.describe of the loaded model's params)."""
    from pockjax.cli import main
    from pockjax.models.llama import pretrained_path
    from pockjax.models.llama.gguf import gguf_config, open_gguf

    gguf = gguf_config(open_gguf(pretrained_path("smollm2-135m")))
    fc_scheme = llama_scheme("paper", gguf)  # finetune's call, with the file's own config
    finetune_count = fc_scheme.describe(abstract_params(gguf)).trainable

    assert main(["plan", "--model", "smollm2-135m", "--scheme", "paper", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"trainable: ([\d,]+) of ([\d,]+) parameters", out)
    assert m, out
    plan_count, plan_total = (int(g.replace(",", "")) for g in m.groups())
    assert plan_count == finetune_count == 26_542_080  # 10 blocks x (wq, wk, wv, wo, w1, w3)
    assert plan_total == gguf.num_params() == SMOL.num_params()
    assert f"[{fc_scheme.name}]" in out


def test_memory_and_plan_reject_an_unknown_scheme_in_one_line(capsys):
    from pockjax.cli import main

    assert main(["plan", "--model", "tiny", "--scheme", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pockjax plan: error: unknown scheme 'nope'") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:  # refused by the option's type, before any work
        main(["memory", "--model", "tiny", "--scheme", "paper", "--blocks", "0", "--no-plot"])
    assert exit_info.value.code == 2
    assert "argument --blocks: must be a whole number >= 1, got '0'" in capsys.readouterr().err


def test_unknown_name_and_config():
    with pytest.raises(SchemeError, match="use one of full, paper, norm-only, channels"):
        get_scheme("papr", SMOL)
    with pytest.raises(SchemeError, match="no named schemes for a dict"):
        get_scheme("paper", {"n_layers": 3})
    assert get_scheme("Norm_Only", SMOL) == pockjax.UpdateScheme.norm_only()


def test_a_family_adds_its_schemes_without_touching_llama():
    from pockjax import schemes as registry

    class VisionConfig:
        n_blocks = 17

    registry.register_family("vision-test", lambda c: isinstance(c, VisionConfig))
    try:
        @register_scheme("paper", "vision-test", "first pointwise conv of the last blocks")
        def _vision_paper(config, *, blocks=None, fraction=0.5):
            return pockjax.UpdateScheme({"blocks.16.expand.kernel": "full"}, name="paper (vision)")

        assert get_scheme("paper", VisionConfig()).name == "paper (vision)"
        assert set(schemes("vision-test")) == {"full", "paper", "norm-only"}
        assert get_scheme("paper", SMOL).name == "paper (last 10 blocks)"
        with pytest.raises(ValueError, match="already registered"):
            register_scheme("paper", "vision-test", "again")(_vision_paper)
    finally:
        registry._FAMILIES.pop("vision-test", None)
        registry._SCHEMES.pop(("vision-test", "paper"), None)


def test_more_blocks_than_the_model_has_is_one_line_error(capsys):
    from pockjax.cli import main

    assert main(["memory", "--model", "tiny", "--scheme", "paper", "--blocks", "99", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pockjax memory: error: --blocks 99 is more than the model's 2 blocks") and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--scheme", "full", "--blocks", "2"], "--scheme full does not use it"),
    (["--scheme", "lora", "--blocks", "2"], "--scheme lora does not use it"),
    (["--task", "add", "--data", "d.jsonl"], "the data file replaces the task; give one of them"),
    (["--scheme", "SCHEME_FILE", "--blocks", "2"], "does not use it"),
], ids=["full-blocks", "lora-blocks", "task-data", "file-blocks"])
def test_finetune_options_that_would_be_ignored_are_refused(capsys, tmp_path, argv, message):
    # once accepted: --blocks without effect, and a run.json recording a task it did not train on
    from pockjax.cli import main

    scheme_file = tmp_path / "s.json"
    scheme_file.write_text('{"rules": {"layers.*.attn_norm.scale": "full"}}')
    argv = [str(scheme_file) if a == "SCHEME_FILE" else a for a in argv]
    assert main(["finetune", "--out", "never-written", "--no-progress"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1

"""Every numeric option of every ``pockjax`` command refuses nonsense before any work.

argparse answers a bad value with one line naming the option
(``pockjax plan: error: argument --layers: must be a whole number >= 1, got '-2'``)
and exit status 2. No command runs here: the commands' functions are replaced
by one that fails the test, so a value that slips through fails fast instead
of starting a compilation, a download or a benchmark.
"""

from __future__ import annotations

import argparse

import pytest

import pockjax.cli
from pockjax import _cli_args

BAD = [
    # pockjax memory
    ("memory", "--batch", "0"),
    ("memory", "--batch", "-1"),
    ("memory", "--batch", "1.5"),
    ("memory", "--seq", "0"),
    ("memory", "--blocks", "0"),
    ("memory", "--remat-budget", "-1"),
    ("memory", "--remat-budget", "nan"),
    ("memory", "--remat-budget", "inf"),
    # pockjax plan
    ("plan", "--layers", "-2"),
    ("plan", "--layers", "0"),
    ("plan", "--budget-gb", "-1"),
    ("plan", "--budget-gb", "0"),
    ("plan", "--budget-gb", "nan"),
    ("plan", "--budget-gb", "inf"),
    ("plan", "--batch", "0"),
    ("plan", "--seq", "-5"),
    ("plan", "--blocks", "0"),
    ("plan", "--sparse-blocks", "-1"),
    # pockjax search
    ("search", "--lr", "inf"),
    ("search", "--lr", "nan"),
    ("search", "--lr", "0"),
    ("search", "--lr", "-0.5"),
    ("search", "--batch-size", "0"),
    ("search", "--seq-len", "0"),
    ("search", "--seed", "-1"),
    ("search", "--train-examples", "0"),
    ("search", "--eval-examples", "-1"),
    ("search", "--reference-blocks", "0"),
    ("search", "--proxy-batches", "0"),
    ("search", "--validate", "-1"),
    ("search", "--validate-steps", "0"),
    ("search", "--top", "-1"),
    # pockjax export
    ("export", "--target", "bogus"),
    ("export", "--blocks", "0"),
    ("export", "--batch-size", "0"),
    ("export", "--seq-len", "-1"),
    ("export", "--lr", "nan"),
    ("export", "--lr", "-0.5"),
    ("export", "--lr", "inf"),
    # pockjax bench
    ("bench", "--reps", "0"),
    ("bench", "--batch", "0"),
    ("bench", "--seq", "0"),
    ("bench", "--steps", "0"),
    ("bench", "--warmup", "-1"),
    ("bench", "--quality-steps", "-1"),
    ("bench", "--quality-batch", "0"),
    ("bench", "--quality-seq", "0"),
    ("bench", "--eval-examples", "0"),
    ("bench", "--lr", "inf"),
    ("bench", "--lora-lr", "nan"),
    ("bench", "--sparse-lr", "0"),
    ("bench", "--blocks", "0"),
    ("bench", "--threads", "0"),
    ("bench", "--seed", "-1"),
    ("bench", "--timeout", "0"),
    ("bench", "--timeout", "inf"),
    # pockjax finetune, generate
    ("finetune", "--lr", "nan"),
    ("finetune", "--blocks", "0"),
    ("generate", "--top-p", "0"),
]

# Values at the edge of each range that stay valid (a seed of 0, no printed rows, ...).
GOOD = [
    ["memory", "--remat-budget", "0", "--batch", "1", "--blocks", "1"],
    ["plan", "--layers", "1", "--budget-gb", "0.5", "--sparse-blocks", "2"],
    ["search", "--seed", "0", "--top", "0", "--validate", "0", "--eval-examples", "0", "--lr", "1e-3"],
    ["export", "--target", "dsp", "--blocks", "1", "--lr", "0.1", "--out", "x"],
    ["bench", "--warmup", "0", "--quality-steps", "0", "--seed", "0", "--timeout", "0.5"],
]


def _not_run(args):
    raise AssertionError(f"pockjax {args.command} started work on bad input")


@pytest.fixture
def parser_without_work(monkeypatch):
    """``pockjax.cli.build_parser`` whose commands fail the test if they run."""
    build = pockjax.cli.build_parser

    def build_parser():
        parser = build()
        for sub in _subparsers(parser).values():
            sub.set_defaults(func=_not_run)
        return parser

    monkeypatch.setattr(pockjax.cli, "build_parser", build_parser)
    return build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command, option, value", BAD, ids=[" ".join(c) for c in BAD])
def test_bad_number_is_one_line_naming_the_option(parser_without_work, capsys, command, option, value):
    argv = [command, option, value] + (["--prompt", "hi"] if command == "generate" else [])
    with pytest.raises(SystemExit) as exc:
        pockjax.cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1  # the usage (17 lines for finetune) is one --help away
    last = err.strip()
    assert last.startswith(f"pockjax {command}: error: argument ")
    assert option in last and repr(value) in last and last.endswith(f"(see pockjax {command} --help)")


def test_export_bogus_target_lists_the_targets(parser_without_work, capsys):
    from pockjax.backends.iree.targets import names

    with pytest.raises(SystemExit) as exc:
        pockjax.cli.main(["export", "--target", "bogus", "--out", "x"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --target" in last and "invalid choice: 'bogus'" in last
    assert all(repr(t) in last for t in names())


@pytest.mark.parametrize("argv", GOOD, ids=[a[0] for a in GOOD])
def test_values_at_the_edge_of_the_range_are_accepted(parser_without_work, argv):
    args = parser_without_work().parse_args(argv)
    assert args.command == argv[0]


def test_no_numeric_option_is_a_plain_int_or_float():
    """A new numeric option takes one of pockjax._cli_args's checked types."""
    checked = {getattr(_cli_args, n) for n in _cli_args.__all__ if callable(getattr(_cli_args, n))}
    plain = []
    for command, sub in _subparsers(pockjax.cli.build_parser()).items():
        for action in sub._actions:
            if action.type in (int, float):
                plain.append(f"{command} {'/'.join(action.option_strings)}")
            elif action.type is not None and action.type not in checked:
                # a factory's result (int_at_least(2), float_in(...)) is named after its range
                assert action.type.__module__ == _cli_args.__name__, (command, action.option_strings)
    assert not plain, f"options that accept nan, inf or negative numbers unchecked: {plain}"


@pytest.mark.parametrize("argv", [
    ["plan", "--layers", "100000"], ["plan", "--seq", "100000000"], ["plan", "--batch", str(10**15)],
    ["plan", "--seq", "100000000", "--quantize", "int4"], ["plan", "--layers", "100000", "--devices", "2"],
    ["memory", "--seq", "200000", "--no-plot"],
], ids=lambda a: " ".join(a[:3]) + (" " + a[3] if len(a) > 3 else ""))
def test_plan_and_memory_refuse_sizes_they_cannot_trace(capsys, argv):
    # --layers 100000 traced for ever, --seq 1e8 built attention for ever, --batch 1e15 overflowed
    # a byte count with a traceback: each is one line naming the largest size taken
    assert pockjax.cli.main([argv[0], "--model", "tiny", *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{argv[1]} {argv[2]} is more than pockjax {argv[0]} takes: at most" in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "all-minilm-l6-v2", "--image-size", "48"], "--image-size is for --model mobilenetv2"),
    (["--model", "mobilenetv2", "--scheme", "bias-only", "--fraction", "0.3"],
     "--fraction is the 'channels' scheme's; --scheme bias-only does not take it"),
])
def test_classifier_options_with_no_effect_are_refused(capsys, argv, message):
    # they ran, and run.json recorded image_size 48 / fraction 0.3 that had no effect
    assert pockjax.cli.main(["finetune", *argv, "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    # --blocks with a scheme that trains no last blocks ran as if it were not given
    (["--model", "mobilenetv2", "--scheme", "head-only", "--blocks", "2"], "--scheme head-only trains no number"),
    (["--model", "all-minilm-l6-v2", "--scheme", "Bias_Only", "--blocks", "2"], "--scheme Bias_Only trains no"),
    # these failed only once the model and data were loaded
    (["--model", "mobilenetv2", "--scheme", "lora"], "unknown scheme 'lora'; use one of full, norm-only, paper"),
    (["--model", "all-minilm-l6-v2", "--scheme", "never.json"], "scheme file not found: never.json"),
])
def test_classifier_options_are_refused_before_loading(monkeypatch, capsys, argv, message):
    import pockjax.train.classify as classify

    def never(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(classify, "_load", never)
    monkeypatch.setattr(classify, "_splits", never)
    assert pockjax.cli.main(["finetune", *argv, "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("fields, message", [
    ({"optimizer": "rmsprop"}, "unknown optimizer 'rmsprop'"),
    ({"lr": float("nan")}, "the learning rate must be a finite number > 0"),
    ({"scheme": "paper", "fraction": 0.25}, "--fraction is the 'channels' scheme's"),
])
def test_classifier_config_is_refused_before_loading(monkeypatch, fields, message):
    import pockjax.train.classify as classify
    from pockjax.errors import PockjaxError

    monkeypatch.setattr(classify, "_load", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(classify, "_splits", lambda *a, **k: pytest.fail("the data was loaded"))
    with pytest.raises(PockjaxError, match=message):
        classify.finetune_classifier(classify.ClassifierConfig(model="mobilenetv2", steps=1, **fields))


def test_classifier_fraction_is_taken_by_channels_in_any_spelling():
    from pockjax.schemes import ignores_fraction
    from pockjax.train.classify import CLASSIFIERS

    # a case-sensitive compare refused "--scheme Channels --fraction 0.3"
    assert not any(ignores_fraction(s, CLASSIFIERS[m].scheme_family()) for s in ("Channels", "channels")
                   for m in CLASSIFIERS)
    assert ignores_fraction("paper", CLASSIFIERS["mobilenetv2"].scheme_family())


def test_classifier_fraction_is_refused_in_a_fresh_process():
    # The CLI asked the registry before the model's package had registered its schemes:
    # in a fresh process "--scheme paper --fraction 0.5" trained, the fraction unread.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pockjax.cli", "finetune", "--model", "all-minilm-l6-v2",
                           "--scheme", "paper", "--fraction", "0.5", "--steps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--fraction is the 'channels' scheme's; --scheme paper does not take it" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--top-p", "0.5"], "--top-p shapes sampling: give --temperature above 0"),
    (["generate", "--prompt", "hi", "--seed", "5"], "--seed shapes sampling"),
    (["generate", "--prompt", " "], "--prompt is empty"),
    (["finetune", "--eval-examples", "0", "--fail-below", "0.5"], "--fail-below gates on the held-out accuracy"),
    (["finetune", "--eval-examples", "0", "--show", "3"], "--show prints held-out answers"),
    (["finetune", "--model", "mobilenetv2", "--eval-examples", "0", "--fail-below", "0.9"],
     "--fail-below gates on the held-out accuracy"),
    (["finetune", "--scheme", "Norm", "--blocks", "2"], "--scheme Norm does not use it"),
    (["finetune", "--fraction", "0.5"], "--fraction are for the classifiers"),
    (["finetune", "--train-per-class", "400"], "--fraction are for the classifiers"),
    (["finetune", "--model", "mobilenetv2", "--out", ""], "--out is empty"),
    (["finetune", "--scheme", "LoRA", "--blocks", "2"], "--scheme LoRA does not use it"),
    (["plan", "--model", "tiny", "--scheme", "Full", "--blocks", "2"], "--scheme Full does not use it"),
    (["finetune", "--train-replies", "last"], "--train-replies chooses what is trained of the chat records of --data"),
    (["finetune", "--model", "mobilenetv2", "--train-replies", "all"], "a built-in task has none"),
    (["finetune", "--save-every", "5"], "--save-every saves to --out: give --out"),
    (["finetune", "--out", ""], "--out is empty"),
    (["plan", "--model", "tiny", "--scheme", "full", "--blocks", "1"], "--scheme full does not use it"),
    (["plan", "--model", "tiny", "--check"], "--check compares the per-device plan with a compile"),
    (["plan", "--model", "tiny", "--fits", "1", "--budget-gb", "0.001"], "--budget-gb 0.001 would say nothing more"),
    (["export", "--model", "tiny", "--target", "cpu", "--arch", "sm_80", "--out", "x"], "name the CPU with --cpu"),
    (["export", "--model", "tiny", "--target", "cuda", "--cpu", "znver3", "--out", "x"], "--target cpu, arm64 or dsp; --target cuda is a GPU: name its architecture with --arch"),
    (["plan", "--model", "tiny", "--mesh", "foo=2", "--batch", "2"], "knows the axes data and fsdp, not foo"),
    (["plan", "--model", "tiny", "--mesh", "data=1,model=2"], "not model (tensor parallel"),
    (["memory", "--model", "tiny", "--scheme", "norm-only", "--blocks", "2", "--no-plot"], "does not use it"),
    (["memory", "--model", "tiny", "--formats", "nope"], "--formats 'nope': give a comma-separated list"),
    (["memory", "--model", "tiny", "--no-plot", "--formats", "svg"], "give it without --no-plot"),
    (["export", "--model", "tiny", "--image-size", "32", "--out", "never"], "--image-size does not apply"),
    (["export", "--model", "tiny", "--dtype", "bf16", "--target", "vulkan", "--out", "never"],
     "--dtype bf16 does not compile for vulkan"),
    (["export-model", "--model", "never", "--out", "x.safetensors"], "--format gguf writes one .gguf file"),
    (["export-model", "--model", "never", "--format", "safetensors", "--out", "x.gguf"],
     "--format safetensors writes a Hugging Face directory"),
    (["search", "--model", "tiny", "--task", "add", "--data", "d.jsonl"], "the data file replaces the task"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_options_without_effect_or_in_conflict_are_refused_before_any_work(capsys, argv, message):
    # each of these ran with exit 0, the option doing nothing (a --fail-below gate that never
    # gated, --top-p in greedy decoding, a GGUF written under a .safetensors name), or crashed
    assert pockjax.cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err

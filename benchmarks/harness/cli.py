"""``pockjax bench``: the side-by-side benchmark from the command line.

Bad input raises a :class:`~pockjax.errors.PockjaxError`, which :mod:`pockjax.cli`
prints in one line (exit status 2); any other exception is a bug and shows its
traceback.
"""

from __future__ import annotations

import argparse

from pockjax._cli_args import non_negative_int, positive_finite_float, positive_int

#: The ``--rows`` / ``--quality-rows`` values (stripped) that name no rows.
NO_ROWS = ("", "none")


def _cmd(args: argparse.Namespace) -> int:
    import sys

    from benchmarks.harness.rows import QUALITY_ROWS, ROWS, default_rows
    from benchmarks.harness.runner import run

    def names(text, default):
        return _row_names(text, default, ROWS, "")

    if args.history:
        from benchmarks.harness.history import history, history_table

        h = history(args.history)
        if not h["runs"]:
            print("pockjax bench: error: --history: none of these runs has a speed phase", file=sys.stderr)
            return 2
        print(history_table(h), end="")
        if args.plot:
            from benchmarks.harness.history import plot_history

            if plot_history(h, args.plot) is None:
                print("pockjax bench: error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
                return 2
            print(f"written: {args.plot}")
        return 0
    if args.plot:  # without --history
        print("pockjax bench: error: --plot goes with --history", file=sys.stderr)
        return 2
    if args.merge:
        from benchmarks.harness.runner import markdown_table, merge

        results = merge(args.merge, args.out)
        print(markdown_table(results))
        return 0
    if args.list and args.workload != "llama":
        from benchmarks.harness.classifier_rows import CLASSIFIER_ROWS

        for name, row in CLASSIFIER_ROWS[args.workload].items():
            print(f"{name:22s} {row.description}")
        return 0
    if args.list:
        for name, row in ROWS.items():
            print(f"{name:22s} {row.description}")
        return 0
    if args.quality_steps == 0 and args.quality_rows is not None and args.quality_rows.strip() not in NO_ROWS:
        print("pockjax bench: error: --quality-rows needs --quality-steps N (N >= 1); without it there is no quality"
              " phase", file=sys.stderr)
        return 2
    if args.workload != "llama":
        return _classifier_cmd(args)
    cfg = llama_config(args)
    if min(cfg.batch, cfg.seq, cfg.steps) < 1 or cfg.warmup < 0 or cfg.quality_steps < 0:
        print("pockjax bench: error: --batch, --seq and --steps must be >= 1, --warmup and"
              " --quality-steps >= 0", file=sys.stderr)
        return 2
    from pockjax.data.batching import SequenceLengthError

    try:
        results = run(cfg, rows=names(args.rows, default_rows(cfg.device)), reps=args.reps,
                      quality_rows=names(args.quality_rows, QUALITY_ROWS), out=args.out,
                      timeout=args.timeout, progress=not args.no_progress)
    except SequenceLengthError as e:  # says which flag sets the length; pockjax.cli prints it
        raise SequenceLengthError(f"{e} (--seq for the speed phase, --quality-seq for the quality phase)") from None
    except KeyboardInterrupt as e:
        print(f"pockjax bench: interrupted; the runs that finished are in {args.out}/results.md"
              if getattr(e, "written", False) else
              "pockjax bench: interrupted before any run finished; nothing was written", file=sys.stderr)
        return 130
    from benchmarks.harness.runner import markdown_table

    print(markdown_table(results))
    print(f"written: {args.out}/results.json, results.md, results.png")
    failed = [n for n, s in results["speed"].items() if s["errors"]] + \
             [n for n, q in results["quality"].items() if q.get("error")]
    return 1 if failed else 0


def _row_names(text: str | None, default, table, what: str) -> list[str] | None:
    """The rows of a ``--rows`` / ``--quality-rows`` value: ``default`` when not given,
    none for ``""`` or ``none``; an unknown row exits with status 2, listing ``table``."""
    import sys

    if text is None:
        return None if default is None else list(default)
    if text.strip() in NO_ROWS:
        return []
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in table]
    if bad:
        print(f"pockjax bench: error: unknown {what}rows {bad}; rows: {', '.join(table)}", file=sys.stderr)
        raise SystemExit(2)
    twice = sorted({t for t in out if out.count(t) > 1})
    if twice:  # a speed row would run twice a round, a quality row overwrite its own result
        print(f"pockjax bench: error: {what}rows {twice} are given more than once; name each row once", file=sys.stderr)
        raise SystemExit(2)
    return out


def llama_config(args: argparse.Namespace):
    """The :class:`BenchConfig` of ``--workload llama`` (the default) from the parsed flags
    (``--batch-size`` and ``--seq-len`` stand for ``--batch`` and ``--seq`` when given)."""
    from benchmarks.harness.common import BenchConfig, default_seq

    batch = args.batch if args.batch_size is None else args.batch_size
    seq = args.seq if args.seq_len is None else args.seq_len
    return BenchConfig(model=args.model, device=args.device, batch=batch,
                       seq=default_seq(args.model) if seq is None else seq, warmup=args.warmup,
                       steps=args.steps, lr=3e-4 if args.lr is None else args.lr,
                       lora_lr=args.lora_lr, sparse_lr=args.sparse_lr,
                       blocks=args.blocks, threads=args.threads,
                       torch_mkl_any_cpu=args.torch_mkl_any_cpu, quality_steps=args.quality_steps,
                       quality_batch=args.quality_batch, quality_seq=args.quality_seq,
                       eval_examples=args.eval_examples, seed=args.seed)


def classifier_config(args: argparse.Namespace):
    """The :class:`~benchmarks.harness.classifier_rows.ClassifierBenchConfig` of
    ``--workload mobilenetv2`` or ``minilm`` (``--batch`` and ``--seq`` stand for
    ``--batch-size`` and ``--seq-len``; ``--eval-examples`` defaults to 500 here)."""
    from benchmarks.harness.classifier_rows import ClassifierBenchConfig

    batch = args.batch_size if args.batch_size is not None else args.batch if args.batch_given else None
    seq = args.seq_len if args.seq_len is not None else args.seq if args.seq is not None else 128
    return ClassifierBenchConfig(
        workload=args.workload, device=args.device, batch=batch, image_size=args.image_size, seq=seq,
        warmup=args.warmup, steps=args.steps, quality_steps=args.quality_steps,
        eval_examples=args.eval_examples if args.eval_examples_given else 500, lr=args.lr,
        sparse_lr=args.sparse_lr, lora_lr=args.lora_lr, threads=args.threads, seed=args.seed)


def _classifier_cmd(args: argparse.Namespace) -> int:
    import sys

    from benchmarks.harness.classifier_rows import CLASSIFIER_ROWS
    from benchmarks.harness.classifier_runner import classifier_table, run_classifier

    if args.torch_mkl_any_cpu or args.blocks is not None:
        print("pockjax bench: error: --torch-mkl-any-cpu and --blocks are for --workload llama only",
              file=sys.stderr)
        return 2
    cfg = classifier_config(args)
    table = CLASSIFIER_ROWS[cfg.workload]

    def names(text):
        return _row_names(text, None, table, f"{cfg.workload} ")

    results = run_classifier(cfg, rows=names(args.rows), reps=args.reps, quality_rows=names(args.quality_rows),
                             out=args.out, timeout=args.timeout, progress=not args.no_progress)
    print(classifier_table(results))
    print(f"written: {args.out}/results.json, results.md, results.png")
    failed = [n for n, s in results["speed"].items() if s["errors"]] + \
             [n for n, q in results["quality"].items() if q.get("error")]
    return 1 if failed else 0


class _Given(argparse.Action):
    """Stores the value and records that the flag was given (``<dest>_given``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark pockjax against PyTorch (+ PEFT) and plain JAX",
        description="Speed, peak RSS and fine-tuning quality of pockjax, PyTorch + transformers"
                    " (full, LoRA, sparse) and plain JAX on the same model, data and machine;"
                    " every row in its own process, rows interleaved over repetitions.")
    # Literal choices (not common.MODELS): importing the bench modules here would
    # slow every `pockjax` command down.
    p.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "tiny", "llama-1b"],
                   help="smollm2-135m (pretrained), tiny (random, for tests), llama-1b (random, ~1.0B)")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                   help="where the rows train (gpu: an NVIDIA GPU; the IREE row is left out)")
    p.add_argument("--workload", default="llama", choices=["llama", "mobilenetv2", "minilm"],
                   help="llama (default: the LLaMA fine-tuning rows), mobilenetv2 (MobileNetV2 on"
                        " MNIST-5k images) or minilm (the all-MiniLM-L6-v2 encoder on tweet_polarity)")
    p.add_argument("--batch", type=positive_int, default=4, action=_Given,
                   help="rows per step (llama; the classifier workloads take --batch-size)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="examples per step (default: --batch for llama, 32 images for mobilenetv2,"
                        " 16 texts for minilm)")
    p.add_argument("--image-size", type=positive_int, default=224,
                   help="mobilenetv2: image height and width (MNIST resized)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per row/text (same as --seq; minilm default 128)")
    p.add_argument("--seq", type=positive_int, default=None,
                   help="tokens per row (default: 128; 192 for tiny and llama-1b)")
    p.add_argument("--reps", type=positive_int, default=2, help="rounds of the speed phase")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps per process")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps per process")
    p.add_argument("--rows", default=None, help="comma-separated speed rows (default: all; 'none': skip)")
    p.add_argument("--quality-steps", type=non_negative_int, default=0,
                   help="fine-tuning steps of the quality phase (0: no quality phase)")
    p.add_argument("--quality-rows", default=None, help="comma-separated quality rows")
    p.add_argument("--quality-batch", type=positive_int, default=8)
    p.add_argument("--quality-seq", type=positive_int, default=None)
    p.add_argument("--eval-examples", type=positive_int, default=40, action=_Given,
                   help="held-out examples scored in the quality phase (llama: by exact match,"
                        " default 40; mobilenetv2/minilm: accuracy, default 500)")
    p.add_argument("--lr", type=positive_finite_float, default=None,
                   help="AdamW learning rate of the full rows (default 3e-4; Adam 1e-3 for mobilenetv2,"
                        " 1e-4 for minilm)")
    p.add_argument("--lora-lr", type=positive_finite_float, default=1e-3, help="... of the LoRA row")
    p.add_argument("--sparse-lr", type=positive_finite_float, default=1e-3,
                   help="... of the sparse rows (paper, norm-only, channels, requires_grad, frozen)")
    p.add_argument("--blocks", type=positive_int, default=None,
                   help="last blocks of the paper scheme (default: the registry's depth rule,"
                        " see pockjax/schemes.py paper_blocks)")
    p.add_argument("--threads", type=positive_int, default=None, help="PyTorch threads (default: all cores)")
    p.add_argument("--torch-mkl-any-cpu", action="store_true",
                   help="run the PyTorch rows with Intel MKL's CPU-vendor check answered 'Intel'"
                        " (on a non-Intel x86 CPU MKL otherwise takes its generic kernels; needs a"
                        " C compiler)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--timeout", type=positive_finite_float, default=1800.0, help="seconds per row process")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                   help="combine earlier runs' results.json (a speed run and a quality run) into --out")
    p.add_argument("--history", nargs="+", metavar="RUN",
                   help="print the speed goals of earlier runs (results.json files or their"
                        " directories) side by side, round by round, and exit")
    p.add_argument("--plot", metavar="PNG", help="with --history: also draw the runs' ratios to PNG")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd, batch_given=False, eval_examples_given=False)

"""``pockjax bench``: the side-by-side benchmark from the command line.

Bad input raises a :class:`~pockjax.errors.PockjaxError`, which :mod:`pockjax.cli`
prints in one line (exit status 2); any other exception is a bug and shows its
traceback.
"""

from __future__ import annotations

import argparse

from pockjax._cli_args import non_negative_int, positive_finite_float, positive_int


def _cmd(args: argparse.Namespace) -> int:
    import sys

    from benchmarks.harness.common import BenchConfig, default_seq
    from benchmarks.harness.rows import QUALITY_ROWS, ROWS, default_rows
    from benchmarks.harness.runner import run

    def names(text, default):
        if text is None:
            return list(default)
        if text.strip() in ("", "none"):
            return []
        out = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in out if t not in ROWS]
        if bad:
            print(f"pockjax bench: unknown rows {bad}; rows: {', '.join(ROWS)}", file=sys.stderr)
            raise SystemExit(2)
        return out

    if args.history:
        from benchmarks.harness.history import history, history_table

        h = history(args.history)
        if not h["runs"]:
            print("pockjax bench --history: none of these runs has a speed phase", file=sys.stderr)
            return 2
        print(history_table(h), end="")
        if args.plot:
            from benchmarks.harness.history import plot_history

            if plot_history(h, args.plot) is None:
                print("pockjax bench --plot: needs matplotlib (pip install matplotlib)", file=sys.stderr)
                return 2
            print(f"written: {args.plot}")
        return 0
    if args.plot:  # without --history
        print("pockjax bench: --plot goes with --history", file=sys.stderr)
        return 2
    if args.merge:
        from benchmarks.harness.runner import markdown_table, merge

        results = merge(args.merge, args.out)
        print(markdown_table(results))
        return 0
    if args.list:
        for name, row in ROWS.items():
            print(f"{name:22s} {row.description}")
        return 0
    seq = default_seq(args.model) if args.seq is None else args.seq
    cfg = BenchConfig(model=args.model, device=args.device, batch=args.batch, seq=seq, warmup=args.warmup,
                      steps=args.steps, lr=args.lr, lora_lr=args.lora_lr, sparse_lr=args.sparse_lr,
                      blocks=args.blocks, threads=args.threads,
                      torch_mkl_any_cpu=args.torch_mkl_any_cpu, quality_steps=args.quality_steps,
                      quality_batch=args.quality_batch, quality_seq=args.quality_seq,
                      eval_examples=args.eval_examples, seed=args.seed)
    if min(cfg.batch, cfg.seq, cfg.steps) < 1 or cfg.warmup < 0 or cfg.quality_steps < 0:
        print("pockjax bench: --batch, --seq and --steps must be >= 1, --warmup and"
              " --quality-steps >= 0", file=sys.stderr)
        return 2
    from pockjax.data.batching import SequenceLengthError

    try:
        results = run(cfg, rows=names(args.rows, default_rows(cfg.device)), reps=args.reps,
                      quality_rows=names(args.quality_rows, QUALITY_ROWS), out=args.out,
                      timeout=args.timeout, progress=not args.no_progress)
    except SequenceLengthError as e:  # says which flag sets the length; pockjax.cli prints it
        raise SequenceLengthError(f"{e} (--seq for the speed phase, --quality-seq for the quality phase)") from None
    from benchmarks.harness.runner import markdown_table

    print(markdown_table(results))
    print(f"written: {args.out}/results.json, results.md, results.png")
    failed = [n for n, s in results["speed"].items() if s["errors"]] + \
             [n for n, q in results["quality"].items() if q.get("error")]
    return 1 if failed else 0


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
    p.add_argument("--batch", type=positive_int, default=4)
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
    p.add_argument("--eval-examples", type=positive_int, default=40,
                   help="held-out examples scored by exact match in the quality phase")
    p.add_argument("--lr", type=positive_finite_float, default=3e-4, help="AdamW learning rate of the full rows")
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
    p.set_defaults(func=_cmd)

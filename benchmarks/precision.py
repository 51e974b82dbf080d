"""SmolLM2's paper-scheme step in fp32, bf16, int8-frozen and int4-frozen: speed, memory, quality.

Two parts:

* **step** (default): the ``pockjax finetune`` step (paper scheme, AdamW, 8 x 64
  tokens, answer window) for each precision, all in one process; rounds go
  through the precisions in turn so that machine noise hits each alike, and
  the table gives the median step time of each, the median over rounds of its
  ratio to fp32 within a round (goal for int8: at most 1.2x), XLA's
  temporaries and argument bytes.
* **--finetune TASK...**: ``pockjax finetune`` per precision in a fresh
  process each (sequentially), reading its peak RSS from the kernel
  (``wait4``) and its held-out exact match from ``metrics.json``; ratios of
  peak RSS to the fp32 run (goals: int4 at most 0.5x, bf16 at most 0.7x) and
  exact match against fp32's (goal: within 3 points).

Usage: ``python benchmarks/precision.py [--rounds 15] [--finetune reverse_words uppercase]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = {"fp32": [], "bf16": ["--dtype", "bf16"], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"]}


def step_table(rounds: int) -> None:
    import jax
    import jax.numpy as jnp

    import pockjax

    pockjax.keep_step_memory(quiet=True)
    from pockjax.data import Batcher, train_eval_split
    from pockjax.models import llama
    from pockjax.train.finetune import FinetuneConfig, _compute_precision, _load_mixed, make_optimizer
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import ANSWER_STEP_XLA_OPTIONS, answer_train_step

    train, _ = train_eval_split("reverse_words", 4000, 0, seed=0)
    runs = {}
    for mode, flags in MODES.items():
        cfg = FinetuneConfig(dtype="bf16" if "bf16" in flags else "fp32",
                             quantize=flags[1] if flags[:1] == ["--quantize"] else "none")
        if mode == "fp32":
            model, tok = llama.load_pretrained(cfg.model)
            graphdef, params = llama.split(model)
        else:
            model, tok = _load_mixed(cfg, cfg.model)
            graphdef, params = model.graphdef, model.params
        scheme = llama_scheme("paper", model.config)
        tx = make_optimizer("adamw")
        batcher = Batcher(tok, train, batch_size=8, seed=0, max_seq_len=model.config.max_seq_len)
        step = pockjax.compile(answer_train_step(graphdef, tx, batcher.answer_window, health=scheme),
                               scheme=scheme, xla_options=ANSWER_STEP_XLA_OPTIONS,
                               precision=_compute_precision(cfg.dtype))
        opt = pockjax.init_opt_state(tx, params, scheme)
        batch = {k: jnp.asarray(v) for k, v in batcher.batch(0).items()}
        mem = step.lower(params, opt, batch).compile().memory_analysis()
        for _ in range(2):
            params, opt, loss, _ = step(params, opt, batch)
        runs[mode] = {"step": step, "state": [params, opt], "batch": batch, "times": [],
                      "temp": mem.temp_size_in_bytes, "args": mem.argument_size_in_bytes,
                      "weights": pockjax.quant.tree_nbytes(params)}
        print(f"{mode}: compiled, loss {float(loss):.4f}", flush=True)
    ratios = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode, run in runs.items():
            t = time.perf_counter()
            p, o, loss, _ = run["step"](*run["state"], run["batch"])
            jax.block_until_ready(loss)
            run["times"].append(time.perf_counter() - t)
            run["state"] = [p, o]
        for mode in MODES:
            ratios[mode].append(runs[mode]["times"][-1] / runs["fp32"]["times"][-1])
    print(f"\nSmolLM2-135M paper step, batch 8 x 64, {rounds} rounds ({jax.devices()[0].device_kind})")
    print("| precision | step (s) | vs fp32 (median of round ratios) | weights held (MB) | XLA temp (MB) | XLA args (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, run in runs.items():
        print(f"| {mode} | {statistics.median(run['times']):.3f} | {statistics.median(ratios[mode]):.3f}x |"
              f" {run['weights'] / 1e6:.0f} | {run['temp'] / 1e6:.0f} | {run['args'] / 1e6:.0f} |")
    r8 = statistics.median(ratios["int8"])
    print(f"goal: int8-frozen step at most 1.2x fp32: {r8:.3f}x, {'met' if r8 <= 1.2 else 'NOT met'}")


def _finetune(task: str, flags: list[str], out: str) -> dict:
    cmd = [sys.executable, "-m", "pockjax.cli", "finetune", "--task", task, "--out", out, "--no-progress", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    return {"rss": usage.ru_maxrss * 1024, "acc": metrics["accuracy_after"], "s_step": metrics["seconds_per_step"]}


def finetune_table(tasks: list[str]) -> None:
    for task in tasks:
        rows = {}
        with tempfile.TemporaryDirectory() as d:
            for mode, flags in MODES.items():
                rows[mode] = _finetune(task, flags, os.path.join(d, mode))
                print(f"{task} {mode}: {rows[mode]}", flush=True)
        base = rows["fp32"]
        print(f"\npockjax finetune --task {task} (SmolLM2-135M, paper scheme, 100 steps), one process each")
        print("| precision | peak RSS (GB) | vs fp32 | s/step | held-out exact match | vs fp32 (points) |")
        print("|---|---:|---:|---:|---:|---:|")
        for mode, r in rows.items():
            print(f"| {mode} | {r['rss'] / 1e9:.2f} | {r['rss'] / base['rss']:.2f}x | {r['s_step']:.2f} |"
                  f" {100 * r['acc']:.1f}% | {100 * (r['acc'] - base['acc']):+.1f} |")
        goals = [("int4 peak RSS <= 0.5x fp32", rows["int4"]["rss"] / base["rss"] <= 0.5),
                 ("bf16 peak RSS <= 0.7x fp32", rows["bf16"]["rss"] / base["rss"] <= 0.7),
                 ("int4 exact match within 3 points", abs(rows["int4"]["acc"] - base["acc"]) <= 0.03),
                 ("bf16 exact match within 3 points", abs(rows["bf16"]["acc"] - base["acc"]) <= 0.03)]
        for name, ok in goals:
            print(f"goal: {name}: {'met' if ok else 'NOT met'}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--finetune", nargs="*", metavar="TASK", default=None,
                    help="run pockjax finetune per precision on these tasks instead of the step table")
    args = ap.parse_args(argv)
    if args.finetune is not None:
        finetune_table(args.finetune or ["reverse_words"])
    else:
        step_table(args.rounds)


if __name__ == "__main__":
    main()

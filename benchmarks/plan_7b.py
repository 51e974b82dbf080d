"""Plan the memory of a LLaMA-2-7B fine-tuning step from abstract shapes.

Nothing of the model is allocated: the step is traced with ``jax.ShapeDtypeStruct``
arguments and the liveness analysis runs on the jaxpr. Prints the full and sparse
peaks with their breakdown, the paper's Jetson figures beside them, the time taken, and
this process's peak RSS (to show that no weights were allocated).

    python benchmarks/plan_7b.py [--seq 512] [--batch 1] [--budget-gb 64] [--scan] [--plot DIR]
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys
import time

import jax
import jax.numpy as jnp
import optax

from pockjax.memory import format_bytes, plan, plot_timeline
from pockjax.memory.llama_shapes import LlamaShape, abstract_train_args, make_train_step, paper_trainable

PAPER_GB = {"full": 43.1, "sparse": 31.2}  # PockEngine, LlamaV2-7B on Jetson AGX Orin


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget-gb", type=float, default=64.0)
    ap.add_argument("--scan", action="store_true", help="scan over stacked layers")
    ap.add_argument("--schedule", default="program", choices=("program", "greedy", "eager_update"))
    ap.add_argument("--fusion", default="xla", choices=("none", "single", "xla"))
    ap.add_argument("--no-donate", action="store_true", help="do not donate params / optimizer state")
    ap.add_argument("--sparse-first-layer", type=int, default=0,
                    help="sparse: blocks before this one are frozen entirely")
    ap.add_argument("--plot", default=None, help="directory for timeline plots")
    a = ap.parse_args(argv)

    cfg = LlamaShape.llama2_7b(n_layers=a.layers, scan_layers=a.scan)
    opt = optax.adamw(1e-4)
    print(f"LLaMA-2-7B shapes: {cfg.n_params / 1e9:.2f} B params, bf16, AdamW (bf16 moments), "
          f"batch {a.batch}, seq {a.seq}, {'scan' if a.scan else 'unrolled'} layers, "
          f"schedule={a.schedule}, fusion={a.fusion}, donate={'no' if a.no_donate else 'params+opt_state'}")
    rss0 = _rss()
    results = {}
    sparse_rule = functools.partial(paper_trainable, first_layer=a.sparse_first_layer)
    for name, trainable in (("full", None), ("sparse", sparse_rule)):
        args, roles = abstract_train_args(cfg, opt, batch=a.batch, seq=a.seq, trainable=trainable)
        step = make_train_step(cfg, opt, trainable)
        # full: (params, opt_state, batch); sparse: (train, frozen, opt_state, batch)
        donate = () if a.no_donate else ((0, 1) if trainable is None else (0, 2))
        t0 = time.perf_counter()
        p = plan(step, args, roles=roles, donate_argnums=donate, budget_gb=a.budget_gb,
                 schedule=a.schedule, fusion=a.fusion)
        dt = time.perf_counter() - t0
        n_train = sum(x.size for x in jax.tree.leaves(args[0]))
        print(f"\n== FT-{name}: {n_train / 1e9:.2f} B trained params; planned in {dt:.1f} s; "
              f"paper (Jetson): {PAPER_GB[name]} GB")
        print(p.summary())
        print("  largest buffers at the peak:")
        for lv in p.report.live_at_peak[:5]:
            print(f"    {format_bytes(lv.size):>12} {lv.category:<17} {lv.aval:<22} {lv.origin[:90]}")
        results[name] = p
        if a.plot:
            print("  wrote", plot_timeline(p.report, f"{a.plot}/plan_7b_{name}"))
    rss1 = _rss()
    full, sparse = results["full"].peak_bytes, results["sparse"].peak_bytes
    print(f"\nsparse / full = {sparse / full:.3f} (paper: {PAPER_GB['sparse'] / PAPER_GB['full']:.3f})")
    print(f"peak RSS of this process: {format_bytes(rss1)} (before planning {format_bytes(rss0)}); "
          f"7B bf16 weights alone would be {format_bytes(cfg.n_params * 2)}")
    if a.plot:
        print("  wrote", plot_timeline(results["sparse"].report, f"{a.plot}/plan_7b_full_vs_sparse",
                                       before=results["full"].report, titles=("FT-full", "sparse")))
    return {k: v.peak_bytes for k, v in results.items()}


if __name__ == "__main__":
    sys.exit(main() and 0)

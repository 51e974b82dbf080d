"""Plan the memory of a LLaMA-2-7B fine-tuning step from abstract shapes.

The model is the Flax LLaMA (:mod:`pockjax.models.llama`, ``LlamaConfig.llama2_7b()``),
built with ``nnx.eval_shape``: nothing of it is allocated. The step is traced with
``jax.ShapeDtypeStruct`` arguments, rewritten by ``pockjax.compile``'s default passes for
the scheme (full, and ``paper`` of :mod:`pockjax.schemes`: the one ``pockjax finetune``
trains) and analysed. Prints the full and sparse peaks in program order and with
``inplace_update`` with their breakdown, the paper's Jetson figures beside them, the
time taken, and this process's peak RSS (to show that no weights were allocated).

    python benchmarks/plan_7b.py [--seq 512] [--batch 1] [--blocks N] [--scan] [--plot DIR]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import jax.numpy as jnp

from pockjax.memory import format_bytes, plot_timeline
from pockjax.memory.llama_plan import plan_llama
from pockjax.models.llama import LlamaConfig

PAPER_GB = {"full": 43.1, "paper": 31.2}  # PockEngine, LlamaV2-7B on Jetson AGX Orin


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
    ap.add_argument("--blocks", type=int, default=None, help="last blocks the paper scheme trains (default:"
                    " pockjax.schemes.paper_blocks)")
    ap.add_argument("--plot", default=None, help="directory for timeline plots")
    a = ap.parse_args(argv)

    cfg = LlamaConfig.llama2_7b(n_layers=a.layers, scan_layers=a.scan)
    print(f"LLaMA-2-7B (Flax, from shapes): {cfg.num_params() / 1e9:.2f} B params, bf16, AdamW (bf16 moments), "
          f"batch {a.batch}, seq {a.seq}, {'scan' if a.scan else 'unrolled'} layers, "
          f"schedule={a.schedule}, fusion={a.fusion}, donate={'no' if a.no_donate else 'params+opt_state'}")
    rss0 = _rss()
    results = {}
    for name in ("full", "paper"):
        t0 = time.perf_counter()
        p = plan_llama(cfg, name, dtype=jnp.bfloat16, batch=a.batch, seq=a.seq, blocks=a.blocks,
                       donate=not a.no_donate, schedule=a.schedule, fusion=a.fusion)
        dt = time.perf_counter() - t0
        print(f"\n== {p.scheme.name}: {p.trainable / 1e9:.2f} B trained params; planned in {dt:.1f} s; "
              f"paper (Jetson): {PAPER_GB[name]} GB")
        for label, rep in (("program order", p.program), ("with inplace_update", p.inplace)):
            print(f"-- {label}:")
            print(rep.summary(a.budget_gb * 2**30))
        print("  largest buffers at the peak (with inplace_update):")
        for lv in p.inplace.live_at_peak[:5]:
            print(f"    {format_bytes(lv.size):>12} {lv.category:<17} {lv.aval:<22} {lv.origin[:90]}")
        results[name] = p
        if a.plot:
            print("  wrote", plot_timeline(p.inplace, f"{a.plot}/plan_7b_{name}"))
    rss1 = _rss()
    full, sparse = results["full"].inplace.peak_bytes, results["paper"].inplace.peak_bytes
    print(f"\npaper / full (with inplace_update) = {sparse / full:.3f}"
          f" (PockEngine: {PAPER_GB['paper'] / PAPER_GB['full']:.3f})")
    print(f"peak RSS of this process: {format_bytes(rss1)} (before planning {format_bytes(rss0)}); "
          f"7B bf16 weights alone would be {format_bytes(cfg.num_params() * 2)}")
    if a.plot:
        print("  wrote", plot_timeline(results["paper"].inplace, f"{a.plot}/plan_7b_full_vs_paper",
                                       before=results["full"].inplace, titles=("FT-full", "paper")))
    return {k: (v.program.peak_bytes, v.inplace.peak_bytes) for k, v in results.items()}


if __name__ == "__main__":
    sys.exit(main() and 0)

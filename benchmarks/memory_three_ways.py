"""A train step's memory measured three ways: planner, XLA's analysis, process peak RSS.

For a SmolLM2-135M-shaped LLaMA (fp32, AdamW, batch 1) full and sparse fine-tuning with
the parameters and optimizer state donated: the planner's peak (from abstract shapes),
XLA's ``argument + output + temp - alias``, and the peak RSS of a fresh process that
builds the model, compiles the step and runs two steps, minus the peak RSS of a fresh
process that only imports JAX and runs one tiny jitted op. RSS also counts XLA's
compiler and the executable, so it is an upper bound on the step's buffers.

    python benchmarks/memory_three_ways.py [--seq 256] [--model smollm2|tiny]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _memory_workloads as W  # noqa: E402
import optax  # noqa: E402

from pockjax.memory import format_bytes, peak_rss  # noqa: E402
from pockjax.memory.llama_shapes import LlamaShape, plan_llama, paper_trainable  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    a = ap.parse_args(argv)
    cfg = LlamaShape.smollm2_135m() if a.model == "smollm2" else LlamaShape(vocab=512, dim=128, n_layers=4, n_heads=4, hidden=344)
    base = peak_rss(W.baseline, timeout=300)
    print(f"baseline (import jax + one tiny jit): {format_bytes(base.peak_bytes)}")
    print("| step | planner | XLA total | peak RSS - baseline | planner/XLA | (RSS-base)/XLA |")
    print("|---|---|---|---|---|---|")
    for sparse in (False, True):
        p = plan_llama(cfg, optax.adamw(1e-4), batch=1, seq=a.seq, trainable=paper_trainable if sparse else None)
        r = peak_rss(W.train_llama_steps, kwargs=dict(kind=a.model, sparse=sparse, seq=a.seq), timeout=600)
        x = r.result["xla"]["total"]
        rss = r.peak_bytes - base.peak_bytes
        name = "sparse (paper_trainable)" if sparse else "full"
        print(f"| {name} | {format_bytes(p.peak_bytes)} | {format_bytes(x)} | {format_bytes(rss)} | "
              f"{p.peak_bytes / x:.3f} | {rss / x:.3f} |", flush=True)


if __name__ == "__main__":
    main()

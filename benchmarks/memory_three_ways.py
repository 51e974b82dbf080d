"""A train step's memory measured three ways: planner, XLA's analysis, process peak RSS.

For SmolLM2-135M (the Flax LLaMA, fp32, AdamW, batch 1), full fine-tuning and the
``paper`` scheme of :mod:`pockjax.schemes` (the one ``pockjax finetune`` trains),
compiled by ``pockjax.compile`` with the parameters and optimizer state donated: the
planner's peak (``pockjax plan``'s program order, from abstract shapes), XLA's
``argument + output + temp - alias``, and the peak RSS of a fresh process that builds
the model, compiles the step and runs two steps, minus the peak RSS of a fresh process
that only imports JAX and runs one tiny jitted op. RSS also counts XLA's compiler and
the executable, so it is an upper bound on the step's buffers.

    python benchmarks/memory_three_ways.py [--seq 256] [--model smollm2-135m|tiny]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _memory_workloads as W  # noqa: E402
from _memory_rss import peak_rss  # noqa: E402

from pockjax.memory import format_bytes  # noqa: E402
from pockjax.memory.llama_plan import plan_llama  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--model", default="smollm2-135m", choices=W.MODELS)
    a = ap.parse_args(argv)
    cfg = W.model_config(a.model, a.seq)
    base = peak_rss(W.baseline, timeout=300)
    print(f"baseline (import jax + one tiny jit): {format_bytes(base.peak_bytes)}")
    print("| step | planner | XLA total | peak RSS - baseline | planner/XLA | (RSS-base)/XLA |")
    print("|---|---|---|---|---|---|")
    for scheme in ("full", "paper"):
        p = plan_llama(cfg, scheme, batch=1, seq=a.seq)
        r = peak_rss(W.train_llama_steps, kwargs=dict(kind=a.model, scheme=scheme, seq=a.seq), timeout=600)
        x = r.result["xla"]["total"]
        rss = r.peak_bytes - base.peak_bytes
        peak = p.program.peak_bytes
        print(f"| {p.scheme.name} | {format_bytes(peak)} | {format_bytes(x)} | {format_bytes(rss)} | "
              f"{peak / x:.3f} | {rss / x:.3f} |", flush=True)


if __name__ == "__main__":
    main()

"""Regenerate the timeline pictures of docs/memory.md (from abstract shapes, ~1 min).

The steps are the Flax LLaMA's (:func:`pockjax.memory.llama_plan.plan_llama`), in
program order, with the schemes ``pockjax finetune`` trains (:mod:`pockjax.schemes`).

    python benchmarks/plot_memory_docs.py [--out docs/images]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from pockjax.memory import plot_timeline
from pockjax.memory.llama_plan import plan_llama
from pockjax.models.llama import LlamaConfig


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/images")
    a = ap.parse_args(argv)
    smol = LlamaConfig.smollm2_135m()
    kept = plan_llama(smol, "full", seq=256, donate=False).program
    donated = plan_llama(smol, "full", seq=256).program
    print(plot_timeline(donated, f"{a.out}/memory_smollm2_donation", before=kept,
                        titles=("SmolLM2-135M, full FT, nothing donated",
                                "params + optimizer state donated"), max_points=600))
    paper = plan_llama(smol, "paper", seq=256)
    print(plot_timeline(paper.program, f"{a.out}/memory_smollm2_full_vs_sparse", before=donated,
                        titles=("SmolLM2-135M, full FT (donated)", f"{paper.scheme.name}"),
                        max_points=600))
    l7 = LlamaConfig.llama2_7b()
    full = plan_llama(l7, "full", dtype=jnp.bfloat16, seq=512).program
    sp = plan_llama(l7, "paper", dtype=jnp.bfloat16, seq=512)
    print(plot_timeline(sp.program, f"{a.out}/memory_llama2_7b_full_vs_sparse", before=full,
                        titles=("LLaMA-2-7B, bf16, full FT", f"{sp.scheme.name}"), max_points=600))


if __name__ == "__main__":
    main()

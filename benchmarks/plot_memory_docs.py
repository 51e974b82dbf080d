"""Regenerate the timeline pictures of docs/memory.md (from abstract shapes, ~30 s).

    python benchmarks/plot_memory_docs.py [--out docs/images]
"""

from __future__ import annotations

import argparse

import optax

from pockjax.memory import plot_timeline
from pockjax.memory.llama_shapes import LlamaShape, paper_trainable, plan_llama


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/images")
    a = ap.parse_args(argv)
    opt = optax.adamw(1e-4)
    smol = LlamaShape.smollm2_135m()
    kept = plan_llama(smol, opt, seq=256, donate=False).report
    donated = plan_llama(smol, opt, seq=256, donate=True).report
    print(plot_timeline(donated, f"{a.out}/memory_smollm2_donation", before=kept,
                        titles=("SmolLM2-135M shapes, full FT, nothing donated",
                                "params + optimizer state donated"), max_points=600))
    sparse = plan_llama(smol, opt, seq=256, trainable=paper_trainable).report
    print(plot_timeline(sparse, f"{a.out}/memory_smollm2_full_vs_sparse", before=donated,
                        titles=("SmolLM2-135M shapes, full FT (donated)", "sparse: paper_trainable"),
                        max_points=600))
    l7 = LlamaShape.llama2_7b()
    full = plan_llama(l7, opt, seq=512).report
    sp = plan_llama(l7, opt, seq=512, trainable=paper_trainable).report
    print(plot_timeline(sp, f"{a.out}/memory_llama2_7b_full_vs_sparse", before=full,
                        titles=("LLaMA-2-7B shapes, bf16, full FT", "sparse: paper_trainable"), max_points=600))


if __name__ == "__main__":
    main()

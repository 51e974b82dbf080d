"""Planner peak vs XLA's ``memory_analysis()`` on small train steps (CPU).

For each model: full or sparse fine-tuning with AdamW, with and without donating the
parameters and optimizer state; XLA's total = argument + output + temp - alias, and the
planner's peak under each fusion model, as a ratio to it. Compiles from abstract shapes
(nothing is run). Prints a Markdown table.

    python benchmarks/memory_vs_xla.py [--only NAME ...] [--seq 256]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

from pockjax.memory import compare_with_xla, plan
from pockjax.memory.llama_shapes import LlamaShape, abstract_train_args, make_train_step, paper_trainable


def mlp(width=256, depth=4, batch=256):
    opt = optax.adamw(1e-3)
    params = [{"w": jax.ShapeDtypeStruct((width, width), jnp.float32),
               "b": jax.ShapeDtypeStruct((width,), jnp.float32)} for _ in range(depth)]

    def loss(p, x):
        h = x
        for layer in p:
            h = jax.nn.gelu(h @ layer["w"] + layer["b"])
        return jnp.mean(h**2)

    def step(p, s, x):
        l, g = jax.value_and_grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    args = (params, jax.eval_shape(opt.init, params), jax.ShapeDtypeStruct((batch, width), jnp.float32))
    return step, args, ("param", "opt_state", "batch"), (0, 1)


def llama(cfg, trainable=None, batch=2, seq=128):
    opt = optax.adamw(1e-3)
    args, roles = abstract_train_args(cfg, opt, batch=batch, seq=seq, trainable=trainable)
    return make_train_step(cfg, opt, trainable), args, roles, (0, 1) if trainable is None else (0, 2)


def models(seq):
    tiny = dict(vocab=512, dim=128, n_layers=4, n_heads=4, hidden=344)
    return {
        "mlp 4x256, batch 256": lambda: mlp(),
        "mlp 4x256, batch 4096": lambda: mlp(batch=4096),
        "llama tiny (d128, 4L), full": lambda: llama(LlamaShape(**tiny)),
        "llama tiny, scan layers": lambda: llama(LlamaShape(**tiny, scan_layers=True)),
        "llama tiny, sparse": lambda: llama(LlamaShape(**tiny), paper_trainable),
        "llama wide (d256, 2L, V2048)": lambda: llama(LlamaShape(vocab=2048, dim=256, n_layers=2, n_heads=4, hidden=688)),
        "llama tiny, bf16": lambda: llama(LlamaShape(**tiny, dtype=jnp.bfloat16)),
        f"SmolLM2-135M shapes, full, b1 s{seq}": lambda: llama(LlamaShape.smollm2_135m(), batch=1, seq=seq),
        f"SmolLM2-135M shapes, sparse, b1 s{seq}": lambda: llama(LlamaShape.smollm2_135m(), paper_trainable, batch=1, seq=seq),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None, help="substrings of model names")
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args(argv)
    print("| model | donated | XLA total (MiB) | planner xla-fusion | planner no-fusion | planner greedy | compile s |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, make in models(a.seq).items():
        if a.only and not any(s in name for s in a.only):
            continue
        step, args, roles, donate = make()
        for don in (donate, ()):
            t0 = time.perf_counter()
            c = compare_with_xla(step, args, roles=roles, donate_argnums=don)
            ratios = [c.ratio]
            for kw in (dict(fusion="none"), dict(schedule="greedy")):
                p = plan(step, args, roles=roles, donate_argnums=don, **kw)
                ratios.append(p.peak_bytes / c.xla["total"])
            row = (name, "yes" if don else "no", c.xla["total"] / 2**20, *ratios, c.compile_seconds)
            rows.append(row)
            print("| {} | {} | {:.1f} | {:.3f} | {:.3f} | {:.3f} | {:.1f} |".format(*row), flush=True)
    return rows


if __name__ == "__main__":
    main()

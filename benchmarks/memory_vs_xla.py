"""Planner peak vs XLA's ``memory_analysis()`` on small train steps (CPU).

For each model: full or sparse fine-tuning with AdamW, with and without donating the
parameters and optimizer state; XLA's total = argument + output + temp - alias, and the
planner's peak under each fusion model, as a ratio to it. Compiles from abstract shapes
(nothing is run). The LLaMA rows are the Flax model (:mod:`pockjax.models.llama`)
compiled by ``pockjax.compile`` with a scheme of :mod:`pockjax.schemes` (``full``, or
``paper``: the one ``pockjax finetune`` trains); the planner analyses the compiled
graph (:func:`pockjax.memory.memory_report`). Prints a Markdown table.

    python benchmarks/memory_vs_xla.py [--only NAME ...] [--seq 256]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import pockjax
from pockjax.memory import analyze, compare_with_xla, memory_report, plan
from pockjax.memory.llama_plan import abstract_llama_step
from pockjax.models.llama import LlamaConfig


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


def llama(cfg, scheme="full", batch=2, seq=128, dtype=jnp.float32):
    w = abstract_llama_step(cfg, scheme, batch=batch, seq=seq, dtype=dtype, optimizer=optax.adamw(1e-3))
    return w.step, w.args, w.scheme


def models(seq):
    tiny = dict(vocab=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, hidden_dim=344, max_seq_len=512)
    smol = LlamaConfig.smollm2_135m(max_seq_len=max(seq, 512))
    return {
        "mlp 4x256, batch 256": lambda: mlp(),
        "mlp 4x256, batch 4096": lambda: mlp(batch=4096),
        "llama tiny (d128, 4L), full": lambda: llama(LlamaConfig(**tiny)),
        "llama tiny, scan layers": lambda: llama(LlamaConfig(**tiny, scan_layers=True)),
        "llama tiny, paper": lambda: llama(LlamaConfig(**tiny), "paper"),
        "llama wide (d256, 2L, V2048)": lambda: llama(LlamaConfig(**{**tiny, "vocab": 2048, "dim": 256,
                                                                     "n_layers": 2, "hidden_dim": 688})),
        "llama tiny, bf16": lambda: llama(LlamaConfig(**tiny), dtype=jnp.bfloat16),
        f"SmolLM2-135M, full, b1 s{seq}": lambda: llama(smol, batch=1, seq=seq),
        f"SmolLM2-135M, paper, b1 s{seq}": lambda: llama(smol, "paper", batch=1, seq=seq),
    }


def _measure_llama(step, args, scheme, donate):
    t0 = time.perf_counter()
    cs = pockjax.compile(step, scheme=scheme, donate=donate).lower(*args).compile()
    secs = time.perf_counter() - t0
    r = memory_report(cs, donate=donate)
    ratios = [r.ratio, memory_report(cs, donate=donate, fusion="none").after.peak_bytes / r.xla["total"]]
    forwarded = {src for src in cs.passthrough if src is not None}
    mask = [role in ("param", "opt_state", "model_state") and i not in forwarded and donate
            for i, role in enumerate(cs.graph.in_roles)]
    ratios.append(analyze(cs.graph, donate=mask, schedule="greedy").peak_bytes / r.xla["total"])
    return r.xla["total"], ratios, secs


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
        made = make()
        for don in (True, False):
            if len(made) == 3:  # a Flax LLaMA step, compiled by pockjax
                total, ratios, secs = _measure_llama(*made, don)
            else:
                step, args, roles, donate = made
                donate = donate if don else ()
                c = compare_with_xla(step, args, roles=roles, donate_argnums=donate)
                ratios = [c.ratio]
                for kw in (dict(fusion="none"), dict(schedule="greedy")):
                    p = plan(step, args, roles=roles, donate_argnums=donate, **kw)
                    ratios.append(p.peak_bytes / c.xla["total"])
                total, secs = c.xla["total"], c.compile_seconds
            row = (name, "yes" if don else "no", total / 2**20, *ratios, secs)
            rows.append(row)
            print("| {} | {} | {:.1f} | {:.3f} | {:.3f} | {:.3f} | {:.1f} |".format(*row), flush=True)
    return rows


if __name__ == "__main__":
    main()

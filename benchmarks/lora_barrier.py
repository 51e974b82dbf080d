"""What the rank-first barrier of the LoRA adapter-A gradient buys, per device.

``pockjax.transforms.low_rank`` computes ``s G b^T`` rank-first and pins that order
with an ``optimization_barrier`` (XLA's CPU dot is about 3x faster that way at
LLaMA's shapes). This times the LoRA step (rank 8 on q/k/v/o, AdamW, the answer
step of ``pockjax finetune``) with and without the barrier, compiled in one process
and run alternately, on random weights:

    python benchmarks/lora_barrier.py                        # SmolLM2-135M shapes, CPU
    python benchmarks/lora_barrier.py --model llama-1b       # on a GPU machine

Prints the median step time of each variant and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "llama-1b", "tiny"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of --steps steps each")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import llama
    from pockjax.train.steps import ANSWER_STEP_XLA_OPTIONS, answer_train_step
    from pockjax.transforms import low_rank

    # before any JAX computation (a CPU step then reuses its working memory: without
    # it SmolLM2's step here took 0.92 s instead of 0.69 s); a no-op on a GPU
    pockjax.keep_step_memory(quiet=True)
    on_cpu = jax.default_backend() == "cpu"
    if a.model == "smollm2-135m":
        config = llama.LlamaConfig.smollm2_135m()
    elif a.model == "llama-1b":
        from benchmarks.harness.common import random_config
        config = random_config("llama-1b")
    else:
        config = llama.LlamaConfig.tiny()
    graphdef, base = llama.split(llama.Llama(config, rngs=nnx.Rngs(0)))
    scheme = pockjax.UpdateScheme([("layers.*.attn.w[qkvo].kernel", pockjax.lora(8, alpha=16))])
    base = pockjax.add_adapters(base, scheme, seed=0)
    tx = optax.adamw(1e-4)
    rng = np.random.default_rng(0)
    T = min(a.seq, config.max_seq_len)
    mask = np.zeros((a.batch, T), np.float32)
    mask[:, T - a.window:] = 1.0
    batch = {"tokens": jnp.asarray(rng.integers(0, config.vocab, (a.batch, T)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, config.vocab, (a.batch, T)), jnp.int32),
             "loss_mask": jnp.asarray(mask), "loss_start": jnp.full((a.batch,), T - a.window, jnp.int32)}

    variants = {}
    for name, barrier in (("barrier", True), ("no barrier", False)):
        passes = pockjax.default_passes(scheme, sparse_opt_state=True, rank_first_barrier=barrier)
        f = pockjax.compile(answer_train_step(graphdef, tx, a.window), scheme=scheme, passes=passes,
                            xla_options=ANSWER_STEP_XLA_OPTIONS if on_cpu else None)
        p = jax.tree.map(jnp.copy, base)  # the compiled step donates its params
        o = pockjax.init_opt_state(tx, p, scheme)
        p, o, loss = f(p, o, batch)  # compiles
        jax.block_until_ready(loss)
        variants[name] = {"f": f, "p": p, "o": o, "times": []}

    for _ in range(a.rounds):
        for v in variants.values():
            for _ in range(a.steps):
                t = time.perf_counter()
                v["p"], v["o"], loss = v["f"](v["p"], v["o"], batch)
                jax.block_until_ready(loss)
                v["times"].append(time.perf_counter() - t)
    print(f"{a.model} LoRA rank 8 q/k/v/o step, batch {a.batch} x {T}, window {a.window}, "
          f"on {jax.devices()[0].device_kind} (jax {jax.__version__})")
    med = {k: statistics.median(v["times"]) for k, v in variants.items()}
    for k, m in med.items():
        print(f"  {k:>10}: median {m * 1e3:8.2f} ms over {len(variants[k]['times'])} steps")
    print(f"  no barrier / barrier: {med['no barrier'] / med['barrier']:.3f}")
    print(f"  pockjax's default on this backend ({jax.default_backend()}): "
          f"{'barrier' if low_rank._rank_first_barrier() else 'no barrier'}")


if __name__ == "__main__":
    main()

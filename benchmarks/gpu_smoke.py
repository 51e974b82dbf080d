"""pockjax on a GPU: the tiny LLaMA's step against ``jax.jit``, full and sparse.

Run on a machine with an NVIDIA GPU (``python benchmarks/gpu_smoke.py``): it
prints JAX's devices, the largest difference of pockjax's all-full step from
``jax.jit`` of the same step over 5 steps, whether the sparse (paper) step
leaves every frozen tensor bitwise unchanged, and the step times of both.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pockjax
from pockjax.models import llama
from pockjax.schemes import resolve_scheme
from pockjax.train.steps import lm_train_step


def main() -> int:
    print("jax", jax.__version__, jax.devices(), flush=True)
    cfg = llama.LlamaConfig.tiny(vocab=512, dim=256, hidden_dim=768, n_layers=4, max_seq_len=256)
    graphdef, params = llama.split(llama.Llama(cfg, rngs=nnx.Rngs(0)))
    tx = optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (8, 129))
    batch = (jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32),
             jnp.ones((8, 128), jnp.float32))
    step = lm_train_step(graphdef, tx)

    def train(fn, opt_state, n=5):
        p, o = jax.tree.map(jnp.copy, params), opt_state
        times = []
        for _ in range(n):
            t = time.perf_counter()
            p, o, loss = fn(p, o, *batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t)
        return p, o, float(loss), times

    with jax.default_matmul_precision("highest"):
        want = train(jax.jit(step), tx.init(params))
        got = train(pockjax.compile(step, scheme=pockjax.UpdateScheme.full()), tx.init(params))
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])))
        print(f"full vs jax.jit: max |diff| {diff:.2e} over 5 steps; loss {got[2]:.5f} vs {want[2]:.5f};"
              f" step {np.median(got[3][1:]) * 1e3:.2f} ms vs {np.median(want[3][1:]) * 1e3:.2f} ms", flush=True)
        scheme = resolve_scheme("paper", cfg, blocks=1)
        sparse = train(pockjax.compile(step, scheme=scheme), pockjax.init_opt_state(tx, params, scheme))
        rules = scheme.resolve_tree(params)
        frozen_same = all(np.array_equal(np.asarray(a), np.asarray(b))
                          for a, b, r in zip(jax.tree.leaves(sparse[0]), jax.tree.leaves(params), rules)
                          if isinstance(r, pockjax.Frozen))
        trained_moved = any(not np.array_equal(np.asarray(a), np.asarray(b))
                            for a, b, r in zip(jax.tree.leaves(sparse[0]), jax.tree.leaves(params), rules)
                            if not isinstance(r, pockjax.Frozen))
        print(f"paper: frozen bitwise unchanged {frozen_same}, trained moved {trained_moved};"
              f" step {np.median(sparse[3][1:]) * 1e3:.2f} ms", flush=True)
    return 0 if diff <= 1e-4 and frozen_same and trained_moved else 1


if __name__ == "__main__":
    raise SystemExit(main())

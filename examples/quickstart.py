"""Quickstart: sparse fine-tuning of a small LLaMA-style model with pockjax.

A tiny decoder (RMSNorm, causal attention, SwiGLU) is first trained fully on
one synthetic task, then fine-tuned on a shifted task three ways: full
fine-tuning, and two sparse schemes from the PockEngine paper (attention and
the first FFN projection of the last blocks; the same with half the channels).
It prints, for each, the loss reached, what the compiler pruned (equations and
FLOPs, counted on the jaxpr and by XLA), optimizer-state bytes and XLA's
temporary memory.

Run: ``python examples/quickstart.py`` (about a minute on a laptop CPU).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax


@dataclasses.dataclass(frozen=True)
class TinyLlama:
    vocab: int = 32
    dim: int = 64
    heads: int = 4
    hidden: int = 128
    layers: int = 4
    seq: int = 32

    def init(self, key):
        def dense(k, a, b):
            return {"kernel": jax.random.normal(k, (a, b)) / np.sqrt(a)}

        keys = iter(jax.random.split(key, 4 + 7 * self.layers))
        d, h = self.dim, self.hidden
        layers = {}
        for i in range(self.layers):
            layers[str(i)] = {
                "attn_norm": {"scale": jnp.ones(d)},
                "attn": {n: dense(next(keys), d, d) for n in ("wq", "wk", "wv", "wo")},
                "mlp_norm": {"scale": jnp.ones(d)},
                "mlp": {"w1": dense(next(keys), d, h), "w3": dense(next(keys), d, h), "w2": dense(next(keys), h, d)},
            }
        return {
            "embed": {"embedding": 0.5 * jax.random.normal(next(keys), (self.vocab, d))},
            "layers": layers,
            "norm": {"scale": jnp.ones(d)},
            "lm_head": dense(next(keys), d, self.vocab),
        }

    def logits(self, params, tokens):
        def norm(x, scale):
            return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

        x = params["embed"]["embedding"][tokens]
        b, t, d = x.shape
        hd = d // self.heads
        causal = jnp.tril(jnp.ones((t, t), bool))
        for i in range(self.layers):
            p = params["layers"][str(i)]
            h = norm(x, p["attn_norm"]["scale"])
            q, k, v = (
                (h @ p["attn"][n]["kernel"]).reshape(b, t, self.heads, hd) for n in ("wq", "wk", "wv")
            )
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
            a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d) @ p["attn"]["wo"]["kernel"]
            h = norm(x, p["mlp_norm"]["scale"])
            x = x + (jax.nn.silu(h @ p["mlp"]["w1"]["kernel"]) * (h @ p["mlp"]["w3"]["kernel"])) @ p["mlp"]["w2"]["kernel"]
        return norm(x, params["norm"]["scale"]) @ params["lm_head"]["kernel"]

    def loss(self, params, tokens):
        logits = self.logits(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def task_batch(key, model, batch, shift):
    """Sequences whose next token is (token + shift) mod vocab, with noise."""
    start = jax.random.randint(key, (batch, 1), 0, model.vocab)
    seq = (start + shift * jnp.arange(model.seq + 1)) % model.vocab
    return seq.astype(jnp.int32)


def make_step(model, tx):
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(model.loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main(steps: int = 60, batch: int = 16) -> int:
    model = TinyLlama()
    tx = optax.adamw(3e-3)
    key = jax.random.key(0)
    params = model.init(key)

    # Pre-train on shift=1 so that fine-tuning has something to adapt.
    pre = jax.jit(make_step(model, tx), donate_argnums=(0, 1))
    opt_state = tx.init(params)
    for i in range(150):
        params, opt_state, loss = pre(params, opt_state, task_batch(jax.random.fold_in(key, i), model, batch, 1))
    print(f"pre-trained on shift=1: loss {float(loss):.3f}")

    last = model.layers // 2
    paper = {f"layers.{i}.attn.*.kernel": "full" for i in range(last, model.layers)}
    paper.update({f"layers.{i}.mlp.w1.kernel": "full" for i in range(last, model.layers)})
    half = {k: pockjax.channels(0.5) for k in paper}
    schemes = {
        "full": pockjax.UpdateScheme.full(),
        "paper (attn + FFN1, last half)": pockjax.UpdateScheme(paper),
        "paper, half the channels": pockjax.UpdateScheme(half),
    }
    print(f"\n{pockjax.UpdateScheme(paper).describe(params)}\n")
    rows = []
    for name, scheme in schemes.items():
        step = pockjax.compile(make_step(model, tx), scheme=scheme)
        p = jax.tree.map(jnp.copy, params)
        s = pockjax.init_opt_state(tx, p, scheme)
        tokens = task_batch(jax.random.fold_in(key, 10_000), model, batch, 3)
        compiled = step.lower(p, s, tokens).compile()
        t0 = time.perf_counter()
        for i in range(steps):
            p, s, loss = step(p, s, task_batch(jax.random.fold_in(key, 10_000 + i), model, batch, 3))
        loss = float(loss)
        dt = (time.perf_counter() - t0) / steps
        summary = compiled.summary()
        xla_flops = compiled.cost_analysis().get("flops", float("nan"))
        mem = compiled.memory_analysis()
        rows.append((name, loss, summary, xla_flops, s.nbytes, mem.temp_size_in_bytes, dt))

    base_flops = rows[0][3]
    print(f"fine-tuned on shift=3 for {steps} steps (batch {batch}, seq {model.seq}):\n")
    print(f"{'scheme':32s} {'loss':>6s} {'XLA GFLOP':>9s} {'vs full':>7s} {'opt state':>10s} {'XLA temp':>9s} {'ms/step':>8s}")
    for name, loss, summary, xf, opt_bytes, temp, dt in rows:
        print(
            f"{name:32s} {loss:6.3f} {xf / 1e9:9.3f} {xf / base_flops:7.2f} "
            f"{opt_bytes / 1024:8.0f}KB {temp / 1024:7.0f}KB {1000 * dt:8.2f}"
        )
    print("\nwhat sparse_grad + dce pruned (paper scheme):", rows[1][2])
    return 0


if __name__ == "__main__":
    sys.exit(main())

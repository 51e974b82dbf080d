"""Small models written as pure functions over parameter dicts, for tests.

Each model gives ``init(key) -> params`` and ``loss(params, batch) -> scalar``
and ``batch(key)``. Kept tiny so that a compile takes well under a second.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MLP:
    sizes: tuple = (6, 8, 4)
    batch_size: int = 5

    def init(self, key):
        params = {}
        for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            key, k1, k2 = jax.random.split(key, 3)
            params[f"dense{i}"] = {
                "kernel": jax.random.normal(k1, (a, b)) / jnp.sqrt(a),
                "bias": 0.1 * jax.random.normal(k2, (b,)),
            }
        return params

    def loss(self, params, batch):
        x, y = batch
        h = x
        n = len(self.sizes) - 1
        for i in range(n):
            h = h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"]
            if i < n - 1:
                h = jnp.tanh(h)
        return jnp.mean((h - y) ** 2)

    def batch(self, key):
        k1, k2 = jax.random.split(key)
        return (jax.random.normal(k1, (self.batch_size, self.sizes[0])),
                jax.random.normal(k2, (self.batch_size, self.sizes[-1])))


def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A LLaMA-style decoder: RMSNorm, causal attention, SwiGLU, tied-free head."""

    vocab: int = 11
    dim: int = 8
    heads: int = 2
    hidden: int = 12
    layers: int = 2
    seq: int = 5
    batch_size: int = 2
    scan: bool = False

    def _block_init(self, key):
        ks = jax.random.split(key, 7)
        d, h = self.dim, self.hidden
        n = lambda k, s: jax.random.normal(k, s) / jnp.sqrt(s[0])
        return {
            "attn_norm": {"scale": 1.0 + 0.1 * jax.random.normal(ks[6], (d,))},
            "attn": {"wq": {"kernel": n(ks[0], (d, d))}, "wk": {"kernel": n(ks[1], (d, d))},
                     "wv": {"kernel": n(ks[2], (d, d))}, "wo": {"kernel": n(ks[3], (d, d))}},
            "mlp_norm": {"scale": jnp.ones((d,))},
            "mlp": {"w1": {"kernel": n(ks[4], (d, h))}, "w3": {"kernel": n(ks[5], (d, h))},
                    "w2": {"kernel": n(jax.random.fold_in(ks[5], 1), (h, d))}},
        }

    def init(self, key):
        k_emb, k_head, *k_layers = jax.random.split(key, 2 + self.layers)
        blocks = [self._block_init(k) for k in k_layers]
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks) if self.scan else {str(i): b for i, b in enumerate(blocks)}
        return {
            "embed": {"embedding": jax.random.normal(k_emb, (self.vocab, self.dim))},
            "layers": layers,
            "norm": {"scale": jnp.ones((self.dim,))},
            "lm_head": {"kernel": jax.random.normal(k_head, (self.dim, self.vocab)) / jnp.sqrt(self.dim)},
        }

    def _block(self, p, x):
        b, t, d = x.shape
        hd = d // self.heads
        h = rms_norm(x, p["attn_norm"]["scale"])
        q = (h @ p["attn"]["wq"]["kernel"]).reshape(b, t, self.heads, hd)
        k = (h @ p["attn"]["wk"]["kernel"]).reshape(b, t, self.heads, hd)
        v = (h @ p["attn"]["wv"]["kernel"]).reshape(b, t, self.heads, hd)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        mask = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(mask, s, -1e9)
        a = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d)
        x = x + o @ p["attn"]["wo"]["kernel"]
        h = rms_norm(x, p["mlp_norm"]["scale"])
        g = jax.nn.silu(h @ p["mlp"]["w1"]["kernel"]) * (h @ p["mlp"]["w3"]["kernel"])
        return x + g @ p["mlp"]["w2"]["kernel"]

    def logits(self, params, tokens):
        x = params["embed"]["embedding"][tokens]
        if self.scan:
            x, _ = jax.lax.scan(lambda c, p: (self._block(p, c), None), x, params["layers"])
        else:
            for i in range(self.layers):
                x = self._block(params["layers"][str(i)], x)
        x = rms_norm(x, params["norm"]["scale"])
        return x @ params["lm_head"]["kernel"]

    def loss(self, params, batch):
        tokens, targets = batch
        logits = self.logits(params, tokens)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def batch(self, key):
        tokens = jax.random.randint(key, (self.batch_size, self.seq + 1), 0, self.vocab)
        return tokens[:, :-1], tokens[:, 1:]


def make_step(model, tx):
    """An ordinary full fine-tuning step, as a user would write it."""
    import optax

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def nnx_mse_step(model, optimizer, x, y):
    """An ordinary Flax NNX step (mean squared error, ``nnx.Optimizer``), as a user would write it."""
    from flax import nnx

    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

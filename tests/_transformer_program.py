"""A small transformer-shaped train step in plain ``jax.numpy``, for pass tests.

A user program the memory passes are checked on (RMSNorm, rotary attention, SwiGLU,
untied head; parameters in a plain dict, no Flax). It describes no model pockjax
ships: the planner and every command use :mod:`pockjax.models.llama`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

VOCAB, DIM, LAYERS, HEADS, HIDDEN = 128, 32, 2, 2, 64
_SHAPES = {"attn_norm": (DIM,), "wq": (DIM, DIM), "wk": (DIM, DIM), "wv": (DIM, DIM), "wo": (DIM, DIM),
           "ffn_norm": (DIM,), "w1": (DIM, HIDDEN), "w3": (DIM, HIDDEN), "w2": (HIDDEN, DIM)}


def init_params(key: jax.Array) -> dict:
    keys = iter(jax.random.split(key, 2 + LAYERS * len(_SHAPES)))

    def w(shape):
        if len(shape) == 1:
            return jnp.ones(shape, jnp.float32)
        return jax.random.normal(next(keys), shape, jnp.float32) * shape[0] ** -0.5

    return {"embed": w((VOCAB, DIM)), "layers": [{k: w(s) for k, s in _SHAPES.items()} for _ in range(LAYERS)],
            "norm": w((DIM,)), "lm_head": w((DIM, VOCAB))}


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def _rope(x, positions):
    dh = x.shape[-1]
    ang = positions[:, None] * (1.0 / (10000.0 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)))[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def _block(lp, x, positions):
    b, t, d = x.shape
    dh = d // HEADS
    a = _rms_norm(x, lp["attn_norm"])
    q = _rope((a @ lp["wq"]).reshape(b, t, HEADS, dh), positions)
    k = _rope((a @ lp["wk"]).reshape(b, t, HEADS, dh), positions)
    v = (a @ lp["wv"]).reshape(b, t, HEADS, dh)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * dh**-0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, -1e30)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
    x = x + o @ lp["wo"]
    f = _rms_norm(x, lp["ffn_norm"])
    return x + (jax.nn.silu(f @ lp["w1"]) * (f @ lp["w3"])) @ lp["w2"]


def loss_fn(params, batch):
    x = params["embed"][batch["tokens"]]
    positions = jnp.arange(batch["tokens"].shape[1], dtype=jnp.float32)
    for lp in params["layers"]:
        x = _block(lp, x, positions)
    logp = jax.nn.log_softmax(_rms_norm(x, params["norm"]) @ params["lm_head"], axis=-1)
    return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean()


def transformer_step(batch=2, seq=16, opt=None):
    """``(step, (params, opt_state, batch))`` with random weights and tokens."""
    opt = opt or optax.adamw(1e-3)

    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    params = init_params(jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (batch, seq), 0, VOCAB)
    return step, (params, opt.init(params), {"tokens": tok, "targets": jnp.roll(tok, -1, axis=1)})

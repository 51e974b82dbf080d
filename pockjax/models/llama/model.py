"""A Flax NNX LLaMA: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The numerics follow Hugging Face ``LlamaForCausalLM`` (RoPE in the
``rotate_half`` convention, RMSNorm in float32), so weights from a Hugging Face
checkpoint, or from a GGUF file after undoing llama.cpp's Q/K permutation, give
the same logits.

Parameters flatten to readable dotted paths, which is what
:class:`pockjax.UpdateScheme` rules match against::

    embed.embedding                     (vocab, dim)
    layers.3.attn_norm.scale            (dim,)
    layers.3.attn.wq.kernel             (dim, n_heads * head_dim)    also wk, wv, wo
    layers.3.mlp_norm.scale             (dim,)
    layers.3.mlp.w1.kernel              (dim, hidden)   gate projection
    layers.3.mlp.w3.kernel              (dim, hidden)   up projection
    layers.3.mlp.w2.kernel              (hidden, dim)   down projection
    norm.scale                          (dim,)

Gemma 3 (``config.arch == "gemma3"``) blocks also have::

    layers.3.attn.q_norm.scale          (head_dim,)     RMSNorm of each query head
    layers.3.attn.k_norm.scale          (head_dim,)     RMSNorm of each key head
    layers.3.post_attn_norm.scale       (dim,)          on the attention output
    layers.3.post_mlp_norm.scale        (dim,)          on the MLP output

and ``mlp_norm`` is Hugging Face's ``pre_feedforward_layernorm``. Every Gemma
norm scale is stored as ``1 + w`` (Hugging Face stores ``w``).
    lm_head.kernel                      (dim, vocab)    untied models only

With ``config.scan_layers`` the blocks are stacked: ``layers.attn.wq.kernel``
has shape ``(n_layers, dim, n_heads * head_dim)`` and the forward pass is a
``jax.lax.scan`` over the leading axis.

For a functional training step use :func:`split` / :func:`apply`::

    graphdef, params = split(model)          # params: nested dict of arrays
    logits = apply(graphdef, params, tokens) # pure, jit/grad friendly
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pockjax.paths import flatten_params, unflatten_params  # noqa: F401  (re-exported)
from pockjax.models.llama.config import LlamaConfig

__all__ = [
    "KVCache",
    "Llama",
    "apply",
    "causal_mask",
    "causal_query_blocks",
    "decode_tables",
    "flatten_params",
    "init_cache",
    "merge",
    "answer_loss",
    "next_token_loss",
    "rope_cos_sin",
    "split",
    "stack_layers",
    "unflatten_params",
]


class KVCache(NamedTuple):
    """Per-layer key/value cache for decoding.

    Attributes:
      k: Keys, shape ``(n_layers, batch, max_len, n_kv_heads, head_dim)``,
        already rotated by RoPE.
      v: Values, same shape as ``k``.
    """

    k: jax.Array
    v: jax.Array


def init_cache(config: LlamaConfig, batch: int, max_len: int,
               dtype: Any = jnp.float32) -> KVCache:
    """Returns an all-zero :class:`KVCache` for ``batch`` rows of ``max_len`` slots.

    Example:
      >>> c = init_cache(LlamaConfig.tiny(), batch=2, max_len=8)
      >>> c.k.shape
      (2, 2, 8, 2, 16)
    """
    shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim_)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, factors: Any = None
                 ) -> tuple[jax.Array, jax.Array]:
    """Cosine and sine tables for rotary embeddings (Hugging Face convention).

    Args:
      positions: Integer positions, shape ``(batch, seq)``.
      head_dim: Width of one head (even).
      theta: RoPE base (``rope_theta``).
      factors: Optional divisor of each frequency (:func:`rope_freq_factors`, Llama 3).

    Returns:
      ``(cos, sin)``, each float32 of shape ``(batch, seq, head_dim)``; the
      frequencies are repeated as ``concat(f, f)`` to pair with ``rotate_half``.

    Example:
      >>> cos, sin = rope_cos_sin(jnp.arange(3)[None], 4, 10000.0)
      >>> cos.shape, float(cos[0, 0, 0]), float(sin[0, 1, 0])
      ((1, 3, 4), 1.0, 0.841...)
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if factors is not None:
        inv_freq = inv_freq / jnp.asarray(factors, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rope_table(n: int, head_dim: int, theta: float, factors: Any = None) -> tuple[jax.Array, jax.Array]:
    # rope_cos_sin of positions 0 .. n-1, evaluated now even under a trace, so
    # that a jitted step holds the table as a constant. Computed from traced
    # positions instead, XLA's CPU backend fuses the cosine and sine into every
    # rotary embedding that reads them and evaluates them once per element of
    # each head (the query rotation of a SmolLM2 layer took 2.0 ms instead of
    # 0.56 ms, 30 layers and their backward every step).
    with jax.ensure_compile_time_eval():
        return rope_cos_sin(jnp.arange(n)[None], head_dim, theta, factors)


def _factors(config):
    """The config's RoPE frequency divisors as a tuple (hashable, a constant under jit), or None."""
    from pockjax.models.llama.config import rope_freq_factors

    f = rope_freq_factors(config)
    return None if f is None else tuple(float(x) for x in f)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # x: (B, T, heads, hd); cos/sin: (B, T, hd)
    xf = x.astype(jnp.float32)
    out = xf * cos[:, :, None, :] + _rotate_half(xf) * sin[:, :, None, :]
    return out.astype(x.dtype)


def causal_mask(query_slots: jax.Array, key_valid: jax.Array, window: int | None = None) -> jax.Array:
    """Boolean attention mask: key ``s`` is visible from query slot ``t`` if
    ``s <= t`` and key ``s`` is a real (non-padding) token.

    Args:
      query_slots: Slot index of each query, shape ``(batch, seq)`` or ``(seq,)``.
      key_valid: Validity of each key slot, bool ``(batch, n_keys)``.
      window: Sliding window (Gemma 3's local layers): only the keys with
        ``t - s < window`` are visible. ``None``: no window.

    Returns:
      Bool array of shape ``(batch, seq, n_keys)``.

    Example:
      >>> m = causal_mask(jnp.arange(3), jnp.array([[False, True, True]]))
      >>> m.astype(int)[0].tolist()
      [[0, 0, 0], [0, 1, 0], [0, 1, 1]]
      >>> causal_mask(jnp.arange(3), jnp.ones((1, 3), bool), window=2).astype(int)[0].tolist()
      [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    query_slots = jnp.broadcast_to(query_slots, key_valid.shape[:1] + query_slots.shape[-1:])
    key_slots = jnp.arange(key_valid.shape[-1])
    visible = (key_slots[None, None, :] <= query_slots[:, :, None]) & key_valid[:, None, :]
    if window is not None:
        visible &= query_slots[:, :, None] - key_slots[None, None, :] < window
    return visible


def causal_query_blocks(t: int, min_rows: int | None = 64) -> int:
    """How many query blocks causal self-attention over ``t`` tokens is cut into.

    Query block ``j`` of a causal mask sees no key after its own last row, so
    attention can run block by block on a growing prefix of the keys and skip
    the masked blocks above the diagonal (with 2 blocks a quarter of the
    attention products and softmax, with many nearly half). Blocks of fewer
    than ``min_rows`` queries cost more in extra operations than they save, so
    ``t`` is cut into the most blocks of at least ``min_rows`` rows that
    divide it evenly (1: attend in one piece; ``min_rows`` None or 0: always
    1). :meth:`Llama.hidden_states` uses ``config.attn_block_rows``.

    Example:
      >>> causal_query_blocks(128), causal_query_blocks(1024), causal_query_blocks(96)
      (2, 16, 1)
      >>> causal_query_blocks(1024, min_rows=None)
      1
    """
    if not min_rows:
        return 1
    for nb in range(t // min_rows, 1, -1):
        if t % nb == 0:
            return nb
    return 1


def _attend(qh: jax.Array, kh: jax.Array, vh: jax.Array, mask: jax.Array, groups: int,
            scale_sq: float | None = None) -> jax.Array:
    # qh: (b, kv, groups * t, hd), the query heads of each kv head stacked as
    # rows; kh, vh: (b, kv, s, hd); mask: bool (b, t, s) -> (b, kv, groups * t, hd).
    # The scores are divided by sqrt(scale_sq), default the head width.
    b, kv, gt, hd = qh.shape
    t, s_len = gt // groups, kh.shape[2]
    scores = jnp.einsum("bkrd,bksd->bkrs", qh, kh,
                        preferred_element_type=jnp.float32) / math.sqrt(scale_sq or hd)
    # The mask enters as an additive bias (0 or the float32 minimum): the
    # forward is the same as a select (min + score rounds to min), and the
    # backward needs no mask at all (masked probabilities are exactly 0).
    bias = jnp.where(mask, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
    scores = scores.reshape(b, kv, groups, t, s_len) + bias[:, None, None, :, :]
    probs = jax.nn.softmax(scores, axis=-1).astype(vh.dtype).reshape(b, kv, gt, s_len)
    return jnp.einsum("bkrs,bksd->bkrd", probs, vh)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm with a learned ``scale`` (computed in float32).

    Gemma's norms multiply by ``1 + w`` and store ``w``; pockjax stores their
    ``scale = 1 + w`` (as GGUF files do), so one norm serves both.

    Example:
      >>> y = RMSNorm(4, 1e-6)(jnp.array([[2.0, -2.0, 2.0, -2.0]]))
      >>> y.tolist()
      [[1.0, -1.0, 1.0, -1.0]]
    """

    def __init__(self, dim: int, eps: float, *, param_dtype: Any = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * y).astype(x.dtype)


def _linear(din: int, dout: int, rngs: nnx.Rngs, dtype: Any, param_dtype: Any,
            std: float = 0.02, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


def _at_rows(a: jax.Array, rows: jax.Array) -> jax.Array:
    """``a[i, rows[i]]`` for each batch row ``i``: ``(batch or 1, seq, ...)`` at
    ``(batch, n)`` slots -> ``(batch, n, ...)``."""
    a = jnp.broadcast_to(a, rows.shape[:1] + a.shape[1:])
    return jnp.take_along_axis(a, rows.reshape(rows.shape + (1,) * (a.ndim - 2)), axis=1)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings and an optional KV cache."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        hd = config.head_dim_
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = hd
        bias = config.qkv_bias  # Qwen2
        self.wq = _linear(config.dim, config.n_heads * hd, rngs, dtype, param_dtype, bias=bias)
        self.wk = _linear(config.dim, config.n_kv_heads * hd, rngs, dtype, param_dtype, bias=bias)
        self.wv = _linear(config.dim, config.n_kv_heads * hd, rngs, dtype, param_dtype, bias=bias)
        self.wo = _linear(config.n_heads * hd, config.dim, rngs, dtype, param_dtype)
        self.scale_sq = config.query_pre_attn_scalar
        if config.arch == "gemma3":  # RMSNorm of every query and key head, before RoPE
            self.q_norm = RMSNorm(hd, config.rms_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(hd, config.rms_eps, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, mask, cache=None, cache_index=None, query_rows=None,
                 query_blocks=1):
        # query_rows: optional (batch, n) slots; queries (and the output) are
        # computed only for those rows of x, keys and values for every row, and
        # ``mask`` is then (batch, n, keys). See Block. query_blocks > 1 only
        # with mask = causal_mask(arange(t), ...) (see causal_query_blocks).
        b, s, _ = x.shape
        kv, hd = self.n_kv_heads, self.head_dim
        groups = self.n_heads // kv
        xq, q_cos, q_sin = x, cos, sin
        if query_rows is not None:
            xq, q_cos, q_sin = (_at_rows(a, query_rows) for a in (x, cos, sin))
        t = xq.shape[1]
        q = self.wq(xq).reshape(b, t, self.n_heads, hd)
        k = self.wk(x).reshape(b, s, kv, hd)
        v = self.wv(x).reshape(b, s, kv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = _apply_rope(q, q_cos, q_sin)
        k = _apply_rope(k, cos, sin)
        new_cache = None
        if cache is not None:
            ck, cv = cache
            ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), cache_index, axis=1)
            cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), cache_index, axis=1)
            new_cache = (ck, cv)
            k, v = ck.astype(q.dtype), cv.astype(q.dtype)
        # Query head h uses kv head h // groups (Hugging Face's repeat_kv order).
        # Heads-major layout: the `groups` query heads of one kv head are
        # stacked as rows, so each attention product is one (batch * kv)-batched
        # matmul of (groups * rows) rows with contiguous operands. XLA's CPU
        # backend runs these about twice as fast as the token-major einsum,
        # which it transposes inside every product (and again in the backward).
        # With query_blocks > 1 the queries are cut into that many consecutive
        # blocks and block j attends only to the keys up to its own last row:
        # a causal mask hides every later key from all of its queries, so the
        # products, the softmax and their backward skip the masked blocks.
        nb = query_blocks if (query_rows is None and cache is None and query_blocks > 1
                              and t == k.shape[1] and t % query_blocks == 0) else 1
        rows = t // nb
        qh = (q.reshape(b, nb, rows, kv, groups, hd).transpose(0, 3, 1, 4, 2, 5)
              .reshape(b, kv, nb, groups * rows, hd))
        kh = k.transpose(0, 2, 1, 3)
        vh = v.transpose(0, 2, 1, 3)
        outs = []
        for j in range(nb):
            # (j + 1) * rows keys (t == keys when nb > 1); the last block, and the
            # one block of a cache or query_rows step, attends to every key.
            keys = k.shape[1] - (nb - 1 - j) * rows
            outs.append(_attend(qh[:, :, j], kh[:, :, :keys], vh[:, :, :keys],
                                mask[:, j * rows:(j + 1) * rows, :keys], groups, self.scale_sq))
        out = (jnp.stack(outs, axis=2).reshape(b, kv, nb, groups, rows, hd).transpose(0, 2, 4, 1, 3, 5)
               .reshape(b, t, self.n_heads * hd))
        return self.wo(out), new_cache


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))`` (w1 gate, w3 up, w2 down).

    Gemma 3's GeGLU uses the tanh-approximated GELU in place of SiLU.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        self.w1 = _linear(config.dim, config.hidden_dim, rngs, dtype, param_dtype)
        self.w3 = _linear(config.dim, config.hidden_dim, rngs, dtype, param_dtype)
        self.w2 = _linear(config.hidden_dim, config.dim, rngs, dtype, param_dtype)
        self.gelu = config.arch == "gemma3"

    def __call__(self, x):
        gate = self.w1(x)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return self.w2(act * self.w3(x))


class Block(nnx.Module):
    """One pre-norm transformer block: attention then SwiGLU, each with a residual.

    Gemma 3 also normalises the attention output (``post_attn_norm``) and the
    MLP output (``post_mlp_norm``) before each residual add.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        self.attn_norm = RMSNorm(config.dim, config.rms_eps, param_dtype=param_dtype)
        self.attn = Attention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.mlp_norm = RMSNorm(config.dim, config.rms_eps, param_dtype=param_dtype)
        self.mlp = MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if config.arch == "gemma3":
            self.post_attn_norm = RMSNorm(config.dim, config.rms_eps, param_dtype=param_dtype)
            self.post_mlp_norm = RMSNorm(config.dim, config.rms_eps, param_dtype=param_dtype)

    def __call__(self, x, cos, sin, mask, cache=None, cache_index=None, query_rows=None,
                 query_blocks=1):
        # With query_rows (batch, n), the block's output is computed only at
        # those slots: keys and values still come from every row, but the
        # queries, the attention output and the MLP run on n rows. The output
        # at a slot equals the full block's output there (causal attention);
        # ``mask`` must then be causal_mask(query_rows, key_valid).
        h, new_cache = self.attn(self.attn_norm(x), cos, sin, mask, cache, cache_index, query_rows,
                                 query_blocks)
        if query_rows is not None:
            x = _at_rows(x, query_rows)
        post = hasattr(self, "post_attn_norm")
        x = x + (self.post_attn_norm(h) if post else h)
        h = self.mlp(self.mlp_norm(x))
        x = x + (self.post_mlp_norm(h) if post else h)
        return x, new_cache


class Llama(nnx.Module):
    """A LLaMA-architecture causal language model.

    Args:
      config: The model's :class:`LlamaConfig`.
      rngs: Random streams for initialisation (weights are normal(0.02), norm
        scales are ones).
      dtype: Compute dtype of the matmuls (``None``: the parameter dtype).
      param_dtype: Dtype the parameters are stored in.

    Example:
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> tokens = jnp.array([[1, 2, 3, 4]])
      >>> model(tokens).shape
      (1, 4, 128)
      >>> sorted(flatten_params(split(model)[1]))[:3]
      ['embed.embedding', 'layers.0.attn.wk.kernel', 'layers.0.attn.wo.kernel']
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        self.config = config
        self.embed = nnx.Embed(config.vocab, config.dim, dtype=dtype, param_dtype=param_dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        if config.scan_layers:
            @nnx.vmap(in_axes=0, out_axes=0)
            def make_block(key):
                return Block(config, rngs=nnx.Rngs(params=key), dtype=dtype,
                             param_dtype=param_dtype)

            self.layers = make_block(jax.random.split(rngs.params(), config.n_layers))
        else:
            self.layers = nnx.List([
                Block(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                for _ in range(config.n_layers)
            ])
        self.norm = RMSNorm(config.dim, config.rms_eps, param_dtype=param_dtype)
        if not config.tie_embeddings:
            self.lm_head = _linear(config.dim, config.vocab, rngs, dtype, param_dtype)

    # -- pieces -----------------------------------------------------------------

    def _layers(self, x, cos, sin, mask, cache, cache_index, query_rows=None, query_blocks=1,
                local=None):
        # query_blocks: see Attention (only with mask = causal_mask(arange(t), ...)).
        # local: (cos, sin, mask) of the sliding-attention layers (Gemma 3), or None.
        def at(i):  # the rotary tables and mask of layer i
            return local if local is not None and self.config.is_sliding(i) else (cos, sin, mask)

        n = self.config.n_layers
        if query_rows is not None:
            # Every block but the last runs on all rows (their keys and values
            # feed the last block's attention); the last one only on query_rows.
            if self.config.scan_layers:
                x, _ = self._layers(x, cos, sin, mask, None, None, query_blocks=query_blocks, local=local)
                return _at_rows(x, query_rows), None
            for i, block in enumerate(list(self.layers)[:-1]):
                x, _ = block(x, *at(i), query_blocks=query_blocks)
            last_cos, last_sin, last_mask = at(n - 1)
            x, _ = self.layers[n - 1](x, last_cos, last_sin, _at_rows(last_mask, query_rows),
                                      query_rows=query_rows)
            return x, None
        if self.config.scan_layers:
            graphdef, state = nnx.split(self.layers)
            sliding = jnp.asarray([self.config.is_sliding(i) for i in range(n)])

            def body(h, xs):
                layer_state, layer_cache, is_sliding = xs
                block = nnx.merge(graphdef, layer_state)
                tables = (cos, sin, mask) if local is None else tuple(
                    jnp.where(is_sliding, a, b) for a, b in zip(local, (cos, sin, mask)))
                h, layer_cache = block(h, *tables, layer_cache, cache_index,
                                       query_blocks=query_blocks)
                return h, layer_cache

            x, new_cache = jax.lax.scan(body, x, (state, cache, sliding))
            return x, new_cache
        new_k, new_v = [], []
        for i, block in enumerate(self.layers):
            layer_cache = None if cache is None else (cache[0][i], cache[1][i])
            x, layer_cache = block(x, *at(i), layer_cache, cache_index,
                                   query_blocks=query_blocks)
            if layer_cache is not None:
                new_k.append(layer_cache[0])
                new_v.append(layer_cache[1])
        new_cache = None if cache is None else (jnp.stack(new_k), jnp.stack(new_v))
        return x, new_cache

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The input embeddings of ``tokens``; Gemma 3 scales them by ``sqrt(dim)``.

        The scale is rounded to the embedding's dtype first, as Hugging Face does.

        Example:
          >>> model = Llama(LlamaConfig.tiny_gemma3(), rngs=nnx.Rngs(0))
          >>> e = model.embed_tokens(jnp.array([[3]]))
          >>> bool(jnp.allclose(e, model.embed.embedding[3] * 8.0))
          True
        """
        x = self.embed(tokens)
        if self.config.arch == "gemma3":
            x = x * jnp.asarray(math.sqrt(self.config.dim), x.dtype)
        return x

    def logits_from_hidden(self, h: jax.Array) -> jax.Array:
        """Final norm and output projection: hidden states -> float32 logits.

        Use it with :meth:`hidden_states` to compute logits only where needed.

        Example:
          >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
          >>> model.logits_from_hidden(jnp.ones((1, 2, 64))).shape
          (1, 2, 128)
        """
        h = self.norm(h)
        if self.config.tie_embeddings:
            logits = self.embed.attend(h)
        else:
            logits = self.lm_head(h)
        return logits.astype(jnp.float32)

    # -- entry points -----------------------------------------------------------

    def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                      mask: jax.Array | None = None, rows: jax.Array | None = None) -> jax.Array:
        """Output of the last block (before the final norm), ``(batch, seq, dim)``.

        Arguments as for :meth:`__call__`. Pair with :meth:`logits_from_hidden`
        to compute logits only at the positions a loss needs (the output
        projection is a large share of a small model's compute).

        Args:
          rows: Optional int ``(batch, n)``: return only the hidden states at
            these slots, ``(batch, n, dim)``, equal to ``hidden_states(...)``
            gathered there. The last block then computes its queries,
            attention output and MLP on those ``n`` rows only (the other
            blocks need every row for the last block's keys and values), which
            saves most of one block's forward and backward when a loss reads
            a few positions (:func:`answer_loss`). Models with
            ``scan_layers`` run every block in full and gather.

        Example:
          >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
          >>> tokens = jnp.array([[1, 2, 3, 4]])
          >>> model.hidden_states(tokens).shape
          (1, 4, 64)
          >>> rows = jnp.array([[1, 3]])
          >>> bool(jnp.allclose(model.hidden_states(tokens, rows=rows),
          ...                   model.hidden_states(tokens)[:, jnp.array([1, 3])], atol=1e-5))
          True
        """
        b, t = tokens.shape
        cfg = self.config
        if mask is None:
            key_valid = jnp.ones((b, t), bool)
        else:
            key_valid = mask.astype(bool)

        def tables(theta, factors):
            if positions is None:
                # Positions are 0 .. t-1, or (with a mask) a count below t: read the
                # rotary tables from a constant of t rows instead of computing them.
                cos, sin = _rope_table(t, cfg.head_dim_, theta, factors)
                if mask is not None:
                    at = jnp.maximum(jnp.cumsum(key_valid, axis=-1) - 1, 0)
                    cos, sin = cos[0][at], sin[0][at]
                return cos, sin
            return rope_cos_sin(positions, cfg.head_dim_, theta, factors)

        cos, sin = tables(cfg.rope_theta, _factors(cfg))
        attn_mask = causal_mask(jnp.arange(t), key_valid)
        local = None
        if cfg.is_sliding(*range(cfg.n_layers)):  # Gemma 3's local RoPE: its own base, never scaled
            local = (*tables(cfg.rope_local_theta or cfg.rope_theta, None),
                     causal_mask(jnp.arange(t), key_valid, cfg.sliding_window))
        x = self.embed_tokens(tokens)
        if rows is not None:
            rows = jnp.broadcast_to(jnp.asarray(rows, jnp.int32), (b,) + jnp.shape(rows)[-1:])
        x, _ = self._layers(x, cos, sin, attn_mask, None, None, rows,
                            causal_query_blocks(t, cfg.attn_block_rows), local)
        return x

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 mask: jax.Array | None = None) -> jax.Array:
        """Logits for every position of a batch of token sequences.

        Args:
          tokens: Int token ids, shape ``(batch, seq)``.
          positions: RoPE positions, ``(batch, seq)``; default ``0 .. seq-1``,
            or, when ``mask`` is given, the count of real tokens before each
            token (so left-padded rows start at position 0).
          mask: Optional ``(batch, seq)`` validity of each token (1 = real,
            0 = padding). Padding keys are never attended to. Right padding
            needs no mask for the real tokens' logits.

        Returns:
          float32 logits of shape ``(batch, seq, vocab)``.
        """
        return self.logits_from_hidden(self.hidden_states(tokens, positions, mask))

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
               cache_index: jax.Array | int, key_valid: jax.Array, *, last_only: bool = False
               ) -> tuple[jax.Array, KVCache]:
        """Runs ``tokens`` through the model, reading and writing a KV cache.

        The new keys/values go to cache slots ``cache_index .. cache_index +
        seq - 1`` (the same slots for every row); a query in slot ``s`` sees the
        cache slots ``<= s`` whose ``key_valid`` is true.

        Args:
          tokens: ``(batch, seq)`` ids (the prompt for prefill, one token per row
            for a decoding step).
          positions: ``(batch, seq)`` RoPE positions.
          cache: The :class:`KVCache` (see :func:`init_cache`).
          cache_index: First cache slot to write.
          key_valid: ``(batch, max_len)`` bool, which cache slots hold real
            tokens (including the ones being written now).
          last_only: Return the logits of the last position only,
            ``(batch, 1, vocab)`` (a prompt's prefill needs no others: 40
            prompts of 48 tokens would otherwise hold 377 MB of SmolLM2 logits).

        Returns:
          ``(logits, cache)``: float32 logits ``(batch, seq, vocab)`` and the
          updated cache.

        Example:
          >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
          >>> toks = jnp.array([[5, 6, 7]])
          >>> cache = init_cache(model.config, 1, 8)
          >>> valid = jnp.arange(8)[None] < 3
          >>> logits, cache = model.decode(toks, jnp.arange(3)[None], cache, 0, valid)
          >>> bool(jnp.allclose(logits, model(toks), atol=1e-5))
          True
        """
        sliding = self.config.is_sliding(*range(self.config.n_layers))
        (cos, sin, mask), local = decode_tables(self.config, positions, cache_index, key_valid, sliding)
        x, (k, v) = self._layers(self.embed_tokens(tokens), cos, sin, mask, (cache.k, cache.v), cache_index,
                                 local=local)
        if last_only:
            x = x[:, -1:]
        return self.logits_from_hidden(x), KVCache(k, v)


def decode_tables(config: LlamaConfig, positions: jax.Array, cache_index: jax.Array | int,
                  key_valid: jax.Array, sliding: bool) -> tuple[tuple, tuple | None]:
    """The rotary tables and attention mask of a decoding step: ``((cos, sin, mask), local)``.

    ``positions`` is ``(batch, seq)``: the queries go to cache slots
    ``cache_index ..``. ``local`` is the same for the sliding-window layers
    (Gemma 3) when ``sliding``, else None.

    Example:
      >>> (cos, sin, mask), local = decode_tables(LlamaConfig.tiny(), jnp.arange(3)[None], 0,
      ...                                         jnp.arange(8)[None] < 3, sliding=False)
      >>> cos.shape, mask.shape, local
      ((1, 3, 16), (1, 3, 8), None)
    """
    t = positions.shape[1]
    slots = cache_index + jnp.arange(t)
    tables = (*rope_cos_sin(positions, config.head_dim_, config.rope_theta, _factors(config)),
              causal_mask(slots, key_valid))
    local = None
    if sliding:
        local = (*rope_cos_sin(positions, config.head_dim_, config.rope_local_theta or config.rope_theta, None),
                 causal_mask(slots, key_valid, config.sliding_window))
    return tables, local


def stack_layers(model: Llama) -> Llama:
    """The same model with its blocks stacked (``config.scan_layers=True``).

    Works inside ``jax.jit`` (the stacking is then part of the program). A
    scanned model compiles one block instead of ``n_layers``, which makes
    compilation much faster (its stacked weights are a copy of the blocks').

    Example:
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> scanned = stack_layers(model)
      >>> scanned.layers.mlp.w1.kernel.shape
      (2, 64, 96)
      >>> toks = jnp.array([[3, 1, 4]])
      >>> bool(jnp.allclose(scanned(toks), model(toks), atol=1e-5))
      True
    """
    if model.config.scan_layers:
        return model
    cfg = model.config.replace(scan_layers=True)
    param_dtype = model.embed.embedding.dtype
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=model.embed.dtype,
                                            param_dtype=param_dtype))
    graphdef, _ = nnx.split(abstract)
    params = split(model)[1]
    layers = [params["layers"][i] for i in range(cfg.n_layers)]
    params = {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
    return nnx.merge(graphdef, params)


# -- functional interface --------------------------------------------------------


def split(model: Llama) -> tuple[nnx.GraphDef, dict]:
    """Splits a model into a static graph definition and a nested dict of arrays.

    ``params`` is a plain pytree (dicts with str / int keys) of the model's
    parameters, suitable for ``jax.grad``, Optax and :func:`flatten_params`.

    Example:
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> graphdef, params = split(model)
      >>> params["layers"][0]["attn"]["wq"]["kernel"].shape
      (64, 64)
    """
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def merge(graphdef: nnx.GraphDef, params: dict) -> Llama:
    """Rebuilds a :class:`Llama` from :func:`split` output.

    Example:
      >>> graphdef, params = split(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
      >>> merge(graphdef, params).config.n_layers
      2
    """
    return nnx.merge(graphdef, params)


def apply(graphdef: nnx.GraphDef, params: dict, tokens: jax.Array,
          positions: jax.Array | None = None, mask: jax.Array | None = None) -> jax.Array:
    """Pure forward pass: ``merge(graphdef, params)(tokens, positions, mask)``.

    Example:
      >>> graphdef, params = split(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
      >>> loss = lambda p: apply(graphdef, p, jnp.ones((1, 4), jnp.int32)).mean()
      >>> grads = jax.jit(jax.grad(loss))(params)
      >>> grads["norm"]["scale"].shape
      (64,)
    """
    return merge(graphdef, params)(tokens, positions, mask)






def next_token_loss(logits: jax.Array, targets: jax.Array,
                    loss_mask: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``targets`` under ``logits`` over unmasked positions.

    Args:
      logits: ``(batch, seq, vocab)``; position ``t`` predicts ``targets[:, t]``.
      targets: ``(batch, seq)`` int ids (already shifted by one).
      loss_mask: ``(batch, seq)``; 1 where the target counts (the answers' tokens).

    Returns:
      Scalar float32 loss (0 if nothing is unmasked).

    Example:
      >>> logits = jnp.zeros((1, 2, 4))
      >>> round(float(next_token_loss(logits, jnp.array([[1, 2]]), jnp.array([[1, 0]]))), 4)
      1.3863
    """
    logits = logits.astype(jnp.float32)
    # logsumexp minus the target's logit, the target picked by a compare-and-select
    # rather than take_along_axis: the gradient is then one dense elementwise pass
    # (softmax - one-hot) instead of a scatter into a zeroed (batch, seq, vocab)
    # buffer plus its transposes, 14% of SmolLM2's full CPU step (5.17 -> 4.46 s).
    hit = jnp.arange(logits.shape[-1]) == targets[..., None].astype(jnp.int32)
    target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
    w = loss_mask.astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def answer_loss(model: Llama, batch: dict, window: int) -> jax.Array:
    """:func:`next_token_loss` computing logits only on a window of answer positions.

    Runs the blocks on the whole row (the last block's queries and MLP only
    on the window: :meth:`Llama.hidden_states` with ``rows``), then the final
    norm and output projection only on ``window`` positions from
    ``batch["loss_start"]`` (see :mod:`pockjax.data.batching`). Equal to the
    full loss when every row's loss positions fit in the window
    (``Batcher.answer_window``).

    Args:
      model: The :class:`Llama`.
      batch: Dict with ``tokens``, ``targets``, ``loss_mask``, ``loss_start``.
      window: Static number of positions.

    Example:
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> batch = {"tokens": jnp.array([[5, 6, 7, 8, 0]]), "targets": jnp.array([[6, 7, 8, 0, 0]]),
      ...          "loss_mask": jnp.array([[0., 1., 1., 0., 0.]]), "loss_start": jnp.array([1])}
      >>> @nnx.jit
      ... def both(model, batch):
      ...     full = next_token_loss(model(batch["tokens"]), batch["targets"], batch["loss_mask"])
      ...     return full, answer_loss(model, batch, window=2)
      >>> full, windowed = both(model, batch)
      >>> bool(jnp.allclose(windowed, full, atol=1e-6))
      True
    """
    idx, mask = answer_window(batch, window)
    h_w = model.hidden_states(batch["tokens"], rows=idx)
    targets = jnp.take_along_axis(batch["targets"], idx, axis=1)
    return next_token_loss(model.logits_from_hidden(h_w), targets, mask)


def answer_window(batch: dict, window: int) -> tuple[jax.Array, jax.Array]:
    """The positions :func:`answer_loss` reads, and which of them count.

    ``window`` positions from each row's ``loss_start``, clipped to the row
    (``idx``, int ``(batch, window)``), and ``loss_mask`` at them, zero beyond
    the row's end (``mask``, ``(batch, window)``).

    Example:
      >>> batch = {"tokens": jnp.zeros((2, 4), jnp.int32), "loss_start": jnp.array([1, 3]),
      ...          "loss_mask": jnp.array([[0., 1., 1., 0.], [0., 0., 0., 1.]])}
      >>> idx, mask = answer_window(batch, window=2)
      >>> idx.tolist(), mask.tolist()
      ([[1, 2], [3, 3]], [[1.0, 1.0], [1.0, 0.0]])
    """
    t = batch["tokens"].shape[1]
    idx = batch["loss_start"][:, None] + jnp.arange(window)[None, :]
    inside = idx < t
    idx = jnp.minimum(idx, t - 1)
    return idx, jnp.take_along_axis(batch["loss_mask"], idx, axis=1) * inside

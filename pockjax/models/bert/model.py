"""A Flax NNX BERT encoder and a sentence classifier on top of it.

The numerics follow Hugging Face ``BertModel`` (post-LayerNorm residual
blocks, exact erf GELU, padded keys masked with an additive float32 minimum),
so a checkpoint gives the same hidden states.

Parameters flatten to readable dotted paths, which is what
:class:`pockjax.UpdateScheme` rules match against::

    embeddings.word.embedding           (vocab, hidden)
    embeddings.position.embedding       (max_position, hidden)
    embeddings.token_type.embedding     (type_vocab, hidden)
    embeddings.norm.scale / .bias       (hidden,)       LayerNorm
    layers.3.attn.q.kernel / .bias      (hidden, hidden) and (hidden,); also k, v
    layers.3.attn.o.kernel / .bias      attention output projection
    layers.3.attn_norm.scale / .bias    LayerNorm after the attention residual
    layers.3.mlp.up.kernel / .bias      (hidden, intermediate) and (intermediate,)
    layers.3.mlp.down.kernel / .bias    (intermediate, hidden) and (hidden,)
    layers.3.mlp_norm.scale / .bias     LayerNorm after the feed-forward residual
    head.kernel / .bias                 (hidden, num_classes); BertClassifier only

A :class:`BertClassifier` has the same paths as :class:`BertModel` plus
``head.*`` (no ``encoder.`` prefix), so one scheme fits both.

Dropout is off after construction (eval mode); ``model.train()`` turns it on
(it draws keys from the ``nnx.Rngs`` given at construction, stream
``dropout``, else ``default``) and ``model.eval()`` off again.

Example:
    >>> from flax import nnx
    >>> m = BertModel(BertConfig.tiny(), rngs=nnx.Rngs(0))
    >>> m(jnp.array([[1, 5, 2, 0]]), jnp.array([[1, 1, 1, 0]])).shape
    (1, 4, 32)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pockjax.paths import flatten_params, unflatten_params  # noqa: F401  (re-exported)
from pockjax.models.bert.config import BertConfig
from pockjax.models.layers import Dropout

__all__ = ["BertClassifier", "BertModel", "build_model", "flatten_params", "mean_pool",
           "sentence_embedding", "unflatten_params"]


def _dense(din: int, dout: int, rngs: nnx.Rngs, dtype: Any, param_dtype: Any) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=True, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(0.02),
                      bias_init=nnx.initializers.zeros_init(), rngs=rngs)


def _norm(config: BertConfig, rngs: nnx.Rngs, dtype: Any, param_dtype: Any) -> nnx.LayerNorm:
    # two-pass variance, as torch's LayerNorm (the fast E[x^2] - E[x]^2 loses digits)
    return nnx.LayerNorm(config.hidden, epsilon=config.layer_norm_eps, dtype=dtype,
                         param_dtype=param_dtype, use_fast_variance=False, rngs=rngs)


def _dropout(rate: float, rngs: nnx.Rngs) -> Dropout:
    # eval mode until .train(); each dropout forks its own key stream; 16 random bits per
    # element (pockjax.models.layers.Dropout): half the random-number cost of nnx.Dropout
    return Dropout(rate, deterministic=True, rngs=rngs)


class Embeddings(nnx.Module):
    """Word + absolute position + token type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        init = nnx.initializers.normal(0.02)
        kw = dict(dtype=dtype, param_dtype=param_dtype, embedding_init=init, rngs=rngs)
        self.word = nnx.Embed(config.vocab, config.hidden, **kw)
        self.position = nnx.Embed(config.max_position, config.hidden, **kw)
        self.token_type = nnx.Embed(config.type_vocab, config.hidden, **kw)
        self.norm = _norm(config, rngs, dtype, param_dtype)
        self.dropout = _dropout(config.hidden_dropout, rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        positions = jnp.arange(input_ids.shape[1])[None, :]
        x = self.word(input_ids) + self.token_type(token_type_ids) + self.position(positions)
        return self.dropout(self.norm(x))


class SelfAttention(nnx.Module):
    """Multi-head self-attention with biased q/k/v/o projections."""

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        h = config.hidden
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.q = _dense(h, h, rngs, dtype, param_dtype)
        self.k = _dense(h, h, rngs, dtype, param_dtype)
        self.v = _dense(h, h, rngs, dtype, param_dtype)
        self.o = _dense(h, h, rngs, dtype, param_dtype)
        self.dropout = _dropout(config.attention_dropout, rngs)

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        # x: (b, t, hidden); bias: (b, 1, 1, t) float32, 0 or the float32 minimum
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k,
                            preferred_element_type=jnp.float32) / math.sqrt(self.head_dim)
        probs = jax.nn.softmax(scores + bias, axis=-1).astype(v.dtype)
        probs = self.dropout(probs)
        out = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3)
        return self.o(out.reshape(b, t, self.heads * self.head_dim))


class MLP(nnx.Module):
    """Feed-forward block: ``down(gelu(up(x)))`` with the exact (erf) GELU."""

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        self.up = _dense(config.hidden, config.intermediate, rngs, dtype, param_dtype)
        self.down = _dense(config.intermediate, config.hidden, rngs, dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x), approximate=False))


class Layer(nnx.Module):
    """One post-LN encoder layer: ``norm(x + drop(attn(x)))`` then ``norm(h + drop(mlp(h)))``."""

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        self.attn = SelfAttention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.attn_dropout = _dropout(config.hidden_dropout, rngs)
        self.attn_norm = _norm(config, rngs, dtype, param_dtype)
        self.mlp = MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.mlp_dropout = _dropout(config.hidden_dropout, rngs)
        self.mlp_norm = _norm(config, rngs, dtype, param_dtype)

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        x = self.attn_norm(x + self.attn_dropout(self.attn(x, bias)))
        return self.mlp_norm(x + self.mlp_dropout(self.mlp(x)))


class _Encoder(nnx.Module):
    """The parameters and forward pass shared by :class:`BertModel` and :class:`BertClassifier`."""

    def _build(self, config: BertConfig, rngs: nnx.Rngs, dtype: Any, param_dtype: Any) -> None:
        self.config = config
        self.embeddings = Embeddings(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.layers = nnx.List([Layer(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                                for _ in range(config.layers)])

    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                      token_type_ids: jax.Array | None = None) -> jax.Array:
        """Last hidden states ``(batch, seq, hidden)``.

        Args:
            input_ids: int ``(batch, seq)``, ``seq <= config.max_position``.
            attention_mask: ``(batch, seq)``, 1 for real tokens and 0 for
                padding (whose keys no token attends to); ``None``: all ones.
            token_type_ids: int ``(batch, seq)``; ``None``: all zeros.
        """
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {input_ids.shape}")
        if input_ids.shape[1] > self.config.max_position:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens is longer than the"
                             f" {self.config.max_position} positions the model has")
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        if token_type_ids is None:
            token_type_ids = jnp.zeros(input_ids.shape, jnp.int32)
        keep = jnp.asarray(attention_mask).astype(bool)
        bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        bias = bias[:, None, None, :]
        x = self.embeddings(input_ids, jnp.asarray(token_type_ids))
        for layer in self.layers:
            x = layer(x, bias)
        return x


class BertModel(_Encoder):
    """A BERT encoder returning the last hidden states (Hugging Face ``BertModel``
    without the pooler).

    Args:
        config: The shape of the model.
        rngs: Initialisation keys; dropout draws from its ``dropout`` stream
            (or ``default``) in ``.train()`` mode.
        dtype: Compute dtype (``None``: the parameter dtype).
        param_dtype: Parameter dtype.

    Example:
        >>> from flax import nnx
        >>> m = BertModel(BertConfig.tiny(), rngs=nnx.Rngs(0))
        >>> ids = jnp.array([[1, 7, 2]])
        >>> bool(jnp.allclose(m(ids), m(ids)))           # eval mode: deterministic
        True
        >>> m.train(); bool(jnp.allclose(m(ids), m(ids)))  # dropout on
        False
    """

    def __init__(self, config: BertConfig, *, rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        self._build(config, rngs, dtype, param_dtype)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        """Last hidden states ``(batch, seq, hidden)``; see :meth:`hidden_states`."""
        return self.hidden_states(input_ids, attention_mask, token_type_ids)


def mean_pool(hidden: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
    """Mean of the hidden states over the real tokens (sentence-transformers' pooling).

    Args:
        hidden: ``(batch, seq, hidden)``.
        attention_mask: ``(batch, seq)`` of 1/0, or ``None`` (every token).

    Example:
        >>> h = jnp.array([[[1.0], [3.0], [100.0]]])
        >>> mean_pool(h, jnp.array([[1, 1, 0]])).tolist()
        [[2.0]]
    """
    if attention_mask is None:
        return hidden.mean(axis=1)
    m = jnp.asarray(attention_mask).astype(hidden.dtype)[:, :, None]
    return (hidden * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1e-9)


def sentence_embedding(model: "BertModel", input_ids: jax.Array,
                       attention_mask: jax.Array | None = None, *,
                       normalize: bool = True) -> jax.Array:
    """Sentence embeddings as sentence-transformers computes them for
    all-MiniLM-L6-v2: :func:`mean_pool` of the last hidden states, then
    L2-normalised (its ``Normalize`` module) unless ``normalize=False``.

    Example:
        >>> from flax import nnx
        >>> m = BertModel(BertConfig.tiny(), rngs=nnx.Rngs(0))
        >>> e = sentence_embedding(m, jnp.array([[1, 5, 2]]))
        >>> e.shape, round(float(jnp.linalg.norm(e)), 4)
        ((1, 32), 1.0)
    """
    e = mean_pool(model(input_ids, attention_mask), attention_mask)
    if normalize:
        e = e / jnp.maximum(jnp.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
    return e


class BertClassifier(_Encoder):
    """A BERT encoder, pooling, dropout and a linear head to ``num_classes`` logits.

    The parameters are those of :class:`BertModel` plus ``head.kernel`` and
    ``head.bias``; ``self.config`` has ``num_classes`` set.

    Args:
        config: The encoder's shape.
        num_classes: Outputs of the head (default ``config.num_classes``).
        pooling: ``"mean"`` (mean over the attention mask, as
            sentence-transformers) or ``"cls"`` (the first token's state).
        rngs, dtype, param_dtype: as for :class:`BertModel`.

    Example:
        >>> from flax import nnx
        >>> c = BertClassifier(BertConfig.tiny(), 3, rngs=nnx.Rngs(0))
        >>> c(jnp.array([[1, 5, 2, 0]]), jnp.array([[1, 1, 1, 0]])).shape
        (1, 3)
        >>> c.config.num_classes, c.head.kernel.shape
        (3, (32, 3))
    """

    def __init__(self, config: BertConfig, num_classes: int | None = None, *,
                 rngs: nnx.Rngs, pooling: str = "mean", dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        num_classes = config.num_classes if num_classes is None else num_classes
        if num_classes is None:
            raise ValueError("BertClassifier needs num_classes (or config.num_classes)")
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        config = config.replace(num_classes=num_classes)
        self._build(config, rngs, dtype, param_dtype)
        self.pooling = pooling
        self.dropout = _dropout(config.hidden_dropout, rngs)
        self.head = _dense(config.hidden, num_classes, rngs, dtype, param_dtype)

    def pooled(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               token_type_ids: jax.Array | None = None) -> jax.Array:
        """The pooled sentence representation ``(batch, hidden)`` the head reads."""
        h = self.hidden_states(input_ids, attention_mask, token_type_ids)
        return h[:, 0] if self.pooling == "cls" else mean_pool(h, attention_mask)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 token_type_ids: jax.Array | None = None) -> jax.Array:
        """Logits ``(batch, num_classes)``."""
        return self.head(self.dropout(self.pooled(input_ids, attention_mask, token_type_ids)))






def build_model(config: BertConfig, flat_params: dict[str, Any], *, rngs: nnx.Rngs | None = None,
                num_classes: int | None = None, pooling: str = "mean", dtype: Any = None,
                param_dtype: Any = jnp.float32) -> BertModel | BertClassifier:
    """A :class:`BertModel` (or, with ``num_classes``, a :class:`BertClassifier`)
    holding ``flat_params``, without randomly initialising them first.

    The encoder is built as shapes only (``nnx.eval_shape``) and filled from
    ``flat_params``; a classifier's ``head`` (absent from a bare encoder's
    params) is initialised fresh from ``rngs.params()`` (normal(0.02) kernel,
    zero bias), and every dropout gets its own key stream forked from ``rngs``.

    Args:
        config: The encoder's config.
        flat_params: ``{"layers.0.attn.q.kernel": array, ...}``, every encoder
            parameter (``head.*`` too, optionally).
        rngs: Keys for the head and dropout (default ``nnx.Rngs(0)``).
        num_classes, pooling: as for :class:`BertClassifier`.
        dtype, param_dtype: as for :class:`BertModel`.

    Raises:
        ValueError: a missing, unexpected or misshapen parameter.

    Example:
        >>> src = BertModel(BertConfig.tiny(), rngs=nnx.Rngs(1))
        >>> flat = flatten_params(nnx.to_pure_dict(nnx.state(src, nnx.Param)))
        >>> clf = build_model(BertConfig.tiny(), flat, num_classes=2)
        >>> bool(jnp.all(clf.layers[1].mlp.up.kernel[...] == src.layers[1].mlp.up.kernel[...]))
        True
        >>> clf.head.kernel.shape
        (32, 2)
    """
    rngs = nnx.Rngs(0) if rngs is None else rngs
    if num_classes is None:
        make = lambda: BertModel(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype)
    else:
        make = lambda: BertClassifier(config, num_classes, rngs=nnx.Rngs(0), pooling=pooling,
                                      dtype=dtype, param_dtype=param_dtype)
    model = nnx.eval_shape(make)
    fresh = {"head.kernel": nnx.initializers.normal(0.02), "head.bias": nnx.initializers.zeros_init()}
    seen = set()
    for path, node in list(nnx.iter_graph(model)):
        name = ".".join(str(p) for p in path)
        if isinstance(node, nnx.RngStream):
            fork = rngs["dropout"].fork()
            node.key.set_value(fork.key.get_value())
            node.count.set_value(fork.count.get_value())
        elif isinstance(node, nnx.Param):
            spec = node.get_value()
            if name in flat_params:
                value = flat_params[name]
                if tuple(value.shape) != tuple(spec.shape):
                    raise ValueError(f"{name}: shape {tuple(value.shape)}, the config implies"
                                     f" {tuple(spec.shape)}")
                node.set_value(jnp.asarray(value, dtype=spec.dtype))
                seen.add(name)
            elif name in fresh:
                node.set_value(fresh[name](rngs.params(), spec.shape, spec.dtype))
            else:
                raise ValueError(f"no value for the parameter {name}")
    extra = sorted(set(flat_params) - seen)
    if extra:
        raise ValueError(f"parameters the model does not have: {extra[:5]}")
    return model

"""A compact LLaMA-style train step in plain ``jax.numpy``, for memory planning.

This is not the pockjax LLaMA model (that lives in ``pockjax.models.llama``); it is a
small functional stand-in with the same tensor shapes (RMSNorm, rotary attention with
optional grouped KV heads, SwiGLU FFN, untied LM head), so the planner can be run on
LLaMA-2-7B's shapes from ``jax.ShapeDtypeStruct`` alone, and the XLA comparison can be
run on small configurations. Parameters are a dict::

    {"embed": [V, d], "layers": [{"attn_norm", "wq", "wk", "wv", "wo",
                                  "ffn_norm", "w1" (gate), "w3" (up), "w2" (down)}, ...],
     "norm": [d], "lm_head": [d, V]}

With ``scan_layers=True`` the layers are stacked (leading axis ``n_layers``) and the
forward pass is a ``lax.scan`` over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LlamaShape",
    "abstract_params",
    "init_params",
    "forward",
    "loss_fn",
    "make_train_step",
    "abstract_train_args",
    "paper_trainable",
    "plan_llama",
    "plan_llama_peaks",
]

_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w3", "w2")


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Shapes of a LLaMA-style decoder.

    Attributes:
      vocab: vocabulary size.
      dim: model width d.
      n_layers: number of decoder blocks.
      n_heads: attention heads.
      n_kv_heads: key/value heads (grouped-query attention when < n_heads).
      hidden: FFN hidden width.
      dtype: parameter and activation dtype (norms, softmax and the loss run in fp32).
      scan_layers: stack the layers and ``lax.scan`` over them.
      tie_embeddings: the LM head is the transposed embedding (no ``lm_head``).

    Example:
      >>> LlamaShape.llama2_7b().n_params / 1e9
      6.738...
    """

    vocab: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    hidden: int = 172
    dtype: Any = jnp.float32
    scan_layers: bool = False
    tie_embeddings: bool = False

    @classmethod
    def llama2_7b(cls, **overrides: Any) -> "LlamaShape":
        """LLaMA-2-7B: d=4096, 32 layers, 32 heads, hidden 11008, vocab 32000, bf16.

        Example:
          >>> LlamaShape.llama2_7b(n_layers=2).n_layers
          2
        """
        kw = dict(vocab=32000, dim=4096, n_layers=32, n_heads=32, hidden=11008, dtype=jnp.bfloat16)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def smollm2_135m(cls, **overrides: Any) -> "LlamaShape":
        """SmolLM2-135M: d=576, 30 layers, 9 heads (3 KV heads), hidden 1536, vocab
        49152, tied embeddings, fp32 here.

        Example:
          >>> round(LlamaShape.smollm2_135m().n_params / 1e6, 1)
          134.5
        """
        kw = dict(vocab=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden=1536,
                  dtype=jnp.float32, tie_embeddings=True)
        kw.update(overrides)
        return cls(**kw)

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one head."""
        return self.dim // self.n_heads

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each parameter of one block.

        Example:
          >>> LlamaShape(dim=8, n_heads=2, hidden=16).layer_shapes()["w1"]
          (8, 16)
        """
        d, h, kv = self.dim, self.hidden, self.kv_heads * self.head_dim
        return {
            "attn_norm": (d,), "wq": (d, d), "wk": (d, kv), "wv": (d, kv), "wo": (d, d),
            "ffn_norm": (d,), "w1": (d, h), "w3": (d, h), "w2": (h, d),
        }

    @property
    def n_params(self) -> int:
        """Total number of parameters."""
        per_layer = sum(int(np.prod(s)) for s in self.layer_shapes().values())
        heads = 1 if self.tie_embeddings else 2
        return heads * self.vocab * self.dim + self.dim + self.n_layers * per_layer


def _shapes(cfg: LlamaShape) -> dict:
    layer = cfg.layer_shapes()
    if cfg.scan_layers:
        layers: Any = {k: (cfg.n_layers,) + s for k, s in layer.items()}
    else:
        layers = [dict(layer) for _ in range(cfg.n_layers)]
    shapes = {"embed": (cfg.vocab, cfg.dim), "layers": layers, "norm": (cfg.dim,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.dim, cfg.vocab)
    return shapes


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def abstract_params(cfg: LlamaShape) -> dict:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves (nothing allocated).

    Example:
      >>> p = abstract_params(LlamaShape.llama2_7b())
      >>> p["layers"][0]["w1"]
      ShapeDtypeStruct(shape=(4096, 11008), dtype=bfloat16)
    """
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, cfg.dtype), _shapes(cfg), is_leaf=_is_shape)


def init_params(cfg: LlamaShape, key: jax.Array) -> dict:
    """Random parameters (small configurations only: this allocates).

    Example:
      >>> p = init_params(LlamaShape(), jax.random.key(0))
      >>> p["lm_head"].shape
      (64, 256)
    """
    shapes = _shapes(cfg)
    leaves, tree = jax.tree.flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, s in zip(keys, leaves):
        if len(s) == 1:  # norm scales
            out.append(jnp.ones(s, cfg.dtype))
        else:
            out.append((jax.random.normal(k, s, jnp.float32) * (s[-2] ** -0.5)).astype(cfg.dtype))
    params = jax.tree.unflatten(tree, out)
    # norm scales start at one, also when stacked
    if cfg.scan_layers:
        for n in ("attn_norm", "ffn_norm"):
            params["layers"][n] = jnp.ones_like(params["layers"][n])
    return params


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    # x: [B, T, H, Dh]
    dh = x.shape[-1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    ang = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [T, Dh/2]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _block(cfg: LlamaShape, lp: dict, x: jax.Array, positions: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h, kv, dh = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    a = _rms_norm(x, lp["attn_norm"])
    q = _rope((a @ lp["wq"]).reshape(b, t, h, dh), positions)
    k = _rope((a @ lp["wk"]).reshape(b, t, kv, dh), positions)
    v = (a @ lp["wv"]).reshape(b, t, kv, dh)
    if kv != h:
        k = jnp.repeat(k, h // kv, axis=2)
        v = jnp.repeat(v, h // kv, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * (dh**-0.5)
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    x = x + o @ lp["wo"]
    f = _rms_norm(x, lp["ffn_norm"])
    g = jax.nn.silu(f @ lp["w1"]) * (f @ lp["w3"])
    return x + g @ lp["w2"]


def forward(params: dict, tokens: jax.Array, cfg: LlamaShape) -> jax.Array:
    """Logits (fp32) for ``tokens`` of shape ``[batch, seq]``.

    Example:
      >>> cfg = LlamaShape()
      >>> forward(init_params(cfg, jax.random.key(0)), jnp.zeros((1, 8), jnp.int32), cfg).shape
      (1, 8, 256)
    """
    x = params["embed"][tokens]
    positions = jnp.arange(tokens.shape[1])
    if cfg.scan_layers:
        def body(x, lp):
            return _block(cfg, lp, x, positions), None

        x, _ = jax.lax.scan(body, x, params["layers"])
    else:
        for lp in params["layers"]:
            x = _block(cfg, lp, x, positions)
    x = _rms_norm(x, params["norm"])
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return (x @ head).astype(jnp.float32)


def loss_fn(params: dict, batch: dict, cfg: LlamaShape) -> jax.Array:
    """Mean next-token cross-entropy; ``batch = {"tokens": int32[B, T], "targets": int32[B, T]}``.

    Example:
      >>> cfg = LlamaShape()
      >>> b = {"tokens": jnp.zeros((1, 8), jnp.int32), "targets": jnp.zeros((1, 8), jnp.int32)}
      >>> float(loss_fn(init_params(cfg, jax.random.key(0)), b, cfg)) > 0
      True
    """
    logits = forward(params, batch["tokens"], cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return nll.mean()


def paper_trainable(path: str, *, first_layer: int = 0, n_layers: int | None = None) -> bool:
    """A PockEngine-style sparse choice: attention and the first FFN projections
    (gate ``w1``, up ``w3``) and the norms of blocks ``first_layer..``; the down projection
    ``w2``, the embeddings and the LM head stay frozen.

    With ``scan_layers`` the choice is per tensor kind (all layers together).

    Args:
      path: dotted parameter path, e.g. ``"layers.3.wq"``.
      first_layer: first trained block (later blocks are trained, earlier frozen).
      n_layers: unused; kept for a uniform signature.

    Returns:
      Whether the parameter is trained.

    Example:
      >>> paper_trainable("layers.3.wq"), paper_trainable("layers.3.w2"), paper_trainable("embed")
      (True, False, False)
    """
    parts = path.split(".")
    if parts[0] != "layers":
        return False
    if len(parts) == 3 and int(parts[1]) < first_layer:
        return False
    return parts[-1] in ("wq", "wk", "wv", "wo", "w1", "w3", "attn_norm", "ffn_norm")


def _path_str(path: tuple) -> str:
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:  # pragma: no cover
            out.append(str(k))
    return ".".join(out)


def _split(params: dict, trainable: Callable[[str], bool]) -> tuple[dict, dict]:
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    mask = [trainable(_path_str(p)) for p, _ in flat]
    train = jax.tree.unflatten(tree, [v if m else None for (_, v), m in zip(flat, mask)])
    frozen = jax.tree.unflatten(tree, [None if m else v for (_, v), m in zip(flat, mask)])
    return train, frozen


def _merge(train: dict, frozen: dict) -> dict:
    return jax.tree.map(lambda a, b: a if a is not None else b, train, frozen, is_leaf=lambda x: x is None)


def make_train_step(cfg: LlamaShape, optimizer: Any, trainable: Callable[[str], bool] | None = None):
    """A train step for full (``trainable=None``) or sparse fine-tuning.

    Full: ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
    Sparse: ``step(train_params, frozen_params, opt_state, batch) -> (train_params,
    opt_state, loss)``; the frozen parameters are plain, non-differentiated inputs, and
    the optimizer state exists only for the trained ones.

    Args:
      cfg: the model shapes.
      optimizer: an ``optax.GradientTransformation`` (e.g. ``optax.adamw(1e-4)``).
      trainable: predicate on dotted parameter paths; None trains everything.

    Returns:
      The step function.

    Example:
      >>> import optax
      >>> cfg = LlamaShape()
      >>> step = make_train_step(cfg, optax.sgd(0.1))
      >>> p = init_params(cfg, jax.random.key(0))
      >>> b = {"tokens": jnp.zeros((1, 8), jnp.int32), "targets": jnp.zeros((1, 8), jnp.int32)}
      >>> p2, s2, loss = step(p, optax.sgd(0.1).init(p), b)
      >>> loss.shape
      ()
    """
    import optax

    if trainable is None:
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    def sparse_step(train, frozen, opt_state, batch):
        def f(tp):
            return loss_fn(_merge(tp, frozen), batch, cfg)

        loss, grads = jax.value_and_grad(f)(train)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, loss

    return sparse_step


def abstract_train_args(
    cfg: LlamaShape,
    optimizer: Any,
    *,
    batch: int = 1,
    seq: int = 512,
    trainable: Callable[[str], bool] | None = None,
) -> tuple[tuple, tuple[str, ...]]:
    """Abstract arguments and per-argument roles for :func:`make_train_step`'s step.

    Args:
      cfg: the model shapes.
      optimizer: the optax optimizer (its state is built with ``jax.eval_shape``).
      batch: batch size.
      seq: sequence length.
      trainable: as in :func:`make_train_step`.

    Returns:
      ``(args, roles)``: a tuple of ``ShapeDtypeStruct`` pytrees and one role per argument.

    Example:
      >>> import optax
      >>> args, roles = abstract_train_args(LlamaShape(), optax.adamw(1e-3), seq=16)
      >>> roles
      ('param', 'opt_state', 'batch')
      >>> args[2]["tokens"]
      ShapeDtypeStruct(shape=(1, 16), dtype=int32)
    """
    params = abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    b = {"tokens": tokens, "targets": tokens}
    if trainable is None:
        opt_state = jax.eval_shape(optimizer.init, params)
        return (params, opt_state, b), ("param", "opt_state", "batch")
    train, frozen = _split(params, trainable)
    opt_state = jax.eval_shape(optimizer.init, train)
    return (train, frozen, opt_state, b), ("param", "param", "opt_state", "batch")


def plan_llama(
    cfg: LlamaShape,
    optimizer: Any = None,
    *,
    batch: int = 1,
    seq: int = 512,
    trainable: Callable[[str], bool] | None = None,
    donate: bool = True,
    budget_gb: float | None = None,
    **analyze_kwargs: Any,
):
    """Plan one fine-tuning step of a LLaMA-shaped model from abstract shapes.

    Args:
      cfg: the model shapes (e.g. ``LlamaShape.llama2_7b()``).
      optimizer: an optax optimizer; default ``optax.adamw(1e-4)`` (moments in the
        parameter dtype).
      batch: batch size.
      seq: sequence length.
      trainable: None for full fine-tuning, else a predicate on dotted paths
        (e.g. :func:`paper_trainable`).
      donate: donate the trained parameters and the optimizer state (the frozen
        parameters are never donated: the next step needs them).
      budget_gb: device memory to compare against.
      **analyze_kwargs: passed to :func:`pockjax.memory.analyze`.

    Returns:
      A :class:`pockjax.memory.Plan`.

    Example:
      >>> p = plan_llama(LlamaShape.llama2_7b(n_layers=2), seq=64, budget_gb=24)
      >>> p.fits, round(p.report.peak_breakdown["weights"] / 2**30, 2)
      (True, 1.24)
    """
    import optax

    from pockjax.memory.planner import plan

    optimizer = optimizer if optimizer is not None else optax.adamw(1e-4)
    args, roles = abstract_train_args(cfg, optimizer, batch=batch, seq=seq, trainable=trainable)
    step = make_train_step(cfg, optimizer, trainable)
    donate_argnums = () if not donate else ((0, 1) if trainable is None else (0, 2))
    return plan(step, args, roles=roles, donate_argnums=donate_argnums, budget_gb=budget_gb, **analyze_kwargs)


def plan_llama_peaks(n_layers: int = 32, seq: int = 512) -> dict[str, int]:
    """Peak bytes of LLaMA-2-7B-shaped full and sparse (:func:`paper_trainable`) steps.

    A picklable entry point for measuring the planner itself (e.g. its peak RSS in a
    fresh process with :func:`pockjax.memory.peak_rss`).

    Example:
      >>> peaks = plan_llama_peaks(n_layers=1, seq=16)
      >>> peaks["sparse"] < peaks["full"]
      True
    """
    cfg = LlamaShape.llama2_7b(n_layers=n_layers)
    return {
        "full": plan_llama(cfg, seq=seq).peak_bytes,
        "sparse": plan_llama(cfg, seq=seq, trainable=paper_trainable).peak_bytes,
    }

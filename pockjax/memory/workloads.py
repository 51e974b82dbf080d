"""Fine-tuning steps of pockjax's Flax LLaMA, shared by ``pockjax memory`` and benchmarks.

:func:`llama_workload` builds the ordinary, full fine-tuning AdamW step of
:mod:`pockjax.models.llama` (``value_and_grad`` of the next-token loss, ``optax``
update) together with an :class:`~pockjax.UpdateScheme` (``full``, ``paper``,
``norm-only``) and the step's arguments, either abstract
(``jax.ShapeDtypeStruct``, nothing allocated: enough to compile and plan) or real
(pretrained weights for ``smollm2-135m``, random ones for ``tiny``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["MODELS", "SCHEMES", "Workload", "llama_workload", "paper_scheme", "sparse_block_count"]

#: Model names :func:`llama_workload` knows.
MODELS = ("tiny", "smollm2-135m")
#: Scheme names :func:`llama_workload` knows.
SCHEMES = ("full", "paper", "norm-only")


def sparse_block_count(n_layers: int) -> int:
    """How many of the last blocks the ``paper`` scheme trains: 8 of SmolLM2's 30,
    the same fraction elsewhere (at least one).

    Example:
      >>> sparse_block_count(30), sparse_block_count(32), sparse_block_count(2)
      (8, 9, 1)
    """
    return max(1, round(n_layers * 8 / 30))


def paper_scheme(n_layers: int, n_blocks: int | None = None):
    """PockEngine's choice for transformers: attention (q, k, v, o) and the first FFN
    projection (``mlp.w1``) of the last ``n_blocks`` blocks; everything else frozen.

    Example:
      >>> s = paper_scheme(30)
      >>> str(s.rule_for("layers.29.attn.wq.kernel")[0]), str(s.rule_for("layers.21.attn.wq.kernel")[0])
      ('full', 'frozen')
    """
    import pockjax

    k = sparse_block_count(n_layers) if n_blocks is None else n_blocks
    rules = {}
    for i in range(n_layers - k, n_layers):
        rules[f"layers.{i}.attn.*.kernel"] = "full"
        rules[f"layers.{i}.mlp.w1.kernel"] = "full"
    return pockjax.UpdateScheme(rules, name=f"paper (last {k} of {n_layers} blocks)")


def _scheme(name: str, n_layers: int):
    import pockjax

    if name == "full":
        return None
    if name == "paper":
        return paper_scheme(n_layers)
    if name == "norm-only":
        return pockjax.UpdateScheme.norm_only()
    raise ValueError(f"unknown scheme {name!r}; known: {SCHEMES}")


@dataclasses.dataclass
class Workload:
    """A train step, its arguments, and how it is meant to be compiled.

    Attributes:
      step: ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
      args: ``(params, opt_state, batch)``: abstract or real.
      scheme: the :class:`~pockjax.UpdateScheme`, or None for full fine-tuning.
      config: the model's :class:`~pockjax.models.llama.LlamaConfig`.
      tx: the optax optimizer.
    """

    step: Callable
    args: tuple
    scheme: Any
    config: Any
    tx: Any


def llama_workload(
    model: str = "tiny",
    scheme: str = "full",
    *,
    batch: int = 4,
    seq: int = 128,
    lr: float = 1e-4,
    abstract: bool = True,
    seed: int = 0,
) -> Workload:
    """The AdamW fine-tuning step of a Flax LLaMA and its arguments.

    Args:
      model: ``"tiny"`` (:meth:`LlamaConfig.tiny`, random weights) or
        ``"smollm2-135m"`` (the pretrained GGUF when ``abstract=False``).
      scheme: ``"full"``, ``"paper"`` (:func:`paper_scheme`) or ``"norm-only"``.
      batch, seq: token batch shape.
      lr: AdamW learning rate.
      abstract: ``jax.ShapeDtypeStruct`` arguments (nothing allocated).
      seed: for random weights and tokens.

    Returns:
      A :class:`Workload`. For a sparse scheme the optimizer state holds the trained
      entries only (:func:`pockjax.init_opt_state`).

    Example:
      >>> w = llama_workload("tiny", "paper", batch=1, seq=8)
      >>> w.args[2]["tokens"].shape, w.scheme.name
      ((1, 8), 'paper (last 1 of 2 blocks)')
    """
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import llama

    if model == "tiny":
        cfg = llama.LlamaConfig.tiny().replace(max_seq_len=max(seq, 64))
    elif model in ("smollm2-135m", "smollm2"):
        cfg = llama.LlamaConfig.smollm2_135m().replace(max_seq_len=max(seq, 512))
    else:
        raise ValueError(f"unknown model {model!r}; known: {MODELS}")
    upd = _scheme(scheme, cfg.n_layers)
    tx = optax.adamw(lr)

    if abstract:
        m = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(seed)))
        graphdef, params = llama.split(m)
    elif model == "tiny":
        graphdef, params = llama.split(llama.Llama(cfg, rngs=nnx.Rngs(seed)))
    else:
        m, _ = llama.load_pretrained("smollm2-135m", max_seq_len=cfg.max_seq_len)
        graphdef, params = llama.split(m)
        del m

    # under jit, so that the state of frozen parameters is never allocated (dead code)
    if upd is None:
        opt_state = jax.eval_shape(tx.init, params) if abstract else jax.jit(tx.init)(params)
    elif abstract:
        opt_state = jax.eval_shape(lambda p: pockjax.init_opt_state(tx, p, upd), params)
    else:
        opt_state = jax.jit(lambda p: pockjax.init_opt_state(tx, p, upd))(params)

    if abstract:
        tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        b = {"tokens": tok, "targets": tok, "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    else:
        tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, cfg.vocab)
        b = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((batch, seq), jnp.float32)}

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = llama.apply(graphdef, p, batch["tokens"])
            return llama.next_token_loss(logits, batch["targets"], batch["loss_mask"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return Workload(step, (params, opt_state, b), upd, cfg, tx)

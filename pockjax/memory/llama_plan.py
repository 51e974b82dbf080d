"""The Flax LLaMA fine-tuning step from abstract shapes: what ``pockjax plan`` and
``pockjax memory`` analyse.

The model is :class:`pockjax.models.llama.Llama` built with ``nnx.eval_shape``
from a :class:`~pockjax.models.llama.LlamaConfig` (``LlamaConfig.llama2_7b()``,
``.smollm2_135m()``, ``.tiny()``): every parameter is a ``jax.ShapeDtypeStruct``,
nothing is allocated, so a LLaMA-2-7B step is planned on a laptop. The step is
the one ``pockjax finetune`` trains (``value_and_grad`` of the next-token loss,
an ``optax`` update); the scheme comes from :mod:`pockjax.schemes`, and the
optimizer state exists for what the scheme trains only
(:func:`pockjax.init_opt_state`).

Example:
  >>> from pockjax.models.llama import LlamaConfig
  >>> r = plan_llama(LlamaConfig.tiny(), "paper", seq=16)
  >>> r.scheme.name, r.trainable, r.total
  ('paper (last 2 blocks)', 49152, 78144)
  >>> r.inplace.peak_bytes <= r.program.peak_bytes
  True
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["MODELS", "LlamaPlan", "LlamaStep", "abstract_llama_step", "model_config", "plan_llama",
           "train_step"]

#: ``--model`` names of ``pockjax plan``/``pockjax memory`` and their configs.
MODELS: dict[str, Callable[..., Any]] = {}


def _models() -> dict[str, Callable[..., Any]]:
    if not MODELS:
        from pockjax.models.llama import LlamaConfig

        MODELS.update({"llama2-7b": LlamaConfig.llama2_7b, "smollm2-135m": LlamaConfig.smollm2_135m,
                       "tiny": LlamaConfig.tiny})
    return MODELS


def model_config(model: str, **overrides: Any):
    """The :class:`~pockjax.models.llama.LlamaConfig` of a ``--model`` name.

    Example:
      >>> model_config("llama2-7b").n_layers, model_config("smollm2-135m", n_layers=2).n_layers
      (32, 2)
    """
    models = _models()
    if model not in models:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(models)}")
    return models[model](**overrides)


def train_step(graphdef: Any, tx: Any) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: the ordinary, full
    fine-tuning step of a Flax LLaMA (``batch`` holds ``tokens``, ``targets``, ``loss_mask``)."""
    import optax

    from pockjax.models import llama

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = llama.apply(graphdef, p, batch["tokens"])
            return llama.next_token_loss(logits, batch["targets"], batch["loss_mask"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@dataclasses.dataclass
class LlamaStep:
    """A train step and its abstract arguments.

    Attributes:
      step: ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
      args: ``(params, opt_state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees.
      scheme: the :class:`~pockjax.UpdateScheme`.
      config: the model's :class:`~pockjax.models.llama.LlamaConfig`.
      tx: the optax optimizer.
      graphdef: the model's graph definition (for :func:`pockjax.models.llama.merge`).
    """

    step: Callable
    args: tuple
    scheme: Any
    config: Any
    tx: Any
    graphdef: Any


def abstract_llama_step(config: Any, scheme: Any = "full", *, dtype: Any = jnp.float32, batch: int = 1,
                        seq: int = 512, optimizer: Any = None, blocks: int | None = None) -> LlamaStep:
    """The fine-tuning step of a Flax LLaMA with abstract arguments (nothing allocated).

    Args:
      config: a :class:`~pockjax.models.llama.LlamaConfig`.
      scheme: a name of :mod:`pockjax.schemes` (``full``, ``paper``, ...), a scheme
        file, or an :class:`~pockjax.UpdateScheme`: the optimizer state is then a
        :class:`~pockjax.SparseOptState` for what it trains. ``None``: plain
        ``tx.init`` state for every parameter, a step for ``jax.jit`` as it is.
      dtype: the parameters' dtype (and so the optimizer moments', optax's default).
      batch, seq: token batch shape.
      optimizer: an optax optimizer; default ``optax.adamw(1e-4)``.
      blocks: ``--blocks`` of block-wise schemes (default: the registry's).

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> w = abstract_llama_step(LlamaConfig.tiny(), "paper", batch=1, seq=8)
      >>> w.args[2]["tokens"].shape, w.scheme.name
      ((1, 8), 'paper (last 2 blocks)')
    """
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import llama
    from pockjax.schemes import resolve_scheme

    if isinstance(scheme, str):
        scheme = resolve_scheme(scheme, config, blocks=blocks)
    tx = optimizer if optimizer is not None else optax.adamw(1e-4)
    if seq > config.max_seq_len:
        config = config.replace(max_seq_len=seq)
    model = nnx.eval_shape(lambda: llama.Llama(config, rngs=nnx.Rngs(0), param_dtype=dtype))
    graphdef, params = llama.split(model)
    if scheme is None:
        opt_state = jax.eval_shape(tx.init, params)
    else:
        opt_state = jax.eval_shape(lambda p: pockjax.init_opt_state(tx, p, scheme), params)
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    b = {"tokens": tok, "targets": tok, "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    return LlamaStep(train_step(graphdef, tx), (params, opt_state, b), scheme, config, tx, graphdef)


@dataclasses.dataclass
class LlamaPlan:
    """What :func:`plan_llama` found.

    Attributes:
      scheme: the :class:`~pockjax.UpdateScheme` planned.
      trainable, total: trained and all parameters (``scheme.describe(params)``,
        the figures ``pockjax finetune`` prints).
      program: the liveness report of the step after the default passes
        (``sparse_grad``, ``dce``, ...), in the order JAX emits.
      inplace: the same after ``inplace_update`` (each update right after its gradient).
      graph: the step after the default passes.
      seconds: ``{"trace", "passes", "inplace_update", "analyze"}``.
    """

    scheme: Any
    trainable: int
    total: int
    program: Any
    inplace: Any
    graph: Any
    seconds: dict[str, float]


def plan_llama(config: Any, scheme: Any = "full", *, dtype: Any = jnp.float32, batch: int = 1,
               seq: int = 512, optimizer: Any = None, blocks: int | None = None, donate: bool = True,
               **analyze_kwargs: Any) -> LlamaPlan:
    """Plans one fine-tuning step of a Flax LLaMA from shapes, with and without the
    in-place update order.

    The step is traced (:func:`pockjax.trace_step`), rewritten by the default
    passes of ``pockjax.compile`` for the scheme, and analysed with parameters
    and optimizer state donated, as ``pockjax.compile`` does (frozen parameters
    are outputs too, so they live to the end).

    Args:
      config, scheme, dtype, batch, seq, optimizer, blocks: as :func:`abstract_llama_step`
        (``scheme=None`` plans full fine-tuning with plain optax state).
      donate: parameters and optimizer state donated (``False``: the caller keeps them,
        so the new values are written beside the old).
      **analyze_kwargs: passed to :func:`pockjax.memory.analyze` (``schedule``, ``fusion``).

    Example (not run: about a minute on 2 cores)::

      r = plan_llama(LlamaConfig.llama2_7b(), "paper", dtype=jnp.bfloat16)
      print(r.inplace.summary())
    """
    import pockjax
    from pockjax.memory.liveness import analyze
    from pockjax.optim.state import SparseOptState
    from pockjax.transforms.inplace_update import inplace_update

    w = abstract_llama_step(config, scheme, dtype=dtype, batch=batch, seq=seq, optimizer=optimizer,
                            blocks=blocks)
    scheme = w.scheme if w.scheme is not None else pockjax.UpdateScheme.full()
    desc = scheme.describe(w.args[0])
    params, opt_state, batch_ = w.args
    sparse_state = isinstance(opt_state, SparseOptState)
    t0 = time.perf_counter()
    # traced against the full optimizer state, as pockjax.compile does; sparse_grad
    # then drops the state of what the scheme freezes
    traced = pockjax.trace_step(w.step, (params, opt_state.full_abstract() if sparse_state else opt_state, batch_))
    t1 = time.perf_counter()
    passes = pockjax.default_passes(w.scheme, sparse_state)
    graph = passes(traced)
    t2 = time.perf_counter()
    donated = {"param", "opt_state"} if donate else False
    program = analyze(graph, donate=donated, **analyze_kwargs)
    t3 = time.perf_counter()
    inplace = analyze(inplace_update()(graph), donate=donated, **analyze_kwargs)
    t4 = time.perf_counter()
    seconds = {"trace": t1 - t0, "passes": t2 - t1, "analyze": t3 - t2, "inplace_update": t4 - t3}
    return LlamaPlan(scheme, desc.trainable, desc.total, program, inplace, graph, seconds)

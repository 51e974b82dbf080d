"""Ordinary (full) train steps for LLaMA models, written as a user would.

pockjax compiles them with a scheme; nothing here knows about sparsity.
"""

from __future__ import annotations

from typing import Any, Callable

#: XLA compiler options that turn off XLA's YNNPACK fusions on CPU: every dot
#: runs on XLA's own kernels (applied on the CPU platform only).
XLA_OWN_DOT_KERNELS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def answer_step_xla_options(vendor: str | None = None, avx512: bool | None = None) -> dict:
    """XLA compiler options for :func:`answer_train_step` on a CPU of ``vendor``.

    ``pockjax finetune`` and the benchmarks compile the answer-window step with
    these (``pockjax.compile(..., xla_options=...)``). Which dot kernels are
    faster for this step was measured to depend on the host
    (docs/benchmarks.md):

    * AMD without AVX-512 (a Zen 3 EPYC): XLA's own kernels
      (:data:`XLA_OWN_DOT_KERNELS`). There the two were even on the
      projections, XLA's twice as fast on the attention products, and the
      step 2-6% faster.
    * Anything with AVX-512: XLA's default, YNNPACK's fusions. On an Intel
      Xeon they ran the SmolLM2 projections at 250-290 GFLOP/s against
      165-230 for XLA's own kernels, and the step 7-8% faster (``paper``
      0.86 / 0.84 s against 0.91 / 0.93 s, full 1.60 / 1.58 / 1.65 s against
      1.74 / 1.76 / 1.72 s). On a Zen 5 EPYC the step was 5-7% faster
      (``paper`` 0.483 s against 0.509 s, full 0.968 s against 1.034 s,
      medians of 10 and 8 alternating steps).
    * Anything else: XLA's default (not measured).

    Not for steps that project every position onto the vocabulary: on a
    512 x 576 x 49152 product XLA's own kernel was 2.4x slower than YNNPACK's.

    Args:
      vendor: ``"intel"``, ``"amd"`` or ``""``; None reads this host's
        (:func:`pockjax.host.cpu_vendor`).
      avx512: Whether the CPU has AVX-512; None reads this host's
        (:func:`pockjax.host.cpu_has_avx512`).

    Example:
      >>> answer_step_xla_options("amd", avx512=False) == XLA_OWN_DOT_KERNELS
      True
      >>> answer_step_xla_options("amd", avx512=True), answer_step_xla_options("intel", avx512=True)
      ({}, {})
    """
    from pockjax.host import cpu_has_avx512, cpu_vendor

    if vendor is None:
        vendor = cpu_vendor()
    if avx512 is None:
        avx512 = cpu_has_avx512()
    return dict(XLA_OWN_DOT_KERNELS) if vendor == "amd" and not avx512 else {}


#: :func:`answer_step_xla_options` of this host.
ANSWER_STEP_XLA_OPTIONS = answer_step_xla_options()


def lm_train_step(graphdef: Any, tx: Any) -> Callable:
    """``step(params, opt_state, tokens, targets, loss_mask) -> (params, opt_state, loss)``.

    Next-token cross-entropy over the positions where ``loss_mask`` is 1,
    ``jax.value_and_grad`` over ``params`` (from ``llama.split``), then ``tx``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pockjax.models import llama
        >>> graphdef, params = llama.split(llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
        >>> tx = optax.sgd(0.1)
        >>> step = lm_train_step(graphdef, tx)
        >>> t = jnp.ones((1, 4), jnp.int32)
        >>> params, _, loss = step(params, tx.init(params), t, t, jnp.ones((1, 4)))
        >>> loss.shape
        ()
    """
    import jax
    import optax

    from pockjax.models import llama

    def train_step(params, opt_state, tokens, targets, loss_mask):
        def loss_fn(p):
            return llama.next_token_loss(llama.apply(graphdef, p, tokens), targets, loss_mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def answer_train_step(graphdef: Any, tx: Any, window: int) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` on answer windows.

    ``batch`` is a dict from :class:`pockjax.data.Batcher` (``tokens``,
    ``targets``, ``loss_mask``, ``loss_start``); the loss is
    :func:`pockjax.models.llama.answer_loss`, which runs the output projection
    only on ``window`` positions per row (``Batcher.answer_window``). This is
    the step ``pockjax finetune`` and the benchmarks train with.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pockjax.models import llama
        >>> graphdef, params = llama.split(llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
        >>> tx = optax.sgd(0.1)
        >>> step = answer_train_step(graphdef, tx, window=2)
        >>> batch = {"tokens": jnp.array([[5, 6, 7, 8]]), "targets": jnp.array([[6, 7, 8, 0]]),
        ...          "loss_mask": jnp.array([[0., 1., 1., 0.]]), "loss_start": jnp.array([1])}
        >>> params, _, loss = step(params, tx.init(params), batch)
        >>> loss.shape
        ()
    """
    import jax
    import optax

    from pockjax.models import llama

    def loss_fn(params, batch):
        return llama.answer_loss(llama.merge(graphdef, params), batch, window)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step

"""Ordinary (full) train steps for LLaMA models, written as a user would.

pockjax compiles them with a scheme; nothing here knows about sparsity.
"""

from __future__ import annotations

from typing import Any, Callable

from pockjax.backends.xla import XLA_OWN_DOT_KERNELS  # noqa: F401  (re-exported: the step's options)


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
    * Anything with AVX-512: XLA's default, YNNPACK's fusions, which ran the
      SmolLM2 projections faster than XLA's own kernels on an Intel Xeon and
      made the step a few percent faster there and on a Zen 5 EPYC.
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
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pockjax.models import llama
        >>> graphdef, params = llama.split(llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
        >>> tx = optax.sgd(0.1)
        >>> step = jax.jit(lm_train_step(graphdef, tx))  # or pockjax.compile
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


def answer_train_step(graphdef: Any, tx: Any, window: int, *,
                      health: Any = None, accum: int = 1) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` on answer windows.

    ``batch`` is a dict from :class:`pockjax.data.Batcher` (``tokens``,
    ``targets``, ``loss_mask``, ``loss_start``); the loss is
    :func:`pockjax.models.llama.answer_loss`, which runs the output projection
    only on ``min(window, row length)`` positions per row
    (``Batcher.answer_window``). This is the step ``pockjax finetune`` and the
    benchmarks train with. It compiles once per row length (one per bucket
    of ``Batcher(buckets=...)``).

    With ``health`` (an :class:`~pockjax.UpdateScheme`, or True for every
    parameter) the step also returns :func:`weight_health` of its result:
    ``(params, opt_state, loss, health)``.

    With ``accum=K`` > 1 (gradient accumulation) every leaf of ``batch`` has
    a leading axis of K micro-batches (``(K, B, T)`` tokens): a ``lax.scan``
    over them sums the gradients, and the optimizer updates once. The loss is
    the mean over the loss positions of all K*B rows (each micro-batch
    weighted by its count of loss positions), so the step equals one step on
    the K*B rows at once up to float rounding, with the activations of only B
    rows alive at a time. The gradients are taken inside the scan, where
    pockjax's passes still see them: optimizer state exists for the trained
    entries only, and the backward ops of frozen ones are pruned.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pockjax.models import llama
        >>> model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> graphdef, params = llama.split(model)
        >>> tx = optax.sgd(0.1)
        >>> step = jax.jit(answer_train_step(graphdef, tx, window=2))  # or pockjax.compile
        >>> batch = {"tokens": jnp.array([[5, 6, 7, 8]]), "targets": jnp.array([[6, 7, 8, 0]]),
        ...          "loss_mask": jnp.array([[0., 1., 1., 0.]]), "loss_start": jnp.array([1])}
        >>> params, _, loss = step(params, tx.init(params), batch)
        >>> loss.shape
        ()
    """
    import jax
    import jax.numpy as jnp
    import optax

    from pockjax.models import llama

    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum must be a whole number >= 1 (micro-batches per update), got {accum!r}")

    def loss_fn(params, batch):
        w = min(window, batch["tokens"].shape[-1])  # static: one window per row length
        return llama.answer_loss(llama.merge(graphdef, params), batch, w)

    def accumulated(params, batch):
        lead = {k: v.shape[0] for k, v in batch.items()}
        if set(lead.values()) != {accum}:
            raise ValueError(f"accum={accum}: every batch leaf needs a leading axis of {accum}"
                             f" micro-batches, got {lead}")
        counts = jnp.sum(jax.vmap(lambda b: answer_positions(b, min(window, b["tokens"].shape[-1])))(batch), axis=1)
        total = jnp.maximum(jnp.sum(counts), 1.0)

        def micro(carry, xs):
            mb, count = xs
            # mean over this micro-batch's positions * their share of all positions
            part, g = jax.value_and_grad(lambda p: loss_fn(p, mb) * (count / total))(params)
            return jax.tree.map(jnp.add, carry, (part, g)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(micro, zeros, (batch, counts))
        return loss, grads

    def train_step(params, opt_state, batch):
        if accum == 1:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        else:
            loss, grads = accumulated(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if health is None:
            return params, opt_state, loss
        return params, opt_state, loss, weight_health(loss, params, health)

    return train_step


def answer_positions(batch: dict, window: int) -> Any:
    """Per row, how many loss positions :func:`~pockjax.models.llama.answer_loss` averages over.

    The positions of ``loss_mask`` inside the row's window of ``window``
    positions from ``loss_start`` (and inside the row), as float32 ``(batch,)``:
    :func:`answer_train_step` weights micro-batches by their sum. The window
    is :func:`~pockjax.models.llama.answer_window`, the one ``answer_loss`` reads.

    Example:
        >>> import jax.numpy as jnp
        >>> batch = {"tokens": jnp.zeros((2, 4), jnp.int32), "loss_start": jnp.array([1, 3]),
        ...          "loss_mask": jnp.array([[0., 1., 1., 0.], [0., 0., 0., 1.]])}
        >>> answer_positions(batch, window=2).tolist()
        [2.0, 1.0]
    """
    import jax.numpy as jnp

    from pockjax.models.llama.model import answer_window

    _, mask = answer_window(batch, window)
    return jnp.sum(mask.astype(jnp.float32), axis=1)


def weight_health(loss: Any, params: Any, scheme: Any = True) -> Any:
    """One float32 scalar that says whether a train step's result is usable.

    It is the sum of the squares of the fully trained parameters (their
    squared L2 norm), or ``inf`` when the loss is not finite; a NaN or an
    infinity in a trained parameter (or a sum that overflows) makes it NaN or
    ``inf``. So ``jnp.isfinite(health)`` is the finiteness flag, and
    ``sqrt(health)`` the size of the weights (``pockjax finetune`` stops the
    run on either). One multiply-add per element in one reduction per
    tensor, fused by the compiler: call it inside the step, on its outputs.

    The optimizer state is not read (that would triple the cost): a NaN there
    reaches the parameters in the same update, and ``pockjax finetune``
    checks the state on the host before each checkpoint.

    Args:
      loss: The step's loss.
      params: The updated parameters.
      scheme: An :class:`~pockjax.UpdateScheme`: only the parameters it trains
        fully are read; the frozen ones never change, and a channel-ruled one
        is updated channel by channel, which reading it whole here would undo
        (a NaN there reaches the next step's loss). True: every parameter.

    Example:
        >>> import jax.numpy as jnp
        >>> float(weight_health(jnp.float32(1.0), {"w": jnp.array([1.0, -3.0])}))
        10.0
        >>> float(weight_health(jnp.float32(1.0), {"w": jnp.array([1.0, jnp.nan])}))
        nan
        >>> float(weight_health(jnp.float32(jnp.nan), {"w": jnp.array([1.0, -3.0])}))
        inf
    """
    import jax
    import jax.numpy as jnp

    from pockjax.scheme import Full

    checked = [x for x, r in zip(jax.tree.leaves(params), _rules(params, scheme))
               if isinstance(r, Full) and jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    # The barrier makes the reductions one pass over the updated weights,
    # kept out of the fusions that compute the update (that pass alone takes
    # about 0.5% of the default finetune step on a 2-core CPU).
    checked = jax.lax.optimization_barrier(checked)
    total = jnp.float32(0)
    for x in checked:
        x = x.astype(jnp.float32)
        total = total + jnp.sum(x * x)
    return jnp.where(jnp.isfinite(loss), total, jnp.float32(jnp.inf))


def _rules(params: Any, scheme: Any) -> list:
    import jax
    import numpy as np

    from pockjax.paths import leaf_paths
    from pockjax.scheme import Full

    leaves = jax.tree.leaves(params)
    if scheme is True or scheme is None:
        return [Full()] * len(leaves)
    return scheme.resolve(leaf_paths(params), [np.shape(x) for x in leaves])


def first_non_finite(**trees: Any) -> str | None:
    """``"NAME path (n NaN, m inf)"`` of the first leaf holding a NaN or an infinity, or None.

    Read on the host (after :func:`weight_health` said something is wrong).

    Example:
        >>> import numpy as np
        >>> first_non_finite(params={"a": np.ones(2), "b": np.array([np.nan, np.inf, 1.0])})
        'params b (1 NaN, 1 inf)'
    """
    import jax
    import numpy as np

    from pockjax.paths import leaf_paths

    for name, tree in trees.items():
        for path, x in zip(leaf_paths(tree), jax.tree.leaves(tree)):
            x = np.asarray(x)
            if not np.issubdtype(x.dtype, np.floating) and x.dtype.kind != "V":
                continue
            x = x.astype(np.float32, copy=False)
            if np.isfinite(x).all():
                continue
            bad = ~np.isfinite(x)
            if bad.any():
                n_nan = int(np.isnan(x).sum())
                where = f"{name} {path}".strip() if path else name
                return f"{where} ({n_nan} NaN, {int(bad.sum()) - n_nan} inf)"
    return None

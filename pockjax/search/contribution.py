"""How much fine-tuning each unit would gain: a gradient proxy, and real short fine-tunes.

The proxy is the first-order loss decrease of Adam's update. Adam moves an
entry by about ``lr * m / sqrt(v)``; over batches whose gradients have mean
``mu`` and mean square ``s``, the expected first-order loss change of one step
is ``-lr * mu**2 / sqrt(s)`` per entry (``-lr * |g|`` for a single batch: the
sign step). Summed over a tensor's entries this is the unit's *gain*:

    gain(u) = lr * sum_entries mean_b(g)**2 / sqrt(mean_b(g**2))

Noisy entries (gradients that disagree between batches) count less than
consistent ones, and a bigger tensor gains more when its gradients are as
consistent. It needs one backward pass per batch for all units at once
(:func:`gradient_proxy`). :func:`short_finetunes` measures the real thing: a
few AdamW steps with only one unit trainable, and the held-out loss decrease;
:func:`spearman` compares the two rankings.

Example:
  >>> from flax import nnx
  >>> from pockjax.models import llama
  >>> from pockjax.search.units import Unit, all_units
  >>> model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  >>> tok = jnp.ones((2, 16), jnp.int32)
  >>> batch = {"tokens": tok, "targets": tok, "loss_mask": jnp.ones((2, 16)), "loss_start": jnp.zeros(2, jnp.int32)}
  >>> c = gradient_proxy(model, [batch, batch], 4, all_units(model.config))
  >>> len(c.gain), all(v >= 0 for v in c.gain.values())
  (14, True)
  >>> r = short_finetunes(model, [batch], [batch], 4, [Unit(1, "w2")], steps=2, lr=1e-2)
  >>> r["gain"][Unit(1, "w2")] > 0
  True
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pockjax.search.units import Unit

__all__ = ["Contribution", "gradient_proxy", "short_finetunes", "spearman"]


@dataclasses.dataclass
class Contribution:
    """Per-unit proxies from :func:`gradient_proxy`.

    Attributes:
      gain: the Adam first-order gain (the search's objective).
      abs_grad: ``lr * sum |mean_b g|`` (sign-step gain of the mean gradient).
      grad_norm: ``||mean_b g||``.
      batches: batches used.
      seconds: wall time.
    """

    gain: dict
    abs_grad: dict
    grad_norm: dict
    batches: int
    seconds: float


def _split_units(model: Any, units: Sequence[Unit]):
    from pockjax.models import llama

    graphdef, params = llama.split(model)
    flat = llama.flatten_params(params)
    paths = [u.path for u in units]
    missing = [p for p in paths if p not in flat]
    if missing:
        raise KeyError(f"the model has no parameter {missing[0]!r}")
    sub = {p: flat[p] for p in paths}
    rest = {p: v for p, v in flat.items() if p not in sub}
    return graphdef, sub, rest


def _loss_fn(graphdef, window):
    from pockjax.models import llama

    def loss(sub, rest, batch):
        model = llama.merge(graphdef, llama.unflatten_params({**rest, **sub}))
        if window is None:
            return llama.next_token_loss(model(batch["tokens"]), batch["targets"], batch["loss_mask"])
        return llama.answer_loss(model, batch, window)

    return loss


def _device_batch(b: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in b.items() if k in ("tokens", "targets", "loss_mask", "loss_start")}


def gradient_proxy(model: Any, batches: Sequence[dict], window: int | None, units: Sequence[Unit], *,
                   lr: float = 3e-4, eps: float = 1e-12,
                   progress: Callable[[int], None] | None = None) -> Contribution:
    """Gradient statistics of every unit over ``batches`` (one backward pass each).

    Args:
      model: an unrolled :class:`pockjax.models.llama.Llama`.
      batches: task batches (``pockjax.data.Batcher.batch``).
      window: the answer window (None: next-token loss on every position).
      units: the candidate units.
      lr: the learning rate the gains are scaled by.
      progress: called with 1 after each batch (a progress bar's ``update``).
    """
    if not batches:
        raise ValueError("gradient_proxy needs at least one batch")
    t0 = time.perf_counter()
    graphdef, sub, rest = _split_units(model, units)
    grad = jax.jit(jax.grad(_loss_fn(graphdef, window)))
    s1 = {p: jnp.zeros_like(v) for p, v in sub.items()}
    s2 = {p: jnp.zeros_like(v) for p, v in sub.items()}
    acc = jax.jit(lambda s1, s2, g: (jax.tree.map(jnp.add, s1, g),
                                      jax.tree.map(lambda a, x: a + x * x, s2, g)))
    for b in batches:
        g = grad(sub, rest, _device_batch(b))
        s1, s2 = acc(s1, s2, g)
        if progress:
            progress(1)
    n = len(batches)

    @jax.jit
    def stats(s1, s2):
        mu = jax.tree.map(lambda a: a / n, s1)
        ms = jax.tree.map(lambda a: a / n, s2)
        gain = jax.tree.map(lambda m, s: lr * jnp.sum(m * m / jnp.sqrt(s + eps)), mu, ms)
        ab = jax.tree.map(lambda m: lr * jnp.sum(jnp.abs(m)), mu)
        nrm = jax.tree.map(lambda m: jnp.sqrt(jnp.sum(m * m)), mu)
        return gain, ab, nrm

    gain, ab, nrm = jax.device_get(stats(s1, s2))
    by = {u.path: u for u in units}
    return Contribution({by[p]: float(v) for p, v in gain.items()}, {by[p]: float(v) for p, v in ab.items()},
                        {by[p]: float(v) for p, v in nrm.items()}, n, time.perf_counter() - t0)


def short_finetunes(model: Any, train_batches: Sequence[dict], eval_batches: Sequence[dict], window: int | None,
                    units: Sequence[Unit], *, steps: int = 8, lr: float = 3e-4,
                    progress: Callable[[int], None] | None = None) -> dict:
    """Real short fine-tunes, one per unit with only that unit trainable.

    Each run starts from the model's weights, takes ``steps`` AdamW steps on
    ``train_batches`` (cycled) and measures the mean held-out loss on
    ``eval_batches``. One step function is compiled for all units: the
    gradient is taken for every listed unit and masked to the one being
    trained (AdamW from a zero state moves an entry with a zero gradient by
    exactly zero), so each run's updates equal a one-unit fine-tune's.

    Returns:
      ``{"loss_before": float, "loss_after": {unit: float}, "gain": {unit: before - after},
      "steps": steps, "seconds": wall}``.

    The module's example runs it for one unit after :func:`gradient_proxy`.
    """
    t0 = time.perf_counter()
    graphdef, sub, rest = _split_units(model, units)
    loss = _loss_fn(graphdef, window)
    tx = optax.adamw(lr, weight_decay=0.0)
    train = [_device_batch(b) for b in train_batches]
    held = [_device_batch(b) for b in eval_batches]

    @jax.jit
    def step(sub, opt, mask, batch):
        g = jax.grad(loss)(sub, rest, batch)
        g = {p: v * mask[p] for p, v in g.items()}
        upd, opt = tx.update(g, opt, sub)
        return optax.apply_updates(sub, upd), opt

    eval_loss = jax.jit(loss)

    def held_loss(s):
        return float(np.mean([float(eval_loss(s, rest, b)) for b in held]))

    before = held_loss(sub)
    after, gain = {}, {}
    for u in units:
        mask = {p: jnp.float32(p == u.path) for p in sub}
        s, opt = sub, tx.init(sub)
        for i in range(steps):
            s, opt = step(s, opt, mask, train[i % len(train)])
        after[u] = held_loss(s)
        gain[u] = before - after[u]
        if progress:
            progress(1)
    return {"loss_before": before, "loss_after": after, "gain": gain, "steps": steps,
            "seconds": time.perf_counter() - t0}


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):  # average ranks of ties
        idx = x == v
        r[idx] = r[idx].mean()
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (ties get average ranks).

    Example:
      >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
      (1.0, -1.0)
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two sequences of the same length >= 2")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    d = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / d) if d else 0.0

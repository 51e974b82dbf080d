"""Layers shared by pockjax's models.

* :class:`Dropout`: ``nnx.Dropout`` that draws 16 random bits per element
  instead of 32, so a mask costs half the random-number generation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Dropout", "keep_mask"]

#: Random bits per dropout mask element: a dropout rate is resolved to ``1 / 2**16``.
MASK_BITS = 16


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> tuple[jax.Array, float]:
    """``(mask, keep)``: a boolean keep-mask of ``shape`` and its exact keep probability.

    Each 32-bit random word gives two elements their 16 bits (the low half to
    the first half of the last axis, the high half to the second), so drawing
    a mask hashes half as many words as ``jax.random.bernoulli``, whose uniform
    floats take a word each: on all-MiniLM-L6-v2's training step (dropout on
    the hidden states and on every attention matrix) the masks' random
    numbers were the largest cost after the matrix products. An element is
    dropped when its 16 bits are below ``round(rate * 2**16)``, so the keep
    probability is ``1 - round(rate * 2**16) / 2**16`` (0.899994 for rate
    0.1); :class:`Dropout` scales the kept values by its inverse, which keeps
    every activation's expectation exact.

    Example:
        >>> mask, keep = keep_mask(jax.random.key(0), 0.1, (64, 1001))
        >>> mask.shape, round(keep, 6), abs(float(mask.mean()) - keep) < 0.01
        ((64, 1001), 0.899994, True)
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"rate must be in (0, 1), got {rate}")
    threshold = min(max(round(rate * 2**MASK_BITS), 1), 2**MASK_BITS - 1)
    full = tuple(int(d) for d in shape) or (1,)
    n = full[-1]
    words = jax.random.bits(key, full[:-1] + ((n + 1) // 2,), jnp.uint32)
    low, high = words & jnp.uint32(0xFFFF), words >> jnp.uint32(16)
    bits = jnp.concatenate([low, high], axis=-1)[..., :n]
    mask = (bits >= jnp.uint32(threshold)).reshape(tuple(shape))
    return mask, 1.0 - threshold / 2**MASK_BITS


class Dropout(nnx.Dropout):
    """``nnx.Dropout`` whose masks take 16 random bits per element (:func:`keep_mask`).

    Same constructor, modes (``deterministic``, ``model.train()`` /
    ``model.eval()``) and key streams as ``nnx.Dropout``; the rate is applied
    to ``1 / 2**16`` and the kept values are scaled by ``1 / keep`` for that
    exact keep probability. ``broadcast_dims`` uses ``nnx.Dropout``'s mask.

    Example:
        >>> drop = Dropout(0.5, rngs=nnx.Rngs(dropout=0))
        >>> y = drop(jnp.ones((4, 6)), deterministic=False)
        >>> sorted({float(v) for v in y.ravel()})
        [0.0, 2.0]
        >>> bool((drop(jnp.ones(3), deterministic=True) == 1).all())
        True
    """

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic or self.rate == 0.0 or self.broadcast_dims or self.rate == 1.0:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        rngs = self.rngs if rngs is None else rngs
        if isinstance(rngs, nnx.Rngs):
            key = rngs[self.rng_collection]()
        elif isinstance(rngs, nnx.RngStream):
            key = rngs()
        elif isinstance(rngs, jax.Array):
            key = rngs
        else:
            raise TypeError("Dropout in train mode needs rngs (an nnx.Rngs, an RngStream or a key),"
                            f" got {type(rngs).__name__}")
        mask, keep = keep_mask(key, float(self.rate), inputs.shape)
        return jax.lax.select(mask, inputs / jnp.asarray(keep, inputs.dtype), jnp.zeros_like(inputs))

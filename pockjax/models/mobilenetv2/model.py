"""A Flax NNX MobileNetV2, layer for layer torchvision's ``mobilenet_v2`` (NHWC).

Stem (3x3 stride-2 conv), 17 inverted residual blocks (the ``(t, c, n, s)``
settings of the paper), a 1x1 conv to 1280 channels, global average pooling,
dropout and a linear classifier. Convolutions have no bias and are each
followed by BatchNorm (epsilon 1e-5, torch momentum 0.1 = Flax momentum 0.9)
and ReLU6 (not after a block's projection). 3x3 convolutions pad one pixel
on each side as torch does (not ``"SAME"``, which pads stride-2 convs
asymmetrically); depth-wise convolutions use ``feature_group_count``.

Parameter paths (what :class:`pockjax.UpdateScheme` patterns match)::

    stem.conv.kernel                    (3, 3, 3, 32)      HWIO
    stem.norm.scale / stem.norm.bias    (32,)
    blocks.0.depthwise.conv.kernel      (3, 3, 1, 32)      block 0 (t = 1) has no expand conv
    blocks.0.project.conv.kernel        (1, 1, 32, 16)
    blocks.1.expand.conv.kernel         (1, 1, 16, 96)     the first point-wise conv
    blocks.1.expand.norm.scale / .bias  (96,)              every conv has a .norm
    ...                                                    blocks.0 ... blocks.16
    last.conv.kernel                    (1, 1, 320, 1280)
    head.kernel, head.bias              (1280, 1000), (1000,)

BatchNorm running statistics are ``<conv>.norm.mean`` / ``.var``
(``nnx.BatchStat``, not parameters). The model starts in eval mode (running
statistics, no dropout); ``model.train()`` switches BatchNorm to batch
statistics (updating the running ones exactly as torch's train mode does,
the running variance with the unbiased batch variance) and turns dropout on (from the ``dropout`` stream of the model's ``rngs``).

Example:
    >>> from flax import nnx
    >>> cfg = MobileNetV2Config(num_classes=10, width_mult=0.25)
    >>> model = nnx.eval_shape(lambda: MobileNetV2(cfg, rngs=nnx.Rngs(0)))  # shapes only
    >>> model.blocks[1].expand.conv.kernel.shape, model.head.kernel.shape
    ((1, 1, 8, 48), (1280, 10))

    A real model and a forward pass (``nnx.jit`` compiles the network once;
    eager ops compile one by one)::

        model = MobileNetV2(cfg, rngs=nnx.Rngs(0))
        logits = nnx.jit(lambda m, x: m(x))(model, images)   # (batch, 10)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from flax import nnx

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "MobileNetV2", "MobileNetV2Config",
           "make_divisible", "normalize", "replace_head"]

#: Per-channel RGB mean and standard deviation of torchvision's ImageNet models.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: MobileNetV2's inverted residual settings: expansion t, channels c, repeats n, stride s.
INVERTED_RESIDUAL_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                             (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    """torchvision's ``_make_divisible``: round channels to a multiple of ``divisor``.

    Example:
        >>> make_divisible(32 * 0.75), make_divisible(1280 * 1.4)
        (24, 1792)
    """
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:  # do not round down by more than 10%
        new_v += divisor
    return new_v


@dataclasses.dataclass(frozen=True)
class MobileNetV2Config:
    """MobileNetV2's hyper-parameters (torchvision's defaults).

    Attributes:
      num_classes: outputs of the linear head.
      width_mult: channel multiplier (channels rounded to ``round_nearest``).
      dropout: dropout rate before the head (train mode only).
      round_nearest: channel counts are multiples of this.
      inverted_residual_setting: ``(t, c, n, s)`` per stage.
      bn_epsilon, bn_momentum: BatchNorm's epsilon and Flax momentum (0.9 is
        torch's 0.1).
      stem_channels, last_channels: before width scaling (32 and 1280).
      conv_lowering: how the convolutions are written in the traced step (the
        same arithmetic either way, see :class:`Conv`): ``"matmul"`` (the
        default) computes 1x1 convolutions as matrix products over the channels
        and 3x3 depth-wise ones as nine shifted multiply-adds; ``"conv"`` uses
        ``lax.conv_general_dilated`` for every one. On XLA's CPU backend the
        first is several times faster (measured on a 2-core Xeon at 32x32x96,
        batch 32: depth-wise forward 2.4 ms against 85 ms, its weight gradient
        37 ms against 176 ms; a 1x1 conv to 576 channels 38 ms against 79 ms).

    Example:
        >>> cfg = MobileNetV2Config()
        >>> cfg.n_blocks, cfg.block_channels()[-1], cfg.last_channel
        (17, (960, 320, 1, 6), 1280)
    """

    num_classes: int = 1000
    width_mult: float = 1.0
    dropout: float = 0.2
    round_nearest: int = 8
    inverted_residual_setting: tuple[tuple[int, int, int, int], ...] = INVERTED_RESIDUAL_SETTING
    bn_epsilon: float = 1e-5
    bn_momentum: float = 0.9
    stem_channels: int = 32
    last_channels: int = 1280
    conv_lowering: str = "matmul"

    def __post_init__(self):
        if self.conv_lowering not in CONV_LOWERINGS:
            raise ValueError(f"conv_lowering must be one of {CONV_LOWERINGS}, got {self.conv_lowering!r}")
        if int(self.num_classes) < 1:
            raise ValueError(f"num_classes must be at least 1, got {self.num_classes}")
        if not self.width_mult > 0:
            raise ValueError(f"width_mult must be positive, got {self.width_mult}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        setting = tuple(tuple(int(v) for v in row) for row in self.inverted_residual_setting)
        if not setting or any(len(row) != 4 for row in setting):
            raise ValueError("inverted_residual_setting must be a non-empty list of (t, c, n, s)")
        object.__setattr__(self, "inverted_residual_setting", setting)

    @property
    def stem_channel(self) -> int:
        return make_divisible(self.stem_channels * self.width_mult, self.round_nearest)

    @property
    def last_channel(self) -> int:
        return make_divisible(self.last_channels * max(1.0, self.width_mult), self.round_nearest)

    @property
    def n_blocks(self) -> int:
        return sum(n for _, _, n, _ in self.inverted_residual_setting)

    def block_channels(self) -> list[tuple[int, int, int, int]]:
        """Per block: ``(hidden, out, stride, t)``; the input is the previous block's out."""
        out = []
        cin = self.stem_channel
        for t, c, n, s in self.inverted_residual_setting:
            cout = make_divisible(c * self.width_mult, self.round_nearest)
            for i in range(n):
                out.append((int(round(cin * t)), cout, s if i == 0 else 1, t))
                cin = cout
        return out

    def expand_blocks(self) -> list[int]:
        """Indices of the blocks that have an expand (first point-wise) conv: ``t != 1``."""
        return [i for i, (_, _, _, t) in enumerate(self.block_channels()) if t != 1]


#: The values of :attr:`MobileNetV2Config.conv_lowering`.
CONV_LOWERINGS = ("matmul", "conv")


class Conv(nnx.Module):
    """A bias-free 2-D convolution over NHWC images with an HWIO ``kernel``, as ``nnx.Conv``.

    The parameter is ``kernel`` of shape ``(k, k, cin // groups, cout)``, like
    ``nnx.Conv``'s, so checkpoints and schemes see the same tensor whichever
    ``lowering`` computes it (see :attr:`MobileNetV2Config.conv_lowering`):

    * ``"matmul"``: a 1x1 convolution is ``lax.dot_general`` of the images with
      ``kernel[0, 0]`` over the channels (a channel rule on the kernel's output
      axis then prunes its weight gradient like a linear layer's); a 3x3
      depth-wise one (``groups == cin == cout``) is the sum of nine strided
      slices of the padded images times one kernel tap each; other
      convolutions (the stem) use ``lax.conv_general_dilated``.
    * ``"conv"``: ``lax.conv_general_dilated`` (with ``feature_group_count``) for all.

    Example:
        >>> import numpy as np
        >>> x = jnp.asarray(np.random.default_rng(0).random((2, 7, 7, 4), np.float32))
        >>> a = Conv(4, 4, 3, 2, groups=4, lowering="matmul", rngs=nnx.Rngs(0))
        >>> b = Conv(4, 4, 3, 2, groups=4, lowering="conv", rngs=nnx.Rngs(0))
        >>> a(x).shape, bool(jnp.allclose(a(x), b(x), atol=1e-6))
        ((2, 4, 4, 4), True)
    """

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, *,
                 lowering: str = "matmul", rngs: nnx.Rngs, dtype: Any = None,
                 param_dtype: Any = jnp.float32):
        if lowering not in CONV_LOWERINGS:
            raise ValueError(f"lowering must be one of {CONV_LOWERINGS}, got {lowering!r}")
        init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
        self.kernel = nnx.Param(init(rngs.params(), (kernel, kernel, cin // groups, cout), param_dtype))
        self.size, self.stride, self.groups = kernel, stride, groups
        self.pad = (kernel - 1) // 2
        self.lowering, self.dtype = lowering, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        dtype = self.dtype or jnp.result_type(x.dtype, kernel.dtype)
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        if self.lowering == "matmul":
            if self.size == 1 and self.stride == 1 and self.groups == 1:
                return lax.dot_general(x, kernel[0, 0], (((x.ndim - 1,), (0,)), ((), ())))
            if self.groups > 1 and self.groups == x.shape[-1] == kernel.shape[-1]:
                return self._depthwise_taps(x, kernel)
        p, s = self.pad, self.stride
        return lax.conv_general_dilated(x, kernel, (s, s), ((p, p), (p, p)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=self.groups)

    def _depthwise_taps(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        return depthwise_taps(x, kernel, self.stride, self.pad)


def _taps(xp: jax.Array, k: int, stride: int, out_hw: tuple[int, int]):
    """The ``k * k`` strided windows ``xp[:, i::stride, j::stride, :]`` of a padded NHWC batch."""
    n, _, _, c = xp.shape
    ho, wo = out_hw
    for i in range(k):
        for j in range(k):
            yield i, j, lax.slice(xp, (0, i, j, 0), (n, i + (ho - 1) * stride + 1,
                                                     j + (wo - 1) * stride + 1, c), (1, stride, stride, 1))


def _depthwise_forward(x, kernel, stride: int, pad: int):
    k = kernel.shape[0]
    h, w = x.shape[1:3]
    out_hw = ((h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1)
    xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    out = None
    for i, j, window in _taps(xp, k, stride, out_hw):
        out = window * kernel[i, j, 0] if out is None else out + window * kernel[i, j, 0]
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def depthwise_taps(x: jax.Array, kernel: jax.Array, stride: int, pad: int) -> jax.Array:
    """A depth-wise convolution (NHWC, kernel ``(k, k, 1, C)``) as ``k * k`` shifted multiply-adds.

    The same values as ``lax.conv_general_dilated(..., feature_group_count=C)``
    with ``pad`` pixels each side. Its gradient is written the same way: the
    input gradient is the output gradient, dilated by the stride and padded,
    correlated with the flipped kernel (``k * k`` multiply-adds again, instead
    of the ``k * k`` scattered pads that differentiating the slices gives:
    99 of a 231 ms step at 64x64, batch 32); the kernel gradient is one
    variadic reduction that sums every tap's products over the width in a
    single pass (a reduction per tap had XLA's CPU backend copy each window
    out first: 4x slower at 56x56x144, batch 32). A frozen kernel's
    reductions are pruned like any unused value.

    Example:
        >>> import numpy as np
        >>> x = jnp.asarray(np.random.default_rng(0).random((1, 5, 5, 2), np.float32))
        >>> w = jnp.asarray(np.random.default_rng(1).random((3, 3, 1, 2), np.float32))
        >>> ref = lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)), feature_group_count=2,
        ...                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
        >>> bool(jnp.allclose(depthwise_taps(x, w, 2, 1), ref, atol=1e-6))
        True
    """
    return _depthwise_forward(x, kernel, stride, pad)


def _depthwise_fwd(x, kernel, stride, pad):
    return _depthwise_forward(x, kernel, stride, pad), (x, kernel)


def _depthwise_bwd(stride, pad, res, g):
    x, kernel = res
    k = kernel.shape[0]
    n, h, w, c = x.shape
    ho, wo = g.shape[1:3]
    # input gradient: dx[h] = sum_i G[h + k - 1 - i] * kernel[i], G the output gradient
    # dilated by the stride and shifted by k - 1 - pad (lax.pad: interior and edge padding,
    # negative edges crop)
    lo = k - 1 - pad
    hi_h = h + k - 1 - lo - ((ho - 1) * stride + 1)
    hi_w = w + k - 1 - lo - ((wo - 1) * stride + 1)
    zero = jnp.zeros((), g.dtype)
    gp = lax.pad(g, zero, ((0, 0, 0), (lo, hi_h, stride - 1), (lo, hi_w, stride - 1), (0, 0, 0)))
    dx = None
    for i, j, window in _taps(gp, k, 1, (h, w)):
        term = window * kernel[k - 1 - i, k - 1 - j, 0]
        dx = term if dx is None else dx + term
    # kernel gradient: sum over (n, h, w) of each tap's window of x times g, all k * k taps
    # in one pass with the windows read in place (_sum_all_but_last; a separate sum per tap
    # made XLA's CPU backend copy every window out for its library reduction)
    xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    products = [window * g for _, _, window in _taps(xp, k, stride, (ho, wo))]
    dk = jnp.stack(_sum_all_but_last(*products)).reshape(k, k, 1, c).astype(kernel.dtype)
    return dx.astype(x.dtype), dk


depthwise_taps.defvjp(_depthwise_fwd, _depthwise_bwd)


def _relu6(x: jax.Array) -> jax.Array:
    return jnp.minimum(jnp.maximum(x, 0.0), 6.0)


def _sum_all_but_last(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Per-channel sums of each NHWC (or any rank >= 2, channels last) array, in one pass.

    A variadic reduction over the second-to-last axis first (every operand's
    elementwise producer fused in, each element read once), then a sum of
    those partial rows; XLA's CPU backend otherwise copies each operand out
    and reduces it on its own.
    """
    if xs[0].ndim >= 3:
        zero = jnp.zeros((), xs[0].dtype)
        xs = lax.reduce(xs, (zero,) * len(xs), lambda a, b: tuple(u + v for u, v in zip(a, b)),
                        (xs[0].ndim - 2,))
    return tuple(jnp.sum(x, axis=tuple(range(x.ndim - 1))) for x in xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def batch_norm_train(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float):
    """Train-mode BatchNorm over every axis but the last: ``(y, mean, biased variance)``.

    The values of ``nnx.BatchNorm`` in train mode (``use_fast_variance``:
    ``E[x^2] - E[x]^2``, floored at 0). The gradient takes one pass over
    ``x`` and ``g`` for both its sums (:func:`_sum_all_but_last`): ``dx = scale
    * rstd * (g - mean(g) - xhat * mean(g * xhat))``, with the gradient through
    the returned statistics added (zero when only the running averages use
    them).

    Example:
        >>> import numpy as np
        >>> x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3, 3, 2)), jnp.float32)
        >>> y, mean, var = batch_norm_train(x, jnp.ones(2), jnp.zeros(2), 1e-5)
        >>> bool(jnp.allclose(y.mean(axis=(0, 1, 2)), 0, atol=1e-5)), bool(jnp.allclose(mean, x.mean((0, 1, 2))))
        (True, True)
    """
    return _bn_forward(x, scale, bias, epsilon)[0]


def _bn_forward(x, scale, bias, epsilon):
    n = x.size // x.shape[-1]
    # two library sums, as nnx.BatchNorm computes them (the partial-rows pass of
    # _sum_all_but_last here moved an export's BatchNorm-bias momentum, 3 SGD steps of a
    # random-init model, 1.1e-4 away from XLA's: the sum of a gradient that nearly cancels)
    axes = tuple(range(x.ndim - 1))
    s1, s2 = jnp.sum(x, axis=axes), jnp.sum(x * x, axis=axes)
    mean = s1 / n
    var = jnp.maximum(s2 / n - mean * mean, 0.0)
    rstd = lax.rsqrt(var + epsilon)
    y = (x - mean) * (rstd * scale) + bias
    return (y, mean, var), (x, mean, rstd, scale)


def _bn_fwd(x, scale, bias, epsilon):
    return _bn_forward(x, scale, bias, epsilon)


def _bn_bwd(epsilon, res, cts):
    x, mean, rstd, scale = res
    g, g_mean, g_var = cts
    n = x.size // x.shape[-1]
    xhat = (x - mean) * rstd
    sg, sgx = _sum_all_but_last(g, g * xhat)
    dx = (scale * rstd) * (g - sg / n - xhat * (sgx / n))
    dx = dx + g_mean / n + (2.0 / n) * g_var * (x - mean)  # through the returned statistics
    return dx, sgx.astype(scale.dtype), sg.astype(scale.dtype)


batch_norm_train.defvjp(_bn_fwd, _bn_bwd)


def _store(var: nnx.Variable, value: jax.Array) -> None:
    """``var[...] = value``, without ``Variable.__setitem__``.

    Under a trace ``__setitem__`` asks the traced value for its ``sharding``, and
    the AttributeError JAX raises renders the whole trace so far: once per write,
    over a second of lowering MobileNetV2. The value stored is the same: ``value``
    itself when its dtype and shape match, else cast and broadcast as
    ``__setitem__`` does.
    """
    old = var.get_value()
    if value.dtype != old.dtype or value.shape != old.shape:
        value = old.at[...].set(value)
    var.set_value(value)


class BatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` whose train mode updates the running variance as torch does.

    Both normalise a batch by its biased variance; torch's running variance
    averages in the unbiased one (times ``n / (n - 1)``, ``n`` the values per
    channel), which this class does too, so running statistics after a
    train-mode pass match ``torch.nn.BatchNorm2d``'s. Train mode computes
    with :func:`batch_norm_train` (the same values, fewer passes over the
    activations); a ``mask``, an ``axis_name`` or a feature axis other than
    the last uses ``nnx.BatchNorm``'s computation.
    """

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, **kw) -> jax.Array:
        frozen = self.use_running_average if use_running_average is None else use_running_average
        if frozen:
            return super().__call__(x, use_running_average=True, **kw)
        n = x.size // x.shape[-1]
        m = self.momentum
        if (kw or self.axis_name is not None or self.axis not in (-1, x.ndim - 1) or self.scale is None
                or self.bias is None or (self.dtype is not None and jnp.dtype(self.dtype) != x.dtype)):
            old = self.var[...]
            y = super().__call__(x, use_running_average=False, **kw)
            if n > 1:
                biased = (self.var[...] - m * old) / (1.0 - m)  # the batch's (biased) variance
                _store(self.var, m * old + (1.0 - m) * biased * (n / (n - 1)))
            return y
        scale, bias = self.scale[...].astype(x.dtype), self.bias[...].astype(x.dtype)
        y, mean, var = batch_norm_train(x, scale, bias, float(self.epsilon))
        mean, var = lax.stop_gradient(mean), lax.stop_gradient(var)
        _store(self.mean, m * self.mean[...] + (1.0 - m) * mean)
        _store(self.var, m * self.var[...] + (1.0 - m) * (var * (n / (n - 1)) if n > 1 else var))
        return y


class ConvBN(nnx.Module):
    """Conv (no bias) -> BatchNorm -> optional ReLU6; torch's ``Conv2dNormActivation``."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, *,
                 act: bool = True, config: MobileNetV2Config, rngs: nnx.Rngs,
                 dtype: Any = None, param_dtype: Any = jnp.float32):
        self.conv = Conv(cin, cout, kernel, stride, groups, lowering=config.conv_lowering,
                         rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm = BatchNorm(cout, use_running_average=True, momentum=config.bn_momentum,
                                  epsilon=config.bn_epsilon, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(self.conv(x))
        return _relu6(x) if self.act else x


class InvertedResidual(nnx.Module):
    """Expand (1x1, absent when t = 1) -> depth-wise 3x3 -> project (1x1, linear) [+ input]."""

    def __init__(self, cin: int, cout: int, stride: int, t: int, *, config: MobileNetV2Config,
                 rngs: nnx.Rngs, **kw):
        hidden = int(round(cin * t))
        self.use_res = stride == 1 and cin == cout
        self.expand = ConvBN(cin, hidden, 1, config=config, rngs=rngs, **kw) if t != 1 else None
        self.depthwise = ConvBN(hidden, hidden, 3, stride, groups=hidden, config=config,
                                rngs=rngs, **kw)
        self.project = ConvBN(hidden, cout, 1, act=False, config=config, rngs=rngs, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x if self.expand is None else self.expand(x)
        y = self.project(self.depthwise(y))
        return x + y if self.use_res else y


class MobileNetV2(nnx.Module):
    """MobileNetV2 for NHWC float images normalised with :data:`IMAGENET_MEAN` / ``STD``.

    Args:
      config: the architecture.
      rngs: parameter initialisation and the ``dropout`` stream of train mode.
      dtype: computation dtype (default: the parameters').
      param_dtype: parameter dtype.

    ``model(images)`` with ``images`` of shape ``(batch, H, W, 3)`` returns
    ``(batch, num_classes)`` logits. The model is built in eval mode.

    Example:
        >>> import pockjax
        >>> model = nnx.eval_shape(lambda: MobileNetV2(MobileNetV2Config(width_mult=0.25),
        ...                                            rngs=nnx.Rngs(0)))  # shapes only
        >>> paths = pockjax.leaf_paths(nnx.state(model, nnx.Param))
        >>> [p for p in paths if p.startswith(("blocks.1.", "head"))]  # doctest: +NORMALIZE_WHITESPACE
        ['blocks.1.depthwise.conv.kernel', 'blocks.1.depthwise.norm.bias',
         'blocks.1.depthwise.norm.scale', 'blocks.1.expand.conv.kernel',
         'blocks.1.expand.norm.bias', 'blocks.1.expand.norm.scale',
         'blocks.1.project.conv.kernel', 'blocks.1.project.norm.bias',
         'blocks.1.project.norm.scale', 'head.bias', 'head.kernel']
    """

    def __init__(self, config: MobileNetV2Config = MobileNetV2Config(), *, rngs: nnx.Rngs,
                 dtype: Any = None, param_dtype: Any = jnp.float32):
        self.config = config
        kw = dict(config=config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.stem = ConvBN(3, config.stem_channel, 3, 2, **kw)
        blocks = []
        cin = config.stem_channel
        for _hidden, cout, stride, t in config.block_channels():
            blocks.append(InvertedResidual(cin, cout, stride, t, **kw))
            cin = cout
        self.blocks = nnx.List(blocks)
        self.last = ConvBN(cin, config.last_channel, 1, **kw)
        self.dropout = nnx.Dropout(config.dropout, deterministic=True, rngs=rngs)
        self.head = self._new_head(config.num_classes, rngs=rngs, dtype=dtype,
                                   param_dtype=param_dtype)
        self._dtypes = (dtype, param_dtype)

    def _new_head(self, num_classes: int, *, rngs: nnx.Rngs, dtype: Any = None,
                  param_dtype: Any = jnp.float32) -> nnx.Linear:
        return nnx.Linear(self.config.last_channel, num_classes, dtype=dtype,
                          param_dtype=param_dtype, kernel_init=nnx.initializers.normal(0.01),
                          bias_init=nnx.initializers.zeros, rngs=rngs)

    def features(self, images: jax.Array) -> jax.Array:
        """The pooled ``(batch, last_channel)`` features the head classifies."""
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        x = self.last(x)
        return jnp.mean(x, axis=(1, 2))

    def __call__(self, images: jax.Array) -> jax.Array:
        return self.head(self.dropout(self.features(images)))


def replace_head(model: MobileNetV2, num_classes: int, *, rngs: nnx.Rngs) -> MobileNetV2:
    """Puts a freshly initialised ``num_classes``-way linear head on ``model`` (in place).

    ``model.config.num_classes`` is updated; the model is returned for chaining.

    Example:
        >>> model = nnx.eval_shape(lambda: MobileNetV2(MobileNetV2Config(width_mult=0.25),
        ...                                            rngs=nnx.Rngs(0)))  # shapes only
        >>> replace_head(model, 5, rngs=nnx.Rngs(1)).head.kernel.shape, model.config.num_classes
        ((1280, 5), 5)
    """
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    dtype, param_dtype = model._dtypes
    model.config = dataclasses.replace(model.config, num_classes=int(num_classes))
    model.head = model._new_head(int(num_classes), rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    return model


def normalize(images: Any) -> jax.Array:
    """NHWC RGB images (``uint8`` in [0, 255], or float in [0, 1]) -> normalised float32.

    Example:
        >>> import numpy as np
        >>> x = normalize(np.full((1, 2, 2, 3), 255, np.uint8))
        >>> [round(float(v), 3) for v in x[0, 0, 0]]
        [2.249, 2.429, 2.64]
    """
    x = jnp.asarray(images)
    if x.ndim < 1 or x.shape[-1] != 3:
        raise ValueError(f"images must be NHWC RGB (last axis 3), got shape {tuple(x.shape)}")
    if x.dtype == jnp.uint8:
        x = x.astype(jnp.float32) / 255.0
    else:
        x = x.astype(jnp.float32)
    mean = np.asarray(IMAGENET_MEAN, np.float32)
    std = np.asarray(IMAGENET_STD, np.float32)
    return (x - mean) / std

"""MobileNetV2's hand-written gradients against autodiff of the plain computation.

``depthwise_taps`` (a depth-wise convolution as shifted multiply-adds) against
``lax.conv_general_dilated`` with ``feature_group_count``; ``batch_norm_train``
(train-mode BatchNorm, one pass for the statistics and one for the gradient)
against ``nnx.BatchNorm``'s formulas.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pockjax.models.mobilenetv2.model import batch_norm_train, depthwise_taps


def _conv(x, w, stride, pad):
    return lax.conv_general_dilated(x, w, (stride, stride), ((pad, pad), (pad, pad)),
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=x.shape[-1])


@pytest.mark.parametrize("shape,stride", [((2, 9, 9, 5), 1), ((3, 10, 10, 4), 2), ((2, 11, 8, 6), 2),
                                          ((1, 6, 7, 3), 1)])
def test_values_and_both_gradients_match_xla_convolution(shape, stride):
    rng = np.random.default_rng(sum(shape) + stride)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 1, shape[-1])), jnp.float32)
    want = _conv(x, w, stride, 1)
    got = depthwise_taps(x, w, stride, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g = jnp.asarray(rng.normal(size=want.shape), jnp.float32)  # a generic output gradient
    dx_want, dw_want = jax.vjp(lambda a, b: _conv(a, b, stride, 1), x, w)[1](g)
    dx_got, dw_got = jax.vjp(lambda a, b: depthwise_taps(a, b, stride, 1), x, w)[1](g)
    assert dx_got.shape == x.shape and dw_got.shape == w.shape
    np.testing.assert_allclose(dx_got, dx_want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw_got, dw_want, rtol=1e-4, atol=1e-4)


def test_gradient_under_jit_matches_too():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 12, 12, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 1, 8)), jnp.float32)

    def loss(f):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.tanh(f(a, b))), argnums=(0, 1)))

    want = loss(lambda a, b: _conv(a, b, 2, 1))(x, w)
    got = loss(lambda a, b: depthwise_taps(a, b, 2, 1))(x, w)
    for u, v in zip(got, want):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4)


def test_kernel_gradient_exports_to_iree_like_xla():
    # the variadic reduction of the kernel gradient compiles for IREE's CPU target too
    import pockjax

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 8, 8, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 1, 4)), jnp.float32)

    def step(params, opt_state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(depthwise_taps(x, p["w"], 2, 1))))(params)
        return {"w": params["w"] - 0.1 * g["w"]}, opt_state, loss

    scheme = pockjax.UpdateScheme([("w", "full")])
    want = pockjax.compile(step, scheme=scheme)({"w": jnp.array(w)}, (), x)  # (params are donated)
    got = pockjax.compile(step, scheme=scheme, target="cpu")({"w": jnp.array(w)}, (), x)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    np.testing.assert_allclose(got[0]["w"], want[0]["w"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(want[0]["w"], w)  # the kernel moved


def _bn_reference(x, scale, bias, eps):
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axes)
    var = jnp.maximum(jnp.mean(x * x, axes) - mean * mean, 0.0)  # nnx.BatchNorm's fast variance
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias, mean, var


@pytest.mark.parametrize("shape", [(4, 5, 6, 3), (8, 7), (2, 3, 4, 5, 2)])
def test_batch_norm_values_and_gradients_match_autodiff(shape):
    rng = np.random.default_rng(len(shape))
    x = jnp.asarray(rng.normal(1.5, 2.0, size=shape), jnp.float32)
    scale = jnp.asarray(rng.normal(size=shape[-1:]), jnp.float32)
    bias = jnp.asarray(rng.normal(size=shape[-1:]), jnp.float32)
    want, vjp_want = jax.vjp(lambda *a: _bn_reference(*a, 1e-5), x, scale, bias)
    got, vjp_got = jax.vjp(lambda *a: batch_norm_train(*a, 1e-5), x, scale, bias)
    for u, v in zip(got, want):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)
    # cotangents for y and, as a user differentiating the statistics would give, for mean and var
    cts = tuple(jnp.asarray(rng.normal(size=v.shape), jnp.float32) for v in want)
    for with_stats in (False, True):
        c = cts if with_stats else (cts[0], jnp.zeros_like(cts[1]), jnp.zeros_like(cts[2]))
        for u, v in zip(vjp_got(c), vjp_want(c)):
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4)


def test_model_batch_norm_trains_like_nnx_batch_norm():
    # the model's BatchNorm (custom gradient) against nnx.BatchNorm in a jitted train step:
    # same loss, gradients and running mean; running variance nnx's times n / (n - 1)
    from flax import nnx

    from pockjax.models.mobilenetv2.model import BatchNorm

    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 6, 6, 5)), jnp.float32)
    ours = BatchNorm(5, use_running_average=False, momentum=0.9, epsilon=1e-5, rngs=nnx.Rngs(0))
    ref = nnx.BatchNorm(5, use_running_average=False, momentum=0.9, epsilon=1e-5, rngs=nnx.Rngs(0))
    for m in (ours, ref):
        m.scale[...] = jnp.arange(1.0, 6.0)
        m.bias[...] = jnp.linspace(-1, 1, 5)

    @nnx.jit
    def grads(m):
        return nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x))))(m)

    (la, ga), (lb, gb) = grads(ours), grads(ref)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours.mean[...], ref.mean[...], rtol=1e-5, atol=1e-6)
    n = x.size // 5
    np.testing.assert_allclose(ours.var[...] - 0.9, (ref.var[...] - 0.9) * n / (n - 1), rtol=1e-4)

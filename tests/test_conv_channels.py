"""Channel rules on convolution kernels: values match the reference, FLOPs drop.

A channel rule on a kernel's output axis is pushed into the weight-gradient
``conv_general_dilated`` (see ``slicing._conv_general_dilated``), so that conv
computes only the selected channels; for a depth-wise conv (whose kernel
gradient is a conv with ``batch_group_count = C``) only whole groups can be
pushed, anything else is computed whole and sliced afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax import lax

import pockjax
from pockjax.analysis import eqn_flops
from pockjax.scheme import ChannelSelect
from pockjax._src.jaxpr import walk
from pockjax.transforms import slicing
from test_sparse_semantics import copy_tree, masked_step, reference_masks
from toy_models import make_step


# -- models -----------------------------------------------------------------------
class _FlaxCNN(nn.Module):
    channels: int
    multiplier: int

    @nn.compact
    def __call__(self, x):
        c = self.channels
        x = nn.relu(nn.Conv(c, (3, 3), name="conv1")(x))
        x = nn.relu(nn.Conv(c * self.multiplier, (3, 3), feature_group_count=c, name="dw")(x))
        return nn.Conv(3, (3, 3), name="conv2")(x)


@dataclasses.dataclass(frozen=True)
class FlaxCNN:
    """conv -> relu -> depth-wise conv (feature_group_count = C) -> relu -> conv, NHWC."""

    channels: int = 4
    multiplier: int = 2
    batch_size: int = 2
    size: int = 6

    @property
    def module(self):
        return _FlaxCNN(self.channels, self.multiplier)

    def init(self, key):
        return self.module.init(key, jnp.zeros((1, self.size, self.size, 3)))["params"]

    def loss(self, params, batch):
        x, y = batch
        return jnp.mean((self.module.apply({"params": params}, x) - y) ** 2)

    def batch(self, key):
        k1, k2 = jax.random.split(key)
        shape = (self.batch_size, self.size, self.size, 3)
        return jax.random.normal(k1, shape), jax.random.normal(k2, shape)


@dataclasses.dataclass(frozen=True)
class LaxCNN:
    """The same network with ``lax.conv_general_dilated`` in NCHW / OIHW, strided."""

    channels: int = 4
    multiplier: int = 2
    batch_size: int = 2
    size: int = 6

    def init(self, key):
        c, m = self.channels, self.multiplier
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "conv1": {"kernel": jax.random.normal(k1, (c, 3, 3, 3)) / 5},
            "dw": {"kernel": jax.random.normal(k2, (c * m, 1, 3, 3)) / 3},
            "conv2": {"kernel": jax.random.normal(k3, (3, c * m, 3, 3)) / 5},
        }

    def loss(self, params, batch):
        x, y = batch
        conv = lambda x, w, g=1, s=1: lax.conv_general_dilated(
            x, w, (s, s), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=g)
        h = jax.nn.relu(conv(x, params["conv1"]["kernel"], s=2))
        h = jax.nn.relu(conv(h, params["dw"]["kernel"], g=self.channels))
        return jnp.mean((conv(h, params["conv2"]["kernel"]) - y) ** 2)

    def batch(self, key):
        k1, k2 = jax.random.split(key)
        return (jax.random.normal(k1, (self.batch_size, 3, self.size, self.size)),
                jax.random.normal(k2, (self.batch_size, 3, self.size // 2, self.size // 2)))


@dataclasses.dataclass(frozen=True)
class Remat:
    """A model whose loss runs under ``jax.checkpoint`` (activations recomputed in the backward)."""

    inner: Any

    def init(self, key):
        return self.inner.init(key)

    def loss(self, params, batch):
        return jax.checkpoint(self.inner.loss)(params, batch)

    def batch(self, key):
        return self.inner.batch(key)


def _setup(model):
    tx = optax.adam(1e-2)
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1))
    opt_state = tx.init(params)
    params, opt_state, _ = jax.jit(make_step(model, tx))(params, opt_state, batch)  # non-trivial Adam state
    return tx, params, opt_state, batch


def check_values(model, rules):
    tx, params, opt_state, batch = _setup(model)
    scheme = pockjax.UpdateScheme(rules, default="frozen")
    resolved = scheme.resolve_tree(params)
    masks, smasks = reference_masks(resolved, params, opt_state)
    # the reference in one XLA compile, rather than op-by-op dispatch
    ref_params, ref_opt, ref_loss = jax.jit(functools.partial(masked_step, model, tx))(
        masks, smasks, params, opt_state, batch)
    step = pockjax.compile(make_step(model, tx), scheme=scheme)
    new_params, new_opt, loss = step(copy_tree(params), copy_tree(opt_state), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for got, want, old, m in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params), jax.tree.leaves(params), masks):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        assert np.array_equal(np.asarray(got)[m == 0], np.asarray(old)[m == 0])
    for got, want, old, m in zip(jax.tree.leaves(new_opt), jax.tree.leaves(ref_opt), jax.tree.leaves(opt_state), smasks):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        if m is not None:
            assert np.array_equal(np.asarray(got)[m == 0], np.asarray(old)[m == 0])


# -- 1. values --------------------------------------------------------------------
HALF = pockjax.channels(0.5)
VALUE_CASES = {
    "flax-out-channels": (FlaxCNN(), {"conv1.kernel": HALF, "dw.kernel": HALF, "conv2.kernel": HALF, "dw.bias": "full"}),
    "flax-in-channels": (FlaxCNN(), {"conv2.kernel": pockjax.channels(0.5, axis=2), "conv1.kernel": pockjax.channels(1)}),
    "flax-dw-multiplier1": (FlaxCNN(multiplier=1), {"dw.kernel": pockjax.channels(indices=[0, 2, 3])}),
    "flax-dw-whole-groups-indices": (FlaxCNN(), {"dw.kernel": pockjax.channels(indices=[2, 3, 6, 7])}),
    "flax-remat": (Remat(FlaxCNN()), {"conv1.kernel": HALF, "dw.kernel": HALF, "conv2.kernel": HALF}),
    "lax-nchw": (LaxCNN(), {"conv1.kernel": pockjax.channels(0.5, axis=0), "dw.kernel": pockjax.channels(0.5, axis=0),
                            "conv2.kernel": pockjax.channels(0.5, axis=1)}),
}


@pytest.mark.parametrize("case", sorted(VALUE_CASES))
def test_conv_channel_rules_match_reference(case):
    check_values(*VALUE_CASES[case])


# -- 3. selections that cannot be pushed -------------------------------------------
@pytest.mark.parametrize("rule", [pockjax.channels(3), pockjax.channels(indices=[1, 2, 5, 6])], ids=["count3", "indices"])
def test_group_misaligned_selection_still_correct(rule):
    # depth-wise with multiplier 2: output groups of 2 channels; these selections cut groups
    model = FlaxCNN()
    check_values(model, {"dw.kernel": rule, "conv1.kernel": HALF})
    assert _weight_grad_flops(model, {"dw.kernel": rule}, "dw") == _weight_grad_flops(model, {"dw.kernel": "full"}, "dw")


# -- 2. FLOPs of the weight-gradient conv ------------------------------------------
def _weight_grad_flops(model, rules, layer):
    """FLOPs of the convs in the compiled step that produce ``layer``'s kernel gradient.

    JAX's kernel gradient is a conv whose output is laid out like the kernel
    (its out_spec is the forward rhs_spec with batch and feature swapped); we
    find it by that layout and by the kernel's window/in-feature extents.
    """
    tx, params, opt_state, batch = _setup(model)
    lowered = pockjax.compile(make_step(model, tx), scheme=pockjax.UpdateScheme(rules, default="frozen")).lower(
        params, opt_state, batch)
    kshape = params[layer]["kernel"].shape
    rule = rules[f"{layer}.kernel"]
    sliced = rule.axis % len(kshape) if isinstance(rule, pockjax.Channels) else None
    found = []

    def visit(eqn, times):  # at any depth: under jax.checkpoint the backward sits in nested jaxprs
        if eqn.primitive.name != "conv_general_dilated":
            return
        if eqn.params["dimension_numbers"].out_spec[0] == 0:  # forward / data-gradient conv: NHWC or NCHW out
            return
        out = eqn.outvars[0].aval.shape
        if all(out[d] == kshape[d] for d in range(len(kshape)) if d != sliced):
            found.append(times * eqn_flops(eqn))

    walk(lowered.graph.jaxpr, visit)
    total = sum(found)
    assert total > 0, f"no weight-gradient conv found for {layer}"
    return total


FLOP_CASES = {
    "regular": (FlaxCNN(), "conv1", HALF),
    "regular-in-channels": (FlaxCNN(), "conv2", pockjax.channels(0.5, axis=2)),
    "depthwise": (FlaxCNN(multiplier=1), "dw", HALF),
    "depthwise-multiplier2": (FlaxCNN(multiplier=2), "dw", HALF),
    "lax-nchw-regular": (LaxCNN(), "conv1", pockjax.channels(0.5, axis=0)),
    "remat-regular": (Remat(FlaxCNN()), "conv1", HALF),
    "remat-depthwise": (Remat(FlaxCNN(multiplier=1)), "dw", HALF),
    "lax-nchw-depthwise": (LaxCNN(), "dw", pockjax.channels(0.5, axis=0)),
}


@pytest.mark.parametrize("case", sorted(FLOP_CASES))
def test_half_channels_cut_weight_gradient_flops(case):
    model, layer, rule = FLOP_CASES[case]
    full = _weight_grad_flops(model, {f"{layer}.kernel": "full"}, layer)
    half = _weight_grad_flops(model, {f"{layer}.kernel": rule}, layer)
    saved = 1 - half / full
    print(f"\n{case}: {layer} weight-gradient conv FLOPs full {full:.0f} -> half channels {half:.0f} ({100 * saved:.1f}% saved)")
    assert saved >= 0.45


# -- the rule itself, for the group bookkeeping ------------------------------------
def _check_rule(fn, args, sel):
    closed = jax.make_jaxpr(fn)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    pushed = slicing.PUSH_RULES["conv_general_dilated"](eqn, sel)
    assert pushed is not None
    forms, params = pushed
    part = eqn.primitive.bind(*[x if f is None else slicing.take(f, x) for x, f in zip(args, forms)], **params)
    np.testing.assert_allclose(part, slicing.take(sel, fn(*args)), atol=1e-5, rtol=1e-5)
    return params


@pytest.mark.parametrize("groups", ["feature", "batch"])
def test_rule_on_grouped_conv_output_features(groups):
    # 3 groups of 2 output features; the selection keeps groups 0 and 2
    k = jax.random.split(jax.random.key(0), 2)
    if groups == "feature":
        x, w = jax.random.normal(k[0], (2, 5, 5, 6)), jax.random.normal(k[1], (3, 3, 2, 6))
        kw = dict(feature_group_count=3)
    else:
        x, w = jax.random.normal(k[0], (6, 5, 5, 2)), jax.random.normal(k[1], (3, 3, 2, 6))
        kw = dict(batch_group_count=3)
    fn = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)
    params = _check_rule(fn, (x, w), ChannelSelect(axis=3, size=6, indices=(0, 1, 4, 5)))
    assert params[f"{groups}_group_count"] == 2
    misaligned = ChannelSelect(axis=3, size=6, indices=(1, 2))
    assert slicing.PUSH_RULES["conv_general_dilated"](jax.make_jaxpr(fn)(x, w).jaxpr.eqns[0], misaligned) is None


def test_rule_on_conv_output_batch():
    x, w = jnp.arange(4 * 5 * 5 * 4.0).reshape(4, 5, 5, 4) / 100, jnp.ones((3, 3, 2, 6))
    fn = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                               feature_group_count=2)
    _check_rule(fn, (x, w), ChannelSelect(axis=0, size=4, indices=(1, 3)))

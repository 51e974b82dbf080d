"""MobileNetV2's sparse (paper-scheme) NNX train step exported for IREE targets.

The step is :func:`pockjax.train.classify.classify_train_step` in train mode
(BatchNorm batch statistics and running-statistic updates, dropout on: its
key and count are state of the module), compiled with ``pockjax.compile(...,
target=...)``, exported with its initial weights and run for 3 steps by the
JAX-free runtime (``pockjax.runtime.load``): cpu in process, arm64 under
qemu-aarch64 (the aarch64 ``iree-run-module``), vulkan on Mesa lavapipe. Every
state leaf (parameters, momentum, BatchNorm running statistics, dropout count)
and the losses must match the XLA step of the same scheme (rtol and atol 1e-4).
arm64 and vulkan *fail* rather than skip without their system packages
(``.ci/system-deps.sh``), as in ``test_iree_targets.py``.

The model is MobileNetV2 at width 0.35 with the first three stages (5
inverted-residual blocks: the t = 1 block, stride-2 and residual blocks) so
that each target compiles in seconds; the paper scheme trains the expand convs
and BatchNorm biases of the last 2 blocks, the last conv's bias and the head.

Why SGD with momentum and not Adam: the paper scheme trains every block's
``project.norm.bias``, whose gradient is exactly zero in train mode (the next
1x1 conv is linear and its BatchNorm subtracts the batch mean, so a
per-channel shift cancels). Float32 leaves ~1e-9 of noise there, different on
each backend, and Adam's normalisation turns that noise into steps of size
``lr``: two correct backends then disagree by ``2 * lr`` on those leaves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _iree_steps as S

pytestmark = pytest.mark.iree

RTOL = ATOL = 1e-4
N_STEPS = 3
# The first three stages of MobileNetV2's (t, c, n, s) table.
SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2))


def _config():
    from pockjax.models.mobilenetv2 import MobileNetV2Config

    return MobileNetV2Config(width_mult=0.35, num_classes=5, inverted_residual_setting=SETTING)


def _scheme():
    from pockjax.schemes import get_scheme

    import pockjax.models.mobilenetv2  # noqa: F401  (registers the family's schemes)

    return get_scheme("paper", _config(), blocks=2)


#: XLA's default level (3) for the in-process computations this file compares against, not the
#: suite's -O0 (conftest): BatchNorm's backward subtracts near-equal sums and ReLU6's kinks sit
#: at rounding distance, so two correct compilations of this step differ by up to 8e-4 in a
#: momentum (XLA at -O0 against -O3); at the same level, IREE's cpu step is within 2e-6 of XLA's.
DEFAULT_LEVEL = {"xla_backend_optimization_level": 3}


def _fresh():
    """A random-init MobileNetV2 in train mode and its optimizer over the scheme's leaves."""
    from flax import nnx

    from pockjax.models.mobilenetv2 import MobileNetV2

    def build():
        return MobileNetV2(_config(), rngs=nnx.Rngs(0, dropout=1))

    # initialised in one program at the default level (eager ops would run at the suite's -O0)
    graphdef = nnx.graphdef(nnx.eval_shape(build))
    model = nnx.merge(graphdef, jax.jit(lambda: nnx.state(build()), compiler_options=DEFAULT_LEVEL)())
    model.train()
    return model, nnx.Optimizer(model, optax.sgd(1e-2, momentum=0.9), wrt=_scheme().nnx_wrt())


@functools.lru_cache(maxsize=None)
def _batches():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(4, 32, 32, 3)).astype(np.float32), rng.integers(0, 5, 4).astype(np.int32))
            for _ in range(N_STEPS)]


def _state_leaves(model, optimizer):
    """The NNX state leaves in the step's input order, typed keys as their key data."""
    from flax import nnx

    from pockjax import _compat as C

    leaves = jax.tree.leaves(nnx.split((model, optimizer))[1])
    return [np.asarray(jax.random.key_data(x) if C.is_key_dtype(x.dtype) else x) for x in leaves]


@functools.lru_cache(maxsize=None)
def _xla_reference():
    """``(state names, initial state, final state, losses)`` of 3 XLA steps of the same scheme."""
    import pockjax
    from pockjax.train.classify import classify_train_step

    model, opt = _fresh()
    step = pockjax.compile(classify_train_step, scheme=_scheme(), xla_options=DEFAULT_LEVEL)
    first = [jnp.asarray(b) for b in _batches()[0]]
    names = list(step.lower(model, opt, *first).graph.in_paths)
    initial = _state_leaves(model, opt)
    assert len(names) == len(initial) + 2
    losses = [float(step(model, opt, *[jnp.asarray(b) for b in batch])) for batch in _batches()]
    return names[: len(initial)], initial, _state_leaves(model, opt), losses


def _export(target, path):
    import pockjax
    from pockjax.train.classify import classify_train_step

    model, opt = _fresh()
    step = pockjax.compile(classify_train_step, scheme=_scheme(), target=target)
    return step.export(path, model, opt, *[jnp.asarray(b) for b in _batches()[0]])


def _check_runtime(module, target):
    names, initial, want, want_losses = _xla_reference()
    state = module.get_state()
    assert set(state) <= set(names)
    # Initial weights as exported: the model's, keys as key data.
    for name, x in zip(names, initial):
        if name in state:
            np.testing.assert_array_equal(state[name], x, err_msg=f"{target}: initial {name}")
    losses = [float(np.asarray(module.step(*batch)[0])) for batch in _batches()]
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL, err_msg=f"{target}: losses")
    got = module.get_state()
    checked = []
    for name, x in zip(names, want):
        if name in got:
            np.testing.assert_allclose(got[name], x, rtol=RTOL, atol=ATOL, err_msg=f"{target}: {name}")
            checked.append(name)
    # Every trained leaf, its momentum and the running statistics are module state and were compared.
    assert any(n.endswith("norm.mean") for n in checked) and any(n.endswith("norm.var") for n in checked)
    assert any(n.startswith("opt_state.") for n in checked) and "head.kernel" in checked
    return max(float(np.max(np.abs(np.asarray(got[n], np.float64) - np.asarray(x, np.float64))))
               for n, x in zip(names, want) if n in got)


def test_state_updates_under_train_mode():
    """The XLA reference itself: running statistics, momentum and the dropout count change."""
    names, initial, final, losses = _xla_reference()
    changed = {n for n, a, b in zip(names, initial, final) if not np.array_equal(a, b)}
    assert "model_state.blocks.4.project.norm.var" in changed and "head.kernel" in changed
    assert "model_state.dropout.rngs.count" in changed
    assert "blocks.1.expand.conv.kernel" not in changed  # frozen by the paper scheme (last 2 blocks)
    assert np.isfinite(losses).all()


def test_cpu_export_runs_in_runtime_like_xla(tmp_path):
    from pockjax import runtime

    module = runtime.load(_export("cpu", tmp_path / "cpu"))
    _check_runtime(module, "cpu")


def test_arm64_export_runs_under_qemu_like_xla(tmp_path):
    from pockjax import runtime

    tool = S.require_arm64_runner()
    _check_runtime(runtime.load(_export("arm64", tmp_path / "arm64"), tool=tool), "arm64")


# IREE 3.13's vulkan-spirv computed this step's gradients below the head wrongly on lavapipe, with
# no compiler error (after one step the momentum of blocks.4.expand.conv.kernel was off by 4.9 where
# its largest entry is 0.038): the gross cause is the case below, which the vulkan-merge-reduced-axes
# workaround (pockjax/backends/iree/workarounds.py) avoids. What remains is still outside 1e-4: the
# gradient of a project conv's BatchNorm bias, exactly zero in exact arithmetic (the next 1x1 conv
# is linear and its BatchNorm subtracts the batch mean) and 1e-8 on XLA and IREE cpu, comes out
# near 8e-4 on lavapipe, and the leaves it feeds drift by up to 3e-4 in 3 steps. Strict, so that it
# reports when fixed; raises=AssertionError keeps a missing lavapipe (pytest.fail) a failure.
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="vulkan-spirv on lavapipe: a cancelling BatchNorm-bias gradient at 8e-4, not 1e-8")
def test_vulkan_export_runs_on_lavapipe_like_xla(tmp_path):
    from pockjax import runtime

    S.require_vulkan()
    _check_runtime(runtime.load(_export("vulkan", tmp_path / "vulkan")), "vulkan")


# The root cause, minimal: BatchNorm's centring x - mean(x, axes=(0, 1, 2)) over an NHWC tensor
# came back as garbage from vulkan-spirv on lavapipe (errors up to 1e32), while the mean alone and
# the same computation with the axes merged by a reshape are exact. compile_flat applies the
# vulkan-merge-reduced-axes rewrite by default on vulkan; without it the values are wrong.
def test_vulkan_centring_over_three_axes():
    from pockjax.backends import iree as piree

    S.require_vulkan()
    x = np.random.default_rng(0).normal(size=(4, 4, 4, 24)).astype(np.float32)

    def centre(x):
        return (x - jnp.mean(x, (0, 1, 2)),)

    exe = piree.compile_flat(centre, [jax.ShapeDtypeStruct(x.shape, x.dtype)], "vulkan")
    np.testing.assert_allclose(np.asarray(exe(x)[0]), np.asarray(centre(x)[0]), rtol=1e-5, atol=1e-5)


# The same failure, beyond the first rewrite: a max or min over several axes, axes that are not
# neighbours, and a centring inside a scan's body came back wrong (errors up to 1e37, a whole step's
# losses NaN); the rewrite takes each over one merged axis, in loop and branch bodies too.
@pytest.mark.parametrize("case", ["max", "min-not-neighbours", "sum-not-neighbours", "in-scan", "in-cond"])
def test_vulkan_reductions_over_several_axes(case):
    from pockjax.backends import iree as piree

    S.require_vulkan()
    x = (np.random.default_rng(0).normal(size=(4, 4, 4, 24)) * 3 + 1).astype(np.float32)
    f = {"max": lambda x: x - x.max((0, 1, 2)),
         "min-not-neighbours": lambda x: x - x.min((0, 2), keepdims=True),
         "sum-not-neighbours": lambda x: x - x.sum((0, 2), keepdims=True),
         "in-scan": lambda x: jax.lax.scan(lambda h, _: (jnp.tanh(h - h.mean((0, 1, 2))), None), x, None, length=2)[0],
         "in-cond": lambda x: jax.lax.cond(x[0, 0, 0, 0] > -10, lambda h: h - h.mean((0, 1, 2)), lambda h: h, x)}[case]
    exe = piree.compile_flat(lambda x: (f(x),), [jax.ShapeDtypeStruct(x.shape, x.dtype)], "vulkan")
    np.testing.assert_allclose(np.asarray(exe(x)[0]), np.asarray(f(x)), rtol=1e-5, atol=1e-4)

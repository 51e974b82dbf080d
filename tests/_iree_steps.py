"""Small train steps (MLP, tiny LLaMA) and a compile cache shared by the IREE tests.

The steps are written here, independent of pockjax.models, so that the IREE
backend is tested on its own: ``jax.value_and_grad`` + ``optax.adam`` over a
plain dict of parameters, flattened to the flat-array form the lead's
``pockjax.compile`` hands to ``pockjax.backends.iree.compile_flat``.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

RTOL = 1e-4
# Adam normalises updates (lr * m / sqrt(v)), so a gradient entry near zero turns float32
# rounding differences into update differences up to ~lr * 1e-3; 1e-5 absolute covers that
# (lr = 1e-2) while a wrong update (size ~lr) still fails.
ATOL = 1e-5


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def mlp_init(key, din=8, dh=16, dout=4):
    k1, k2 = jax.random.split(key)
    return {
        "l1": {"w": jax.random.normal(k1, (din, dh)) * 0.3, "b": jnp.zeros(dh)},
        "l2": {"w": jax.random.normal(k2, (dh, dout)) * 0.3, "b": jnp.zeros(dout)},
    }


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    o = h @ p["l2"]["w"] + p["l2"]["b"]
    return jnp.mean((o - y) ** 2)


@dataclass(frozen=True)
class TinyLlama:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    hidden: int = 48
    layers: int = 1
    seq: int = 8
    batch: int = 2

    def init(self, key):
        ks = iter(jax.random.split(key, 4 + 9 * self.layers))
        n = lambda *s: jax.random.normal(next(ks), s) * 0.1  # noqa: E731
        p = {"embed": n(self.vocab, self.dim), "norm": jnp.ones(self.dim), "head": n(self.dim, self.vocab)}
        for i in range(self.layers):
            p[f"layer{i}"] = {
                "attn_norm": jnp.ones(self.dim),
                "wq": n(self.dim, self.dim), "wk": n(self.dim, self.dim),
                "wv": n(self.dim, self.dim), "wo": n(self.dim, self.dim),
                "ffn_norm": jnp.ones(self.dim),
                "w1": n(self.dim, self.hidden), "w3": n(self.dim, self.hidden), "w2": n(self.hidden, self.dim),
            }
        return p

    def logits(self, p, tokens):
        B, T, D, H = tokens.shape[0], tokens.shape[1], self.dim, self.heads

        def rms(x, w):
            return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w

        x = p["embed"][tokens]
        mask = jnp.tril(jnp.ones((T, T), bool))
        for i in range(self.layers):
            q = p[f"layer{i}"]
            h = rms(x, q["attn_norm"])
            heads = lambda a: a.reshape(B, T, H, D // H)  # noqa: E731
            Q, K, V = heads(h @ q["wq"]), heads(h @ q["wk"]), heads(h @ q["wv"])
            s = jnp.einsum("bthd,bshd->bhts", Q, K) / np.sqrt(D // H)
            a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
            x = x + jnp.einsum("bhts,bshd->bthd", a, V).reshape(B, T, D) @ q["wo"]
            h = rms(x, q["ffn_norm"])
            x = x + (jax.nn.silu(h @ q["w1"]) * (h @ q["w3"])) @ q["w2"]
        return rms(x, p["norm"]) @ p["head"]

    def loss(self, p, tokens, targets):
        logp = jax.nn.log_softmax(self.logits(p, tokens), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def batch_data(self, key):
        tok = jax.random.randint(key, (self.batch, self.seq), 0, self.vocab, dtype=jnp.int32)
        return tok, jnp.roll(tok, -1, axis=1)


# ---------------------------------------------------------------------------
# Steps as flat functions
# ---------------------------------------------------------------------------


@dataclass
class FlatStep:
    """A train step flattened the way pockjax.compile hands it to the backend."""

    name: str
    step: Callable  # (params, opt_state, *batch) -> (params, opt_state, loss)
    params: Any
    opt_state: Any
    batches: list  # list of tuples of batch arrays, one per step
    flat_fun: Callable
    flat_avals: list
    state_mask: list
    n_state: int
    input_names: list

    def flat_state(self):
        return [np.asarray(a) for a in jax.tree.leaves((self.params, self.opt_state))]

    def reference(self, n_steps):
        """Runs ``jax.jit(step)``; returns (losses, flat final state)."""
        f = jax.jit(self.step)
        p, s, losses = self.params, self.opt_state, []
        for i in range(n_steps):
            p, s, loss = f(p, s, *self.batches[i % len(self.batches)])
            losses.append(float(loss))
        return losses, [np.asarray(a) for a in jax.tree.leaves((p, s))]


def _names(tree, prefix):
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [prefix + jax.tree_util.keystr(pth) for pth, _ in paths]


def make_flat_step(name, step, params, opt_state, batches) -> FlatStep:
    closed = jax.make_jaxpr(step)(params, opt_state, *batches[0])
    flat = jax.tree.leaves((params, opt_state, *batches[0]))
    n_state = len(jax.tree.leaves((params, opt_state)))
    names = _names(params, "params") + _names(opt_state, "opt_state") + [f"batch[{i}]" for i in range(len(batches[0]))]
    return FlatStep(
        name=name, step=step, params=params, opt_state=opt_state, batches=batches,
        flat_fun=jax.extend.core.jaxpr_as_fun(closed),
        flat_avals=[jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype) for a in flat],
        state_mask=[i < n_state for i in range(len(flat))], n_state=n_state, input_names=names,
    )


@functools.lru_cache(maxsize=None)
def mlp_step() -> FlatStep:
    opt = optax.adam(1e-2)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    params = mlp_init(jax.random.PRNGKey(0))
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    batches = [(jax.random.normal(k, (4, 8)), jnp.sin(jax.random.normal(k, (4, 4)))) for k in keys]
    return make_flat_step("mlp", step, params, opt.init(params), batches)


PAPER_TRAINABLE = ("wq", "wk", "wv", "wo", "w1", "attn_norm", "ffn_norm")


@functools.lru_cache(maxsize=None)
def llama_step(sparse: bool = False, model: TinyLlama = TinyLlama()) -> FlatStep:
    """Tiny LLaMA train step; ``sparse`` trains only attention, w1 and norms (the paper's scheme)."""
    opt = optax.adam(1e-2)
    params = model.init(jax.random.PRNGKey(0))
    if sparse:
        mask = jax.tree_util.tree_map_with_path(
            lambda path, _: any(getattr(k, "key", None) in PAPER_TRAINABLE for k in path), params
        )
        opt = optax.masked(optax.adam(1e-2), mask)

    def step(p, s, tok, tgt):
        loss, g = jax.value_and_grad(model.loss)(p, tok, tgt)
        if sparse:
            g = jax.tree.map(lambda gi, m: gi if m else jnp.zeros_like(gi), g, mask)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    batches = [model.batch_data(k) for k in keys]
    return make_flat_step("llama-sparse" if sparse else "llama", step, params, opt.init(params), batches)


# ---------------------------------------------------------------------------
# Compile cache and system requirements
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def compiled(step_name: str, target: str, workarounds: Any = "default"):
    """Compiles a named step for a target once per test session (CompiledModule)."""
    from pockjax.backends import iree as piree

    fs = {"mlp": mlp_step, "llama": lambda: llama_step(False), "llama-sparse": lambda: llama_step(True)}[step_name]()
    return piree.compile_flat(
        fs.flat_fun, fs.flat_avals, target, state_mask=fs.state_mask, input_names=fs.input_names,
        workarounds=workarounds if workarounds == "default" else list(workarounds), bind=False,
        extra={"step": step_name},
    )


def require_vulkan():
    """Fails (not skips) when no Vulkan device is usable: CI installs lavapipe."""
    import iree.runtime as rt

    try:
        devices = rt.get_driver("vulkan").query_available_devices()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"IREE's vulkan driver cannot start ({e}); install Mesa lavapipe with .ci/system-deps.sh "
                    "(apt-get install mesa-vulkan-drivers)")
    if not devices:
        pytest.fail("no Vulkan device found; install Mesa lavapipe with .ci/system-deps.sh "
                    "(apt-get install mesa-vulkan-drivers)")
    return devices


def require_arm64_runner():
    """Fails (not skips) without qemu-aarch64 + arm64 libc + the aarch64 iree-run-module."""
    from pockjax.backends.iree import arm64

    try:
        return arm64.command_prefix()
    except arm64.Arm64RunnerUnavailable as e:
        pytest.fail(f"arm64 runner unavailable: {e}")


def have_cuda_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def bound_executable(step_name, target, workarounds="default"):
    """An IreeExecutable for a target runnable here (arm64 under qemu)."""
    from pockjax.backends import iree as piree

    c = compiled(step_name, target, workarounds)
    if target == "vulkan":
        require_vulkan()
    if target == "arm64":
        return piree.IreeExecutable(c, tool=require_arm64_runner())
    return piree.IreeExecutable(c)


def run_steps(exe, fs: FlatStep, n_steps):
    exe.set_state(fs.flat_state())
    losses = []
    for i in range(n_steps):
        (loss,) = exe.step(*[np.asarray(b) for b in fs.batches[i % len(fs.batches)]])
        losses.append(float(loss))
    return losses, list(exe.get_state().values())


def assert_matches(fs, losses, state, ref_losses, ref_state, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol, atol=atol, err_msg=f"{fs.name}: losses")
    assert len(state) == len(ref_state)
    for name, a, b in zip(fs.input_names, state, ref_state):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{fs.name}: {name}")


def max_abs_diff(state, ref_state):
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) for a, b in zip(state, ref_state))




def jax_tree_params(fs: FlatStep, flat_state):
    """The params pytree from a flat state list (params leaves come first)."""
    n = len(jax.tree.leaves(fs.params))
    return jax.tree.unflatten(jax.tree.structure(fs.params), [jnp.asarray(a) for a in flat_state[:n]])

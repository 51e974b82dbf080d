"""The suite compiles XLA's CPU programs at LLVM -O0 (tests/conftest.py); users run at XLA's
default level (3). These tests compile the same steps at the default level, through the
compiler option (which takes precedence over XLA_FLAGS), so what users run is checked too."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax
from pockjax.models import llama
from pockjax.train import llama_scheme
from pockjax.train.steps import answer_train_step, lm_train_step
from test_finetune import TINY, tiny_model

DEFAULT = {"xla_backend_optimization_level": 3}  # XLA's default (debug_options_flags.cc)
SUITE = {"xla_backend_optimization_level": 0}


def test_the_suite_compiles_at_o0_unless_told_otherwise():
    # the premise of this file: without it the tests below compare the default with itself
    flags = os.environ["XLA_FLAGS"]
    if os.environ.get("POCKJAX_TEST_XLA_DEFAULT_OPT") == "1":
        assert "xla_backend_optimization_level=0" not in flags
    else:
        assert "--xla_backend_optimization_level=0" in flags.split()


def _batch():
    return {"tokens": jnp.array([[5, 6, 7, 8, 9, 10]] * 2), "targets": jnp.array([[6, 7, 8, 9, 10, 0]] * 2),
            "loss_mask": jnp.array([[0., 0., 1., 1., 1., 0.]] * 2), "loss_start": jnp.array([2, 2])}


def test_full_step_at_the_default_level_equals_jax_jit():
    graphdef, params = llama.split(tiny_model())
    tx = optax.adamw(1e-2)
    t = jnp.array([[5, 6, 7, 8, 9, 10]] * 2)
    args = (t, jnp.roll(t, -1, axis=1), jnp.ones(t.shape))
    ours = pockjax.compile(lm_train_step(graphdef, tx), xla_options=DEFAULT)
    ref = jax.jit(lm_train_step(graphdef, tx), compiler_options=DEFAULT)
    p_ref, o_ref = params, tx.init(params)
    p, o = jax.tree.map(jnp.array, params), tx.init(params)  # pockjax's step takes its inputs' buffers
    for _ in range(3):
        p_ref, o_ref, loss_ref = ref(p_ref, o_ref, *args)
        p, o, loss = ours(p, o, *args)
        np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_ref)):
        # Adam divides by the gradient's size: rounding in a near-zero gradient moves an entry by up to ~1e-6 of its
        # lr=1e-2 step; a wrong update would be ~1e-2 off
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_paper_scheme_step_is_the_same_at_the_default_level_and_at_o0():
    graphdef, params = llama.split(tiny_model())
    # momentum SGD, not Adam: Adam divides by the gradient's size, so a rounding difference in
    # a near-zero gradient becomes a visible one in the weights (5e-5 after 3 steps here)
    tx = optax.sgd(0.1, momentum=0.9)
    scheme = llama_scheme("paper", TINY, blocks=1)
    results = []
    for options in (DEFAULT, SUITE):
        step = pockjax.compile(answer_train_step(graphdef, tx, 4), scheme=scheme, xla_options=options)
        p, o = jax.tree.map(jnp.array, params), pockjax.init_opt_state(tx, params, scheme)
        losses = []
        for _ in range(3):
            p, o, loss = step(p, o, _batch())
            losses.append(float(loss))
        results.append((losses, p))
    (l_default, p_default), (l_o0, p_o0) = results
    np.testing.assert_allclose(l_default, l_o0, rtol=1e-6)
    assert l_default[-1] < l_default[0]  # it trains
    moved = 0
    for a, b, start in zip(jax.tree.leaves(p_default), jax.tree.leaves(p_o0), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        moved += not np.array_equal(a, start)
    assert moved > 0

"""User-style training programs against ``jax.jit`` / ``nnx.jit`` under random update schemes.

For every program in :mod:`corpus_programs` and several random schemes (each
parameter full, frozen, or channels on a random axis with a random count or
index set), ``STEPS`` steps of ``pockjax.compile(step, scheme=...)`` are run
next to the reference: the same step under ``jax.jit`` (``nnx.jit`` for NNX)
with the gradient of every frozen entry set to zero, after which every frozen
entry of params and optimizer state is put back. Checked after every step:

* trained entries equal the reference (atol = rtol = 1e-5),
* frozen entries of params and of the optimizer state that mirrors them are
  bitwise their initial values,
* everything else the step updates (BatchNorm statistics, counters, RNG
  state, step counts, injected hyperparameters) equals the reference,
* aux outputs (the loss) equal the reference.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pockjax
from corpus_programs import FACTORIES, STEPS
from test_sparse_semantics import entry_mask

N_SCHEMES = 3
TOL = dict(atol=1e-5, rtol=1e-5)
# XLA's backend optimisations take most of each compile on CPU, and every scheme is
# a compile: both pockjax's step and the jax.jit reference are compiled without
# them (the same options on both sides: the optimisations reorder float sums).
# nnx.jit takes no compiler options, so NNX programs compile with the defaults.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def xla_options(prog):
    return {} if prog.kind == "nnx" else FAST_COMPILE


@functools.lru_cache(maxsize=None)
def program(name):
    return FACTORIES[name]()


# -- helpers ------------------------------------------------------------------------------
def is_key(x):
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def snapshot(x):
    return np.array(jax.random.key_data(x) if is_key(x) else x, copy=True)


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def nnx_copy(model, optimizer):
    """A copy of an NNX model and optimizer that shares no buffer with them (steps donate)."""
    model, optimizer = nnx.clone(model), nnx.clone(optimizer)
    nnx.update((model, optimizer), copy_tree(nnx.state((model, optimizer))))
    return model, optimizer


def flat_state(prog, state):
    """Dotted paths and leaves of the state arguments (for NNX: of the model and optimizer state)."""
    tree = nnx.state(tuple(state)) if prog.kind == "nnx" else tuple(state)
    return pockjax.leaf_paths(tree), jax.tree.leaves(tree)


def param_shapes(prog, state):
    paths, leaves = flat_state(prog, state)
    by_path = dict(zip(paths, leaves))
    return [tuple(np.shape(by_path[prog.param_leaf_prefix + p])) for p in prog.param_paths]


def leaf_masks(prog, paths, leaves, masks):
    """Per state leaf: the mask of the parameter it is (or its optimizer state mirrors), else None."""
    out = []
    for path, leaf in zip(paths, leaves):
        m = None
        rel = path[len(prog.param_leaf_prefix):]
        if path.startswith(prog.param_leaf_prefix) and rel in masks:
            m = masks[rel]
        elif path.startswith(prog.opt_leaf_prefix):
            best = None
            for p, mask in masks.items():
                g = p[len(prog.grad_prefix):]
                if path.endswith("." + g) and np.shape(leaf) == mask.shape and (best is None or len(g) > len(best)):
                    best, m = g, mask
        out.append(m)
    return out


def make_hook(masks):
    """Zero the gradient of every frozen entry; ``masks`` is keyed by the gradient tree's paths."""

    def hook(grads):
        leaves, treedef = jax.tree.flatten(grads)
        paths = pockjax.leaf_paths(grads)
        assert sorted(paths) == sorted(masks), (paths, sorted(masks))
        return jax.tree.unflatten(
            treedef, [jnp.where(masks[p] > 0, g, jnp.zeros_like(g)) for p, g in zip(paths, leaves)]
        )

    return hook


def identity(grads):
    return grads


@functools.lru_cache(maxsize=None)
def reference_fn(name):
    """The step under jax.jit / nnx.jit with the masking hook; masks are arguments (one compile per program)."""
    prog = program(name)
    if prog.kind == "nnx":
        return nnx.jit(lambda model, opt, masks, *batch: prog.make_step(make_hook(masks))(model, opt, *batch))
    return jax.jit(lambda masks, *args: prog.make_step(make_hook(masks))(*args), compiler_options=FAST_COMPILE)


def reference_step(prog, state, batch, masks):
    """One reference step: the masked full step, then frozen entries put back. Returns (state, aux)."""
    hook_masks = {p[len(prog.grad_prefix):]: jnp.asarray(m) for p, m in masks.items()}
    paths, old = flat_state(prog, state)
    smasks = leaf_masks(prog, paths, old, masks)
    old = [snapshot(x) for x in old]
    if prog.kind == "nnx":
        aux = reference_fn(prog.name)(*state, hook_masks, *batch)
        new_state = state
        tree = nnx.state(tuple(state))
    else:
        outs = reference_fn(prog.name)(hook_masks, *state, *batch)
        new_state, aux = tuple(outs[: prog.n_state]), tuple(outs[prog.n_state:])
        tree = new_state
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [x if m is None else jnp.where(m > 0, x, o) for x, o, m in zip(leaves, old, smasks)]
    restored = jax.tree.unflatten(treedef, leaves)
    if prog.kind == "nnx":
        nnx.update(tuple(state), restored)
        return state, aux
    return restored, aux


def pockjax_step(prog, compiled, state, batch):
    if prog.kind == "nnx":
        return state, compiled(*state, *batch)
    outs = compiled(*state, *batch)
    return tuple(outs[: prog.n_state]), tuple(outs[prog.n_state:])


def fresh_state(prog):
    state = prog.init()
    if prog.kind == "nnx":
        return nnx_copy(*state), nnx_copy(*state)
    return copy_tree(state), copy_tree(state)


# -- random schemes -----------------------------------------------------------------------
def random_scheme(rng, paths, shapes):
    rules = {}
    for path, shape in zip(paths, shapes):
        kind = rng.choice(["full", "frozen", "frozen", "count", "indices"])
        if kind in ("full", "frozen") or not shape:
            rules[path] = "frozen" if kind == "frozen" else "full"
            continue
        axis = int(rng.integers(-len(shape), len(shape)))
        size = shape[axis]
        if kind == "count":
            rules[path] = pockjax.channels(int(rng.integers(1, size + 1)), axis=axis)
        else:
            n = int(rng.integers(1, size + 1))
            rules[path] = pockjax.channels(indices=sorted(rng.choice(size, n, replace=False).tolist()), axis=axis)
    if all(r == "frozen" for r in rules.values()):
        rules[paths[int(rng.integers(len(paths)))]] = "full"
    return pockjax.UpdateScheme(rules, default="frozen")


def schemes_for(prog, shapes):
    rng = np.random.default_rng(sum(map(ord, prog.name)))
    out = [random_scheme(rng, prog.param_paths, shapes) for _ in range(N_SCHEMES)]
    if prog.stacked:
        out.append(pockjax.UpdateScheme({prog.stacked: pockjax.channels(indices=[6, 7], axis=0)}))
        rules = {p: "full" for p in prog.param_paths if p.startswith("head.")}
        rules[prog.stacked] = pockjax.channels(indices=[6, 7], axis=0)
        out.append(pockjax.UpdateScheme(rules))
    return out


# -- the check ------------------------------------------------------------------------------
def assert_same_tree(got, want, what):
    chex.assert_trees_all_close(jax.tree.map(snapshot, got), jax.tree.map(snapshot, want), **TOL,
                                custom_message=what)


def check_program(prog, scheme):
    ours, ref = fresh_state(prog)
    shapes = param_shapes(prog, ours)
    rules = scheme.resolve(prog.param_paths, shapes)
    masks = {p: entry_mask(r, s) for p, r, s in zip(prog.param_paths, rules, shapes)}
    paths, leaves0 = flat_state(prog, ours)
    smasks = leaf_masks(prog, paths, leaves0, masks)
    assert all(smasks[paths.index(prog.param_leaf_prefix + p)] is not None for p in prog.param_paths)
    initial = [snapshot(x) for x in leaves0]
    compiled = pockjax.compile(prog.make_step(identity), scheme=scheme, xla_options=xla_options(prog))

    for t, batch in enumerate(prog.batches):
        ours, aux = pockjax_step(prog, compiled, ours, batch)
        ref, ref_aux = reference_step(prog, ref, batch, masks)
        where = f"{prog.name}, step {t}, scheme {scheme!r}"
        assert_same_tree(aux, ref_aux, f"aux ({where})")
        got_paths, got = flat_state(prog, ours)
        want_paths, want = flat_state(prog, ref)
        assert got_paths == paths and want_paths == paths
        for path, g, w, m, init in zip(paths, got, want, smasks, initial):
            g, w = snapshot(g), snapshot(w)
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{path}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
            if np.issubdtype(g.dtype, np.inexact):
                np.testing.assert_allclose(g, w, **TOL, err_msg=f"{path} ({where})")
            else:
                np.testing.assert_array_equal(g, w, err_msg=f"{path} ({where})")
            if m is not None:
                frozen = m == 0
                assert np.array_equal(g[frozen], init[frozen]), f"{path}: frozen entries changed ({where})"

    # guard against model state that silently stops updating
    for prefix in prog.changing:
        final = flat_state(prog, ours)[1]
        hits = [(p, snapshot(x), init) for p, x, init in zip(paths, final, initial) if p.startswith(prefix)]
        assert hits, f"{prog.name}: no state leaf under {prefix!r}"
        for p, x, init in hits:
            assert not np.array_equal(x, init), f"{prog.name}: {p} never changed over {STEPS} steps"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_program_matches_reference(name):
    prog = program(name)
    shapes = param_shapes(prog, prog.init())
    for scheme in schemes_for(prog, shapes):
        check_program(prog, scheme)


def test_corpus_size():
    assert len(FACTORIES) >= 10


# -- scheme errors ----------------------------------------------------------------------------
def _call(prog, scheme):
    ours, _ = fresh_state(prog)
    compiled = pockjax.compile(prog.make_step(identity), scheme=scheme)
    return compiled(*ours, *prog.batches[0])


@pytest.mark.parametrize(
    "name", ["linen_cnn_bn_dropout", "nnx_cnn_bn_dropout", "train_state_batch_stats", "scan_stack"]
)
def test_all_frozen_scheme_raises(name):
    prog = program(name)
    with pytest.raises(pockjax.SchemeError):
        _call(prog, pockjax.UpdateScheme({p: "frozen" for p in prog.param_paths}, default="frozen"))
    with pytest.raises(pockjax.SchemeError):
        _call(prog, pockjax.UpdateScheme({}, default="frozen"))


@pytest.mark.parametrize(
    "name,rules",
    [
        ("linen_cnn_bn_dropout", {"batch_stats.**": "full"}),
        ("linen_cnn_bn_dropout", {"batch_stats.BatchNorm_0.mean": "frozen", "params.Dense_0.kernel": "full"}),
        ("counter_in_params", {"step": "full"}),
    ],
)
def test_scheme_naming_only_model_state_raises(name, rules):
    with pytest.raises(pockjax.SchemeError):
        _call(program(name), pockjax.UpdateScheme(rules))


# -- IREE -----------------------------------------------------------------------------------
@pytest.mark.iree
@pytest.mark.slow
@pytest.mark.parametrize("name", ["linen_cnn_bn_dropout", "nnx_cnn_bn_dropout", "scan_remat_stack"])
def test_iree_cpu_matches_xla(name, tmp_path):
    """Dropout keys, BatchNorm statistics and a scanned stack through IREE's cpu target.

    Typed keys cross the module boundary as key data; the step's state stays on
    the IREE device between calls. The exported module, loaded by the JAX-free
    runtime, continues from the same state.
    """
    prog = program(name)
    scheme = schemes_for(prog, param_shapes(prog, prog.init()))[-1]
    on_xla, on_iree = fresh_state(prog)
    xla = pockjax.compile(prog.make_step(identity), scheme=scheme)
    iree = pockjax.compile(prog.make_step(identity), scheme=scheme, target="cpu")
    for t, batch in enumerate(prog.batches):
        on_xla, aux_xla = pockjax_step(prog, xla, on_xla, batch)
        on_iree, aux_iree = pockjax_step(prog, iree, on_iree, batch)
        assert_same_tree(aux_iree, aux_xla, f"{name} aux, step {t}")
        got, want = flat_state(prog, on_iree)[1], flat_state(prog, on_xla)[1]
        assert_same_tree(got, want, f"{name} state, step {t}")
    if prog.kind == "nnx":
        return
    # export with the current state as weights; the runtime (no JAX) runs the next step
    from pockjax import runtime

    batch = prog.batches[0]
    iree.export(str(tmp_path / "module"), *on_iree, *batch)
    module = runtime.load(str(tmp_path / "module"))
    flat_batch = [np.asarray(jax.random.key_data(x) if is_key(x) else x) for x in jax.tree.leaves(batch)]
    aux = module.step(*flat_batch)
    _, want_aux = pockjax_step(prog, xla, on_xla, batch)
    np.testing.assert_allclose(np.asarray(aux[0]), snapshot(jax.tree.leaves(want_aux)[0]), **TOL)

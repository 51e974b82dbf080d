"""Reference semantics of a sparse step, tested property-style.

The compiled sparse step must equal the full step run with the gradient of
every frozen entry set to zero, after which every frozen entry of params and
optimizer state is put back (fp32, atol 1e-5); frozen entries are bitwise
unchanged. The reference below is written independently of pockjax's passes:
it computes the gradient explicitly, masks it, runs the optimizer and restores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import pockjax
from pockjax.scheme import Frozen, Full
from toy_models import MLP, Transformer, make_step

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
}

# Each example compiles a step with XLA; shrinking is left out to keep CI fast
# (a failure still prints its example).
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
)


# -- the independent reference ----------------------------------------------------
def entry_mask(rule, shape):
    """1.0 where an entry is trained, 0.0 where it is frozen."""
    if isinstance(rule, Full):
        return np.ones(shape, np.float32)
    if isinstance(rule, Frozen):
        return np.zeros(shape, np.float32)
    mask = np.zeros(shape, np.float32)
    index = [slice(None)] * len(shape)
    index[rule.axis] = list(rule.indices)
    mask[tuple(index)] = 1.0
    return mask


def state_masks(opt_state, params, param_masks):
    """Mask per optimizer-state leaf: the mirrored parameter's mask, else None."""
    pflat = jax.tree_util.tree_flatten_with_path(params)[0]
    pkeys = [(jax.tree_util.keystr(k), np.shape(v)) for k, v in pflat]
    out = []
    for k, v in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        ks = jax.tree_util.keystr(k)
        match = None
        for j, (pk, ps) in enumerate(pkeys):
            if ks.endswith(pk) and np.shape(v) == ps and (match is None or len(pk) > len(pkeys[match][0])):
                match = j
        out.append(None if match is None else param_masks[match])
    return out


def reference_masks(rules, params, opt_state):
    """The entry masks of the parameters and of the optimizer-state leaves (None: unmasked)."""
    masks = [entry_mask(r, np.shape(x)) for r, x in zip(rules, jax.tree.leaves(params))]
    return masks, state_masks(opt_state, params, masks)


def masked_step(model, tx, masks, smasks, params, opt_state, batch):
    """The full step with the gradient masked, then the frozen (mask 0) entries of params
    and optimizer state put back. Masks of ones make it the plain full step."""
    leaves, treedef = jax.tree.flatten(params)
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    grads = jax.tree.unflatten(treedef, [g * m for g, m in zip(jax.tree.leaves(grads), masks)])
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_params = jax.tree.unflatten(
        treedef, [jnp.where(m > 0, n, o) for n, o, m in zip(jax.tree.leaves(new_params), leaves, masks)]
    )
    new_opt_leaves = [
        n if m is None else jnp.where(m > 0, n, o)
        for n, o, m in zip(jax.tree.leaves(new_opt), jax.tree.leaves(opt_state), smasks)
    ]
    return new_params, jax.tree.unflatten(jax.tree.structure(opt_state), new_opt_leaves), loss


def reference_step(model, tx, rules, params, opt_state, batch):
    """The reference step for these rules: new params, new state, loss, and the masks."""
    masks, smasks = reference_masks(rules, params, opt_state)
    return (*masked_step(model, tx, masks, smasks, params, opt_state, batch), masks, smasks)


# -- random schemes ---------------------------------------------------------------
@st.composite
def schemes(draw, params):
    paths = pockjax.leaf_paths(params)
    shapes = [np.shape(x) for x in jax.tree.leaves(params)]
    rules = []
    for path, shape in zip(paths, shapes):
        kind = draw(st.sampled_from(["full", "frozen", "frozen", "count", "fraction", "indices"]))
        if kind in ("full", "frozen"):
            rules.append((path, kind))
            continue
        axis = draw(st.sampled_from([-1, 0])) if len(shape) > 1 else -1
        size = shape[axis]
        if kind == "count":
            rule = pockjax.channels(draw(st.integers(1, size)), axis=axis)
        elif kind == "fraction":
            rule = pockjax.channels(draw(st.sampled_from([0.25, 0.5, 0.75])), axis=axis)
        else:
            idx = draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=size, unique=True))
            rule = pockjax.channels(indices=idx, axis=axis)
        rules.append((path, rule))
    return pockjax.UpdateScheme(rules, default="frozen")


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def check_against_reference(model, opt_name, data, sparse_state=False):
    tx = OPTIMIZERS[opt_name]()
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1))
    scheme = data.draw(schemes(params))
    rules = scheme.resolve_tree(params)
    opt_state = tx.init(params)
    # The reference is compiled once with the masks as arguments (op-by-op dispatch of
    # every example's shapes is slower): with masks of ones it is the full step, run
    # once as a warm-up so that the optimizer state is non-trivial.
    reference = jax.jit(functools.partial(masked_step, model, tx))
    params, opt_state, _ = reference(*reference_masks([Full()] * len(rules), params, opt_state),
                                     params, opt_state, batch)
    masks, smasks = reference_masks(rules, params, opt_state)
    ref_params, ref_opt, ref_loss = reference(masks, smasks, params, opt_state, batch)

    step = pockjax.compile(make_step(model, tx), scheme=scheme)
    if sparse_state:
        sparse = pockjax.init_opt_state(tx, params, scheme)
        # load the warm state into the sparse layout
        full_leaves = jax.tree.leaves(opt_state)
        kept = [
            x if mode is None else pockjax.transforms.slicing.take(mode, x)
            for x, mode in zip(full_leaves, sparse.layout.modes)
            if mode != "drop"
        ]
        kept = copy_tree(kept)  # the step donates its state: keep opt_state readable
        new_params, new_sparse, loss = step(copy_tree(params), pockjax.SparseOptState(kept, sparse.layout), batch)
        new_opt = pockjax.optim.to_full(new_sparse, reference_full=opt_state)
    else:
        new_params, new_opt, loss = step(copy_tree(params), copy_tree(opt_state), batch)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for got, want, old, m in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params), jax.tree.leaves(params), masks):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        frozen = m == 0
        assert np.array_equal(np.asarray(got)[frozen], np.asarray(old)[frozen]), "frozen entries must be bitwise unchanged"
    for got, want, old, m in zip(jax.tree.leaves(new_opt), jax.tree.leaves(ref_opt), jax.tree.leaves(opt_state), smasks):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        if m is not None:
            frozen = m == 0
            assert np.array_equal(np.asarray(got)[frozen], np.asarray(old)[frozen])


@SETTINGS
@given(
    sizes=st.lists(st.integers(2, 7), min_size=2, max_size=4).map(tuple),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    data=st.data(),
)
def test_mlp_matches_reference(sizes, opt_name, data):
    check_against_reference(MLP(sizes=sizes), opt_name, data)


@SETTINGS
@given(
    layers=st.integers(1, 3),
    scan=st.booleans(),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    data=st.data(),
)
def test_transformer_matches_reference(layers, scan, opt_name, data):
    check_against_reference(Transformer(layers=layers, scan=scan), opt_name, data)


@settings(SETTINGS, max_examples=6)
@given(scan=st.booleans(), opt_name=st.sampled_from(["adam", "adamw", "sgd_momentum", "lion"]), data=st.data())
def test_sparse_optimizer_state_matches_reference(scan, opt_name, data):
    check_against_reference(Transformer(layers=2, scan=scan), opt_name, data, sparse_state=True)


FULL_CASES = [(MLP(), name) for name in sorted(OPTIMIZERS)] + [
    (model, name) for model in (Transformer(), Transformer(scan=True)) for name in ("adamw", "clip_adamw")
]


@pytest.mark.parametrize(
    "model,opt_name", FULL_CASES, ids=[f"{type(m).__name__}{'-scan' if getattr(m, 'scan', False) else ''}-{n}" for m, n in FULL_CASES]
)
def test_all_full_scheme_equals_jit(model, opt_name):
    tx = OPTIMIZERS[opt_name]()
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1))
    opt_state = tx.init(params)
    want = jax.jit(make_step(model, tx))(params, opt_state, batch)
    got = pockjax.compile(make_step(model, tx), scheme=pockjax.UpdateScheme.full())(
        copy_tree(params), copy_tree(opt_state), batch
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_frozen_params_are_returned_without_copy_and_not_donated():
    model, tx = MLP(), optax.adam(1e-2)
    params = model.init(jax.random.key(0))
    step = pockjax.compile(make_step(model, tx), scheme=pockjax.UpdateScheme({"dense1.*": "full"}))
    new_params, _, _ = step(params, tx.init(params), model.batch(jax.random.key(1)))
    assert new_params["dense0"]["kernel"] is params["dense0"]["kernel"]
    assert not params["dense0"]["kernel"].is_deleted()
    assert params["dense1"]["kernel"].is_deleted()  # trained: donated



def test_unchanged_optimizer_state_is_donated_with_its_argument_as_jit_does():
    # optax.inject_hyperparams keeps its (constant) learning rate in the state:
    # the step forwards that leaf unchanged. jax.jit(step, donate_argnums=(0, 1))
    # donates it with the rest of opt_state and returns it aliased; pockjax does
    # the same, which lets the whole call run through one jax.jit dispatch.
    model = MLP()
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1))
    want = jax.jit(make_step(model, tx), donate_argnums=(0, 1))(copy_tree(params), tx.init(params), batch)
    step = pockjax.compile(make_step(model, tx), scheme=pockjax.UpdateScheme.full())
    opt_state = tx.init(params)
    lr = opt_state.hyperparams["learning_rate"]
    compiled = step.lower(params, opt_state, batch).compile()
    assert any(src is not None for src in compiled.passthrough), "the step should forward the learning rate"
    assert compiled.tree_call is not None, "an unchanged state leaf kept the step off the one-dispatch path"
    got = step(copy_tree(params), opt_state, batch)
    assert lr.is_deleted()  # donated with its argument, as jax.jit donates it
    np.testing.assert_array_equal(got[1].hyperparams["learning_rate"], np.float32(1e-2))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    # a second call with the returned state (the forwarded leaf among it) runs on
    again = step(got[0], got[1], batch)
    assert np.isfinite(float(again[2]))

def test_sparse_state_is_smaller_and_round_trips():
    model, tx = Transformer(layers=2), optax.adamw(1e-2)
    params = model.init(jax.random.key(0))
    scheme = pockjax.UpdateScheme({"layers.1.attn.*.kernel": pockjax.channels(0.5), "layers.1.mlp.w1.kernel": "full"})
    sparse = pockjax.init_opt_state(tx, params, scheme)
    full_bytes = sum(x.nbytes for x in jax.tree.leaves(tx.init(params)))
    assert sparse.nbytes < 0.25 * full_bytes
    step = pockjax.compile(make_step(model, tx), scheme=scheme)
    batch = model.batch(jax.random.key(1))
    p, s, loss0 = step(params, sparse, batch)
    for _ in range(3):
        p, s, loss = step(p, s, batch)
    assert isinstance(s, pockjax.SparseOptState) and s.layout == sparse.layout
    assert float(loss) < float(loss0)

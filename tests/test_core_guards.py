"""The general core's guards and the Flax ways of writing a step.

Each guard against a silently wrong result has a test here that makes it fire:
the tagging self-test, the verified JAX range, a step that differentiates
nothing, a scheme that freezes everything or names model state, leaves that
are not arrays. The rest pins what users' programs rely on: errors in the
user's words, Flax ``TrainState`` with a sparse optimizer state, NNX optimizers
that hold state only for trained leaves, typed PRNG keys, and scanned layers
trained per layer with the backward of frozen iterations pruned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import pockjax
from pockjax import _compat as C
from toy_models import nnx_mse_step


def _mlp_step(tx):
    def my_train_step(params, opt_state, x):
        def loss_fn(p):
            return jnp.mean(jnp.tanh(x @ p["a"]) @ p["b"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return my_train_step


def _mlp_args(tx):
    params = {"a": jnp.ones((3, 4)) * 0.1, "b": jnp.ones((4, 2)) * 0.1}
    return params, tx.init(params), jnp.ones((5, 3))


# -- the tagging guard ------------------------------------------------------------
def test_tagging_self_test_fails_loudly_when_grad_bypasses_the_hook(monkeypatch):
    monkeypatch.setattr(C.ad, "linearize", C._original_linearize)
    monkeypatch.setattr("pockjax.graph._tagging_verified", False)
    tx = optax.sgd(0.1)
    step = pockjax.compile(_mlp_step(tx), scheme=pockjax.UpdateScheme({"b": "full"}))
    with pytest.raises(pockjax.PockjaxError, match="gradient tagging does not work"):
        step(*_mlp_args(tx))


def test_unverified_jax_version_is_refused(monkeypatch):
    monkeypatch.delenv("POCKJAX_ALLOW_UNVERIFIED_JAX", raising=False)
    with pytest.raises(pockjax.PockjaxError, match="verified on JAX"):
        C.check_jax_version((0, 11, 0))
    C.check_jax_version((0, 10, 2))  # the verified range passes
    monkeypatch.setenv("POCKJAX_ALLOW_UNVERIFIED_JAX", "1")
    with pytest.warns(UserWarning, match="verified on JAX"):
        C.check_jax_version((0, 11, 0))


def test_step_that_differentiates_nothing_is_an_error():
    def no_grad_step(params, opt_state, x):
        return jax.tree.map(lambda p: p * 0.5, params), opt_state, x.sum()

    step = pockjax.compile(no_grad_step, scheme=pockjax.UpdateScheme({"a": "full"}))
    with pytest.raises(pockjax.SchemeError, match="no_grad_step differentiates none of its parameters"):
        step({"a": jnp.ones(3)}, (), jnp.ones(3))


# -- scheme guards -------------------------------------------------------------------
def test_all_frozen_scheme_is_an_error_naming_the_step():
    tx = optax.sgd(0.1)
    step = pockjax.compile(_mlp_step(tx), scheme=pockjax.UpdateScheme({"a": "frozen"}))
    with pytest.raises(pockjax.SchemeError, match="freezes every parameter of .*my_train_step"):
        step(*_mlp_args(tx))


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))
        return nn.Dense(1)(nn.relu(x))


def _variables_step(model, tx):
    def step(variables, opt_state, x, y):
        def loss_fn(p):
            out, upd = model.apply({"params": p, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
            return jnp.mean((out - y) ** 2), upd

        (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        new = {"params": optax.apply_updates(variables["params"], updates), "batch_stats": upd["batch_stats"]}
        return new, opt_state, loss

    return step


def _variables_args(model, tx):
    x = jax.random.normal(jax.random.key(1), (6, 4))
    variables = model.init(jax.random.key(0), x)
    return variables, tx.init(variables["params"]), x, jnp.zeros((6, 1))


def test_batch_stats_update_under_every_scheme_as_jit_does():
    model, tx = _BNNet(), optax.adam(1e-2)
    args = _variables_args(model, tx)
    ref = jax.jit(_variables_step(model, tx))(*args)
    before = np.asarray(args[0]["batch_stats"]["BatchNorm_0"]["mean"])
    for scheme in (pockjax.UpdateScheme({"params.Dense_1.*": "full"}), pockjax.UpdateScheme.full()):
        out = pockjax.compile(_variables_step(model, tx), scheme=scheme, donate=False)(*args)
        got = out[0]["batch_stats"]["BatchNorm_0"]["mean"]
        assert not np.array_equal(np.asarray(got), before)  # the statistic moved
        np.testing.assert_allclose(got, ref[0]["batch_stats"]["BatchNorm_0"]["mean"], atol=1e-6)
    # frozen Dense_0 under the first scheme: bitwise unchanged, and its Adam state too
    out = pockjax.compile(_variables_step(model, tx), scheme=pockjax.UpdateScheme({"params.Dense_1.*": "full"}),
                          donate=False)(*args)
    np.testing.assert_array_equal(out[0]["params"]["Dense_0"]["kernel"], args[0]["params"]["Dense_0"]["kernel"])
    np.testing.assert_array_equal(out[1][0].mu["Dense_0"]["kernel"], args[1][0].mu["Dense_0"]["kernel"])


def test_a_linen_variables_step_takes_a_sparse_state_made_with_the_prefix():
    # The step names its parameters params.Dense_1.kernel, the optimizer updates
    # variables["params"]: no scheme served both compile and init_opt_state.
    model, tx = _BNNet(), optax.adam(1e-2)
    variables, full_state, x, y = _variables_args(model, tx)
    scheme = pockjax.UpdateScheme({"params.Dense_1.*": "full"})
    sparse = pockjax.init_opt_state(tx, variables["params"], scheme, prefix="params")
    assert len(sparse.leaves) == 5  # count, and mu and nu of Dense_1's kernel and bias
    step = pockjax.compile(_variables_step(model, tx), scheme=scheme, donate=False)
    with_full = step(variables, full_state, x, y)
    with_sparse = step(variables, sparse, x, y)
    for a, b in zip(jax.tree.leaves(with_full[0]), jax.tree.leaves(with_sparse[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bare = pockjax.init_opt_state(tx, variables["params"], pockjax.UpdateScheme({"Dense_1.*": "full"}))
    with pytest.raises(pockjax.StepSignatureError, match="prefix='params'"):
        step(variables, bare, x, y)
    # the step's scheme without the prefix: its patterns match nothing, and the error says why
    with pytest.raises(pockjax.UnmatchedPatternError, match=r"(?s)'params.Dense_1.\*' matches no parameter.*"
                                                            r"prefix='params'"):
        pockjax.init_opt_state(tx, variables["params"], scheme)


def test_scheme_naming_model_state_is_an_error():
    model, tx = _BNNet(), optax.sgd(0.1)
    step = pockjax.compile(_variables_step(model, tx), scheme=pockjax.UpdateScheme({"batch_stats.**": "full"}))
    with pytest.raises(pockjax.SchemeError, match="without a gradient"):
        step(*_variables_args(model, tx))


def test_non_array_leaf_is_named():
    tx = optax.sgd(0.1)
    params, opt_state, x = _mlp_args(tx)
    params = dict(params, name="mlp")
    step = pockjax.compile(_mlp_step(tx), scheme=pockjax.UpdateScheme({"b": "full"}))
    with pytest.raises(pockjax.StepSignatureError, match="my_train_step: input leaf 'name' is a str"):
        step(params, opt_state, x)


def test_wrong_output_structure_names_the_users_function():
    def broken_step(params, opt_state, x):
        return params, x.sum()

    tx = optax.sgd(0.1)
    step = pockjax.compile(broken_step, scheme=pockjax.UpdateScheme({"b": "full"}))
    with pytest.raises(pockjax.StepSignatureError, match="broken_step"):
        step(*_mlp_args(tx))


# -- TrainState ----------------------------------------------------------------------
class _TS(train_state.TrainState):
    batch_stats: dict


def _train_state_step(state, x, y):
    def loss_fn(p):
        out, upd = state.apply_fn({"params": p, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"])
        return jnp.mean((out - y) ** 2), upd

    (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=upd["batch_stats"])
    return state, loss


def test_train_state_with_batch_stats_and_sparse_opt_state():
    model, tx = _BNNet(), optax.adam(1e-2)
    variables, _, x, y = _variables_args(model, tx)
    scheme = pockjax.UpdateScheme({"Dense_1.*": "full"})
    full_state = _TS.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                            batch_stats=variables["batch_stats"])
    ref_state, ref_loss = jax.jit(_train_state_step)(full_state, x, y)
    sparse = pockjax.init_opt_state(tx, variables["params"], scheme)
    state = full_state.replace(opt_state=sparse)
    step = pockjax.compile(_train_state_step, scheme=scheme)
    new_state, loss = step(state, x, y)
    assert isinstance(new_state.opt_state, pockjax.SparseOptState)
    assert new_state.opt_state.nbytes < sum(np.asarray(v).nbytes for v in jax.tree.leaves(full_state.opt_state))
    assert int(new_state.step) == 1
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(new_state.params["Dense_1"]["kernel"], ref_state.params["Dense_1"]["kernel"], atol=1e-6)
    np.testing.assert_array_equal(new_state.params["Dense_0"]["kernel"], variables["params"]["Dense_0"]["kernel"])
    np.testing.assert_allclose(new_state.batch_stats["BatchNorm_0"]["var"],
                               ref_state.batch_stats["BatchNorm_0"]["var"], atol=1e-6)


# -- NNX -------------------------------------------------------------------------------
class _DropNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x))))


@pytest.mark.parametrize("target", [None, pytest.param("cpu", marks=pytest.mark.iree)])
def test_nnx_dropout_keys_and_optimizer_state_only_for_trained_leaves(target):
    scheme = pockjax.UpdateScheme({"l2.*": "full"})
    x, y = jnp.ones((3, 4)), jnp.zeros((3, 1))

    def fresh():
        model = _DropNet(nnx.Rngs(0, dropout=1))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=scheme.nnx_wrt())

    model, optimizer = fresh()
    state_paths = pockjax.leaf_paths(nnx.state(optimizer.opt_state))
    assert not any("l1" in p for p in state_paths) and any("l2" in p for p in state_paths)
    ref = [float(nnx.jit(nnx_mse_step)(model, optimizer, x, y)) for _ in range(3)]
    model, optimizer = fresh()
    l1_before = np.asarray(model.l1.kernel[...])
    step = pockjax.compile(nnx_mse_step, scheme=scheme, target=target)
    got = [float(step(model, optimizer, x, y)) for _ in range(3)]
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    np.testing.assert_array_equal(model.l1.kernel[...], l1_before)


# -- scanned layers ----------------------------------------------------------------------
L, D = 8, 32


def _scanned_loss(remat):
    def loss_fn(p, x):
        def body(h, w):
            return jnp.tanh(h @ w["kernel"] + w["bias"]), None

        h, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, x @ p["embed"], p["layers"])
        return jnp.mean((h @ p["head"]) ** 2)

    return loss_fn


def _step_from_loss(loss_fn, tx, grad_hook=lambda g: g):
    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        updates, opt_state = tx.update(grad_hook(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@pytest.mark.parametrize("remat", [False, True])
def test_last_two_of_eight_scanned_layers_prune_the_frozen_iterations(remat):
    tx = optax.adam(1e-2)
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "embed": jax.random.normal(k[0], (D, D)) * 0.1,
        "layers": {"kernel": jax.random.normal(k[1], (L, D, D)) * 0.1, "bias": jnp.zeros((L, D))},
        "head": jax.random.normal(k[2], (D, 1)),
    }
    x = jax.random.normal(k[3], (16, D))
    args = (params, tx.init(params), x)
    step = _step_from_loss(_scanned_loss(remat), tx)
    last_two = pockjax.UpdateScheme({"layers.*": pockjax.channels(indices=[-2, -1], axis=0)})
    full = pockjax.compile(step, scheme=pockjax.UpdateScheme.full(), donate=False)
    sparse = pockjax.compile(step, scheme=last_two, donate=False)
    f_full = pockjax.count_flops(full.lower(*args).graph, matmul_only=True)
    f_sparse = pockjax.count_flops(sparse.lower(*args).graph, matmul_only=True)
    print(f"scanned step matmul FLOPs (remat={remat}): full {f_full:.0f}, last 2 of 8 {f_sparse:.0f}, "
          f"cut {1 - f_sparse / f_full:.1%}")
    assert f_sparse <= 0.70 * f_full
    lengths = sorted(e.params["length"] for e in sparse.lower(*args).graph.jaxpr.eqns if e.primitive is C.scan_p)
    assert lengths == [2, L]  # the backward scan runs over the two trained layers only

    # values: the full step with the gradients of frozen entries zeroed
    trained_rows = (jnp.arange(L) >= L - 2).astype(jnp.float32)

    def mask(grads):
        rows = lambda g: g * trained_rows.reshape((L,) + (1,) * (g.ndim - 1))  # noqa: E731
        return {"embed": grads["embed"] * 0, "head": grads["head"] * 0, "layers": jax.tree.map(rows, grads["layers"])}

    ref = jax.jit(_step_from_loss(_scanned_loss(remat), tx, mask))(*args)
    out = sparse(*args)
    np.testing.assert_allclose(out[0]["layers"]["kernel"][-2:], ref[0]["layers"]["kernel"][-2:], atol=1e-5)
    np.testing.assert_array_equal(out[0]["layers"]["kernel"][:-2], params["layers"]["kernel"][:-2])
    np.testing.assert_array_equal(out[1][0].mu["layers"]["kernel"][:-2], args[1][0].mu["layers"]["kernel"][:-2])
    np.testing.assert_array_equal(out[0]["embed"], params["embed"])
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-6)


@pytest.mark.slow
def test_paper_scheme_on_stacked_llama_blocks_prunes_like_unrolled():
    from pockjax.models import llama
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import lm_train_step
    from flax import nnx as _nnx

    cfg = llama.LlamaConfig.tiny().replace(n_layers=8)
    unrolled = llama.Llama(cfg, rngs=_nnx.Rngs(0))
    tx = optax.adam(1e-3)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab)
    losses, cuts = [], []
    for model in (unrolled, llama.stack_layers(unrolled)):
        graphdef, params = llama.split(model)
        step = lm_train_step(graphdef, tx)
        args = (params, tx.init(params), tokens, tokens, jnp.ones((2, 16)))
        full = pockjax.compile(step, scheme=pockjax.UpdateScheme.full(), donate=False).lower(*args)
        sparse = pockjax.compile(step, scheme=llama_scheme("paper", model.config, blocks=2), donate=False)
        f_full = pockjax.count_flops(full.graph, matmul_only=True)
        f_sparse = pockjax.count_flops(sparse.lower(*args).graph, matmul_only=True)
        cuts.append(1 - f_sparse / f_full)
        losses.append(float(sparse(*args)[2]))
    print(f"paper scheme, last 2 of 8 blocks: matmul FLOPs cut unrolled {cuts[0]:.1%}, stacked {cuts[1]:.1%}")
    assert cuts[1] >= 0.45 and cuts[1] >= cuts[0] - 0.03
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)

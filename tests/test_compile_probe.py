"""Adversarial steps probing ``pockjax.compile`` against ``jax.jit`` / ``nnx.jit``.

Each test pins a case where a compiled step could differ from the reference
without a word (most of them did, before their fix): it must match or refuse
clearly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 6, rngs=rngs)
        self.l2 = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _nnx_metrics_step(model, optimizer, metrics, x, y):
    """The Flax NNX tutorial's step: it updates a ``MultiMetric`` in place."""
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)
    return loss


def _nnx_rngs_step(model, optimizer, rngs, x, y):
    """Draws noise from an ``nnx.Rngs`` argument, which advances its count in place."""
    noisy = x + 0.1 * rngs.noise.normal(x.shape)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(noisy) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def _weights(model):
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {jax.tree_util.keystr(k, simple=True, separator="."): np.asarray(v) for k, v in flat}


@pytest.mark.parametrize("scheme,target", [(None, None), (pockjax.UpdateScheme({"l2.*": "full"}), None),
                                           pytest.param(None, "cpu", marks=pytest.mark.iree)])
def test_nnx_metrics_argument_is_updated_in_place_as_nnx_jit_does(scheme, target):
    # a compiled step used to return the loss and leave the metrics object at
    # count 0 (its average NaN) without a word; then it refused it; now it
    # carries the metrics as state, as nnx.jit does. On an IREE target the
    # updated variables get JAX arrays (not device buffers): the model and
    # metrics are then used by any JAX code, as after nnx.jit.
    x = jax.random.normal(jax.random.key(1), (5, 4))
    y = jax.random.normal(jax.random.key(2), (5, 3))
    runs = {}
    for name in ("nnx.jit", "pockjax"):
        model = _Net(nnx.Rngs(0))
        wrt = nnx.Param if scheme is None else scheme.nnx_wrt()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=wrt)
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
        if name == "nnx.jit":
            step = nnx.jit(_nnx_metrics_step)
        else:
            step = pockjax.compile(_nnx_metrics_step, scheme=scheme, target=target)
        losses = [float(step(model, optimizer, metrics, x, y)) for _ in range(3)]
        runs[name] = (losses, float(metrics.compute()["loss"]), int(metrics.loss.count[...]), _weights(model),
                      np.asarray(nnx.jit(lambda m, v: m(v))(model, x)))  # the trained model in other JAX code
        metrics.reset()  # the tutorial's loop: compute, then reset
        assert int(metrics.loss.count[...]) == 0
    (ref_l, ref_mean, ref_count, ref_w, ref_out), (l, mean, count, w, out) = runs["nnx.jit"], runs["pockjax"]
    assert count == ref_count == 3
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)  # the trained model, called eagerly
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-6)
    np.testing.assert_allclose(mean, np.mean(ref_l), rtol=1e-6)
    np.testing.assert_allclose(l, ref_l, rtol=1e-6)
    for k in ref_w:
        np.testing.assert_allclose(w[k], ref_w[k], rtol=1e-5, atol=1e-7, err_msg=k)
    init = _weights(_Net(nnx.Rngs(0)))
    assert not np.array_equal(w["l2.kernel.value"], init["l2.kernel.value"])  # it trained
    if scheme is not None:  # and the scheme's freezing still holds
        np.testing.assert_array_equal(w["l1.kernel.value"], init["l1.kernel.value"])


def test_nnx_rngs_argument_advances_as_under_nnx_jit():
    x = jax.random.normal(jax.random.key(1), (5, 4))
    y = jax.random.normal(jax.random.key(2), (5, 3))
    runs = {}
    for name, wrap in (("nnx.jit", nnx.jit), ("pockjax", pockjax.compile)):
        model = _Net(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        rngs = nnx.Rngs(noise=7)
        step = wrap(_nnx_rngs_step)
        losses = [float(step(model, optimizer, rngs, x, y)) for _ in range(3)]
        runs[name] = (losses, int(rngs.noise.count[...]), _weights(model))
    assert runs["pockjax"][1] == runs["nnx.jit"][1] == 3  # three draws: a fresh noise each step
    np.testing.assert_allclose(runs["pockjax"][0], runs["nnx.jit"][0], rtol=1e-6)
    assert len(set(runs["pockjax"][0])) == 3
    for k, v in runs["nnx.jit"][2].items():
        np.testing.assert_allclose(runs["pockjax"][2][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_nnx_object_nested_in_an_nnx_steps_argument_is_refused():
    def step(model, optimizer, extras, x, y):
        loss = _nnx_metrics_step(model, optimizer, extras["metrics"], x, y)
        return loss

    model = _Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    extras = {"metrics": nnx.MultiMetric(loss=nnx.metrics.Average("loss"))}
    with pytest.raises(pockjax.PockjaxError, match=r"argument 2 holds an NNX object \(MultiMetric\) inside a dict"
                                                 r".*Pass it as an argument of its own"):
        pockjax.compile(step)(model, optimizer, extras, jnp.ones((5, 4)), jnp.zeros((5, 3)))


def test_nnx_object_in_a_functional_steps_batch_is_refused():
    tx = optax.sgd(0.1)

    def step(params, opt_state, rngs, x):
        noise = rngs.dropout.normal(x.shape)  # advances rngs' count in place
        loss, g = jax.value_and_grad(lambda p: jnp.sum((x + noise) @ p["w"]))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": jnp.ones((3, 2))}
    compiled = pockjax.compile(step)
    with pytest.raises(pockjax.PockjaxError, match=r"argument 2 holds an NNX object \(Rngs\)"):
        compiled(params, tx.init(params), nnx.Rngs(dropout=0), jnp.ones((4, 3)))


def test_a_pattern_shadowed_by_an_earlier_one_names_the_earlier_pattern():
    # {"a.*": full, "a.w": frozen} never freezes a.w (the first match wins); the
    # refusal used to say "'a.w' matches no parameter; closest paths: ['a.w', ...]"
    scheme = pockjax.UpdateScheme({"a.*": "full", "a.w": "frozen"})
    with pytest.raises(pockjax.UnmatchedPatternError) as err:
        scheme.resolve(["a.w", "a.b", "c.w"], [(4, 6), (6,), (6, 3)])
    assert "'a.w' matches ['a.w'], but an earlier pattern ('a.*') rules each of them" in str(err.value)
    assert "matches no parameter" not in str(err.value)


def test_gradient_taken_inside_a_scan_is_zeroed_for_a_frozen_parameter_under_global_norm_clipping():
    """``jax.grad`` inside a ``lax.scan`` body, over parameters closed over from
    outside (gradient accumulation): the frozen parameter's gradient does not
    enter ``clip_by_global_norm``, as with jax.jit of the step with that gradient
    zeroed; without the freezing the trained parameter would move differently."""
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5))

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["a"] @ p["b"]) ** 2)

    def make(freeze_b):
        def step(p, s, xs):
            def body(acc, x):
                return jax.tree.map(jnp.add, acc, jax.grad(loss)(p, x)), None
            g, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), xs)
            if freeze_b:
                g = {"a": g["a"], "b": jnp.zeros_like(g["b"])}
            u, s = tx.update(g, s, p)
            new = optax.apply_updates(p, u)
            return ({"a": new["a"], "b": p["b"]} if freeze_b else new), s, None
        return step

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {"a": jax.random.normal(k[0], (4, 4)), "b": 3 * jax.random.normal(k[1], (4, 4))}
    xs = jax.random.normal(k[2], (3, 2, 4))
    f = pockjax.compile(make(False), scheme=pockjax.UpdateScheme({"a": "full", "b": "frozen"}))
    got = f(jax.tree.map(jnp.array, p), tx.init(p), xs)[0]
    want = jax.jit(make(True))(p, tx.init(p), xs)[0]
    unfrozen = jax.jit(make(False))(p, tx.init(p), xs)[0]
    np.testing.assert_allclose(got["a"], want["a"], rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(unfrozen["a"] - want["a"]))) > 1e-4  # the case tells the two apart
    np.testing.assert_array_equal(got["b"], p["b"])


_TX = optax.adam(1e-2)


def _nnx_model_with_optax_state(model, opt_state, x, y, freeze=()):
    """An NNX model with a functional Optax state the step returns (no nnx.Optimizer)."""
    params = nnx.state(model, nnx.Param)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    for name in freeze:  # the reference for a scheme that freezes these: a zero gradient, so no Adam update
        grads[name] = jax.tree.map(jnp.zeros_like, grads[name])
    updates, opt_state = _TX.update(grads, opt_state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    return opt_state, loss


def _nnx_model_only(model, x, y):
    """An NNX model updated by hand (plain SGD), no optimizer argument at all."""
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return loss


@pytest.mark.parametrize("frozen", [False, True])
def test_nnx_model_with_a_functional_optax_state_matches_nnx_jit(frozen):
    # the step's second argument is an Optax state, not an nnx.Optimizer: it used to
    # fail with "'ArrayImpl' object has no attribute 'get_raw_value'"
    x = jax.random.normal(jax.random.key(1), (5, 4))
    y = jax.random.normal(jax.random.key(2), (5, 3))
    scheme = pockjax.UpdateScheme({"l2.*": "full"}) if frozen else None
    runs = {}
    for name in ("nnx.jit", "pockjax"):
        model = _Net(nnx.Rngs(0))
        opt_state = _TX.init(nnx.state(model, nnx.Param))
        if name == "nnx.jit":
            step = nnx.jit(functools.partial(_nnx_model_with_optax_state, freeze=("l1",) if frozen else ()))
        else:
            step = pockjax.compile(_nnx_model_with_optax_state, scheme=scheme)
        losses = []
        for _ in range(3):
            opt_state, loss = step(model, opt_state, x, y)
            losses.append(float(loss))
        runs[name] = (losses, _weights(model))
    np.testing.assert_allclose(runs["pockjax"][0], runs["nnx.jit"][0], rtol=1e-6)
    init = _weights(_Net(nnx.Rngs(0)))
    for k, v in runs["nnx.jit"][1].items():
        np.testing.assert_allclose(runs["pockjax"][1][k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    assert not np.array_equal(runs["pockjax"][1]["l2.kernel.value"], init["l2.kernel.value"])
    if frozen:
        np.testing.assert_array_equal(runs["pockjax"][1]["l1.kernel.value"], init["l1.kernel.value"])


def test_nnx_model_without_an_optimizer_argument_matches_nnx_jit():
    x = jax.random.normal(jax.random.key(1), (5, 4))
    y = jax.random.normal(jax.random.key(2), (5, 3))
    runs = {}
    for name, wrap in (("nnx.jit", nnx.jit), ("pockjax", pockjax.compile)):
        model = _Net(nnx.Rngs(0))
        step = wrap(_nnx_model_only)
        runs[name] = ([float(step(model, x, y)) for _ in range(3)], _weights(model))
    np.testing.assert_allclose(runs["pockjax"][0], runs["nnx.jit"][0], rtol=1e-6)
    assert runs["pockjax"][0][2] < runs["pockjax"][0][0]
    for k, v in runs["nnx.jit"][1].items():
        np.testing.assert_allclose(runs["pockjax"][1][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


# -- optimizer state that only looks like a parameter's ----------------------------------------


def test_a_counter_beside_adam_is_not_taken_for_a_frozen_parameters_state():
    # params (w, temperature), opt_state (adam state, step counter): the counter's
    # path "1" and shape () equal the frozen temperature's, and it used to be
    # paired with it and reset to 0 every step (jax.jit counts 3)
    tx = optax.adam(1e-2)

    def step(params, opt_state, x, y):
        tx_state, n = opt_state
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p[0] * p[1] - y) ** 2))(params)
        u, tx_state = tx.update(g, tx_state, params)
        return optax.apply_updates(params, u), (tx_state, n + 1), loss

    params = (jnp.ones((4, 3)), jnp.float32(1.0))
    compiled = pockjax.compile(step, scheme=pockjax.UpdateScheme({"0": "full"}))
    state = (tx.init(params), jnp.int32(0))
    for _ in range(3):
        params, state, _ = compiled(params, state, jnp.ones((2, 4)), jnp.ones((2, 3)))
    assert int(state[1]) == 3
    assert float(params[1]) == 1.0  # the temperature stays frozen


def test_reduce_on_plateau_scale_is_not_taken_for_a_parameter_named_scale():
    tx = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(factor=0.5, patience=1, rtol=1.0))

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] * p["scale"] - y) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params, value=loss)
        return optax.apply_updates(params, u), opt_state, loss

    def zeroed(params, opt_state, x, y):  # the reference: jax.jit with the frozen gradient zeroed
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] * p["scale"] - y) ** 2))(params)
        g = {**g, "scale": jnp.zeros_like(g["scale"])}
        u, opt_state = tx.update(g, opt_state, params, value=loss)
        return optax.apply_updates(params, u), opt_state, loss

    x, y = jnp.ones((2, 4)), jnp.ones((2, 3))
    out = {}
    for name, fn in (("jit", jax.jit(zeroed)),
                     ("pockjax", pockjax.compile(step, scheme=pockjax.UpdateScheme({"w": "full"})))):
        p = {"w": jnp.ones((4, 3)), "scale": jnp.float32(1.0)}
        o = tx.init(p)
        for _ in range(4):
            p, o, _ = fn(p, o, x, y)
        out[name] = (float(o[1].scale), np.asarray(p["w"]))
    assert out["pockjax"][0] == out["jit"][0] < 1.0  # the plateau scale halves, as under jit
    np.testing.assert_allclose(out["pockjax"][1], out["jit"][1], rtol=1e-6)


# -- gradients pockjax cannot see --------------------------------------------------------------


def _cast_step(tx, cast):
    def step(params, opt_state, x, y):
        low = {**params, "w": cast(params["w"])}  # b enters the gradient as itself
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(low)
        g = jax.tree.map(lambda a, p: a.astype(p.dtype), g, params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss
    return step


@pytest.mark.parametrize("cast", [
    pytest.param(lambda a: a.astype(jnp.bfloat16), id="astype"),
    pytest.param(lambda a: a.reshape(-1).reshape(a.shape), id="ravelled"),
])
def test_a_gradient_taken_of_a_value_computed_from_a_parameter_is_refused_under_a_scheme(cast):
    # the gradient of p.astype(bf16): pockjax saw no gradient of 'w' and updated it as model
    # state, so the scheme's default (frozen) did not freeze it, silently
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,), jnp.bfloat16)}
    step = pockjax.compile(_cast_step(tx, cast), scheme=pockjax.UpdateScheme({"b": "full"}))
    with pytest.raises(pockjax.SchemeError, match=r"changes the parameter\(s\) 'w', which the scheme does not train in full, but takes no gradient"
                                                  r".*do the cast inside the loss"):
        step(params, tx.init(params), jnp.ones((2, 4)), jnp.ones((2, 3)))


def test_the_same_step_casting_inside_the_loss_freezes_as_the_scheme_says():
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
            return jnp.mean(((x @ p["w"] + p["b"]).astype(jnp.float32) - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    compiled = pockjax.compile(step, scheme=pockjax.UpdateScheme({"b": "full"}))
    new, _, _ = compiled(jax.tree.map(jnp.copy, params), tx.init(params), jnp.ones((2, 4)), jnp.ones((2, 3)))
    np.testing.assert_array_equal(new["w"], params["w"])
    assert not np.array_equal(new["b"], params["b"])


def test_updates_carried_through_a_scan_are_refused_under_a_scheme_and_match_jit_without():
    tx = optax.sgd(0.1)

    def step(params, opt_state, xs):
        def body(carry, x):
            p, s = carry
            loss, g = jax.value_and_grad(lambda q: jnp.sum((x @ q["a"] + q["b"]) ** 2))(p)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss
        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), xs)
        return params, opt_state, losses

    params = {"a": jnp.ones((3, 2)) * 0.1, "b": jnp.zeros((2,))}
    xs = jnp.ones((2, 4, 3))
    with pytest.raises(pockjax.SchemeError, match=r"differentiates none of its parameters.*inside a lax.scan"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"b": "full"}))(params, tx.init(params), xs)
    ref = jax.jit(step)(params, tx.init(params), xs)
    got = pockjax.compile(step)(jax.tree.map(jnp.copy, params), tx.init(params), xs)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, r, rtol=1e-6)


# -- clear errors at the call ------------------------------------------------------------------


def test_one_array_passed_as_two_donated_leaves_names_both_and_donate_false_runs():
    tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)

    def step(lp, opt_state, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(lp.fast)
        u, opt_state = tx.update(g, opt_state, lp)
        return optax.apply_updates(lp, u), opt_state, loss

    params = optax.LookaheadParams.init_synced({"w": jnp.ones((4, 3))})  # fast and slow: one array
    x, y = jnp.ones((2, 4)), jnp.zeros((2, 3))
    with pytest.raises(pockjax.StepSignatureError, match=r"the same array is passed as args\[0\]\.fast\['w'\] and"
                                                         r" args\[0\]\.slow\['w'\].*donate=False"):
        pockjax.compile(step)(params, tx.init(params), x, y)
    ref = jax.jit(step)(params, tx.init(params), x, y)
    got = pockjax.compile(step, donate=False)(params, tx.init(params), x, y)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, r, rtol=1e-6)


@pytest.mark.parametrize("frozen_read", [False, True])
def test_one_array_as_a_trained_and_a_frozen_leaf_is_refused_before_the_call(frozen_read):
    # a frozen leaf the step only hands back came back as the donated, deleted array, without a
    # word; one the loss reads gave XLA's raw "previously donated in the same call"
    tx = optax.sgd(0.1)
    w = jnp.ones((4, 3))
    params = {"a": w, "b": w}

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda q: jnp.sum(x @ q["a"] + (x @ q["b"] if frozen_read else 0.0)))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    with pytest.raises(pockjax.StepSignatureError, match=r"the same array is passed as args\[0\]\['a'\] and"
                                                         r" args\[0\]\['b'\]"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"a": "full"}))(params, tx.init(params), jnp.ones((2, 4)))
    assert not w.is_deleted()  # refused before anything was donated


def test_a_bad_argument_after_a_compiled_call_gets_the_same_clear_error_and_keywords_are_refused():
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, y, mode=None):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p - y) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    x, y = jnp.ones((2, 4)), jnp.zeros((2, 3))
    compiled = pockjax.compile(step)
    compiled(jnp.ones((4, 3)), tx.init(jnp.ones((4, 3))), x, y)  # the fast path exists now
    with pytest.raises(pockjax.StepSignatureError, match=r"input leaf 'batch2' is a str"):
        compiled(jnp.ones((4, 3)), tx.init(jnp.ones((4, 3))), x, y, "mae")
    with pytest.raises(pockjax.StepSignatureError, match=r"takes its arguments by position, got keyword argument\(s\) mode"):
        compiled(jnp.ones((4, 3)), tx.init(jnp.ones((4, 3))), x, y, mode=jnp.ones(()))


@pytest.mark.parametrize("trained", [("l1.*",), ("l1.*", "l2.*")])
def test_a_scheme_training_what_the_nnx_optimizer_leaves_out_is_refused(trained):
    # the optimizer (wrt) holds only l2; the scheme trains l1 (and l2): l1 never moved, without a word
    model = _Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=pockjax.UpdateScheme({"l2.*": "full"}).nnx_wrt())
    scheme = pockjax.UpdateScheme({p: "full" for p in trained})
    step = pockjax.compile(_nnx_metrics_step, scheme=scheme)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    with pytest.raises(pockjax.SchemeError, match=r"trains 'l1.bias', 'l1.kernel', but _nnx_metrics_step returns them"
                                                  r" unchanged.*wrt=scheme.nnx_wrt\(\)"):
        step(model, optimizer, metrics, jnp.ones((5, 4)), jnp.zeros((5, 3)))


# -- a review's findings -----------------------------------------------------------------------


def _two_towers_step(a, opt_a, b, opt_b, x, y, zero_a_l1=False):
    la, ga = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(a)
    if zero_a_l1:  # the reference for a scheme that freezes a.l1
        ga["l1"] = jax.tree.map(jnp.zeros_like, ga["l1"])
    opt_a.update(a, ga)
    lb, gb = nnx.value_and_grad(lambda m: jnp.mean((m(x) + y) ** 2))(b)
    opt_b.update(b, gb)
    return la + lb


def test_a_second_models_optimizer_is_not_paired_with_the_first_models_parameters():
    # opt_b's mu.l1.kernel was taken for the state of a's (frozen) l1.kernel and put back every step
    x = jax.random.normal(jax.random.key(1), (5, 4))
    y = jax.random.normal(jax.random.key(2), (5, 3))

    def make():
        a, b = _Net(nnx.Rngs(0)), _Net(nnx.Rngs(1))
        return a, nnx.Optimizer(a, optax.adam(1e-2), wrt=nnx.Param), b, nnx.Optimizer(b, optax.adam(1e-2), wrt=nnx.Param)

    ref = make()
    jitted = nnx.jit(functools.partial(_two_towers_step, zero_a_l1=True))
    got = make()
    compiled = pockjax.compile(_two_towers_step, scheme=pockjax.UpdateScheme({"l2.*": "full"}))
    for _ in range(4):
        jitted(*ref, x, y)
        compiled(*got, x, y)
    for r, g in zip(jax.tree.leaves(nnx.state(ref[2:])), jax.tree.leaves(nnx.state(got[2:]))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)
    for r, g in zip(jax.tree.leaves(nnx.state(ref[0], nnx.Param)), jax.tree.leaves(nnx.state(got[0], nnx.Param))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)


def test_a_bare_nnx_variable_argument_is_updated_in_place():
    def step(model, optimizer, scale, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) * scale[...] - y) ** 2))(model)
        optimizer.update(model, grads)
        scale[...] = scale[...] * 0.5
        return loss

    out = {}
    for name, wrap in (("nnx.jit", nnx.jit), ("pockjax", pockjax.compile)):
        model = _Net(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        scale = nnx.Variable(jnp.float32(1.0))
        losses = [float(wrap(step)(model, optimizer, scale, jnp.ones((5, 4)), jnp.zeros((5, 3)))) for _ in range(3)]
        out[name] = (losses, float(scale[...]))
    assert out["pockjax"][1] == out["nnx.jit"][1] == 0.125
    np.testing.assert_allclose(out["pockjax"][0], out["nnx.jit"][0], rtol=1e-6)


def test_lookahead_slow_weights_and_an_ema_stay_model_state_under_a_scheme():
    # weights updated without any gradient are not refused as hidden gradients
    tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    x, y = jnp.ones((2, 4)), jnp.zeros((2, 3))

    def step(lp, opt_state, x, y, zero_b=False):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(lp.fast)
        if zero_b:
            g = {**g, "b": jnp.zeros_like(g["b"])}
        u, opt_state = tx.update(g, opt_state, lp)
        new = optax.apply_updates(lp, u)
        if zero_b:  # the reference: the frozen entries put back
            new = optax.LookaheadParams({**new.fast, "b": lp.fast["b"]}, {**new.slow, "b": lp.slow["b"]})
        return new, opt_state, loss

    def fresh():
        p = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
        return optax.LookaheadParams(p, jax.tree.map(jnp.copy, p))

    ref, got = fresh(), fresh()
    ro, go = tx.init(ref), tx.init(got)
    compiled = pockjax.compile(step, scheme=pockjax.UpdateScheme({"fast.w": "full"}))
    jitted = jax.jit(functools.partial(step, zero_b=True))
    for _ in range(4):
        ref, ro, _ = jitted(ref, ro, x, y)
        got, go, _ = compiled(got, go, x, y)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, r, rtol=1e-6)
    assert not np.array_equal(got.slow["w"], fresh().slow["w"])  # the slow weights moved


def test_the_mirror_counts_parameters_the_step_does_not_differentiate():
    # a head-only gradient over an optimizer state made for all params: the frozen head.b's
    # Adam state must still be recognised (and kept), though enc.w is never differentiated
    tx = optax.adam(1e-2)

    def step(params, opt_state, x, y):
        loss, gh = jax.value_and_grad(lambda h: jnp.mean((x @ params["enc"]["w"] @ h["w"] + h["b"] - y) ** 2))(params["head"])
        g = {"enc": jax.tree.map(jnp.zeros_like, params["enc"]), "head": gh}
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = {"enc": {"w": jnp.ones((4, 4))}, "head": {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}}
    compiled = pockjax.compile(step, scheme=pockjax.UpdateScheme({"head.w": "full"}))
    traced = compiled.lower(params, tx.init(params), jnp.ones((2, 4)), jnp.zeros((2, 3))).traced
    paired = {traced.in_paths[i]: traced.in_paths[p] for i, p in enumerate(traced.param_of) if p is not None}
    # enc.w, updated by the optimizer from its own state (a zero gradient), is a parameter too
    assert paired == {"opt_state.0.mu.head.b": "head.b", "opt_state.0.mu.head.w": "head.w",
                      "opt_state.0.nu.head.b": "head.b", "opt_state.0.nu.head.w": "head.w",
                      "opt_state.0.mu.enc.w": "enc.w", "opt_state.0.nu.enc.w": "enc.w"}


def test_a_sparse_opt_state_in_an_nnx_step_is_refused():
    tx = optax.adam(1e-2)
    scheme = pockjax.UpdateScheme({"l2.*": "full"})

    def step(model, opt_state, x, y):
        params = nnx.state(model, nnx.Param)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        u, opt_state = tx.update(grads, opt_state, params)
        nnx.update(model, optax.apply_updates(params, u))
        return opt_state, loss

    model = _Net(nnx.Rngs(0))
    sparse = pockjax.init_opt_state(tx, nnx.state(model, nnx.Param), scheme)
    with pytest.raises(pockjax.StepSignatureError, match=r"a SparseOptState .* is an argument of an NNX step.*nnx_wrt"):
        pockjax.compile(step, scheme=scheme)(model, sparse, jnp.ones((5, 4)), jnp.zeros((5, 3)))


def test_a_sparse_state_for_other_passes_is_refused_in_a_short_message():
    # passes= built without sparse_opt_state=True read the full optimizer state: the
    # message said so by listing every leaf shape of both (tens of kilobytes for a LLaMA).
    params = {f"w{i}": jnp.ones((3, 3)) for i in range(40)}
    scheme = pockjax.UpdateScheme({"w0": "full"}, default="frozen")
    tx = optax.adam(1e-2)

    def step(p, s, x):
        g = jax.grad(lambda p: sum(jnp.sum(jnp.tanh(x @ w)) for w in p.values()))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    f = pockjax.compile(step, scheme=scheme, passes=pockjax.default_passes(scheme))
    with pytest.raises(pockjax.StepSignatureError) as err:
        f(params, pockjax.init_opt_state(tx, params, scheme), jnp.ones((2, 3)))
    text = str(err.value)
    assert "does not fit the step: it has 3 leaves, the step reads 81 (leaf 3 (opt_state.0.mu.w10) has shape none" in text
    assert "default_passes(scheme, sparse_opt_state=True)" in text and len(text) < 900
    ok = pockjax.compile(step, scheme=scheme, passes=pockjax.default_passes(scheme, sparse_opt_state=True))
    p, _ = ok(params, pockjax.init_opt_state(tx, params, scheme), jnp.ones((2, 3)))
    assert not np.array_equal(np.asarray(p["w0"]), np.ones((3, 3)))


# -- gradients taken at a value computed from the parameters ---------------------------
def _two_layer_loss(p, x, y, frozen: bool = False):
    """tanh(x @ enc) @ head against y; ``frozen``: the reference of a frozen 'enc', its gradient stopped."""
    enc = jax.lax.stop_gradient(p["enc"]) if frozen else p["enc"]
    return jnp.mean((jnp.tanh(x @ enc) @ p["head"] - y) ** 2)


def _sam_step(tx, shift_in_loss: bool, zero_frozen: bool = False):
    """Sharpness-aware minimization by hand: the update uses the gradient at ``p + rho * g / |g|``."""
    def zero(g):
        return {**g, "enc": jnp.zeros_like(g["enc"])} if zero_frozen else g

    def step(p, s, x, y):
        g1 = zero(jax.grad(_two_layer_loss)(p, x, y))
        shift = jax.tree.map(lambda g: 0.5 * g / optax.tree.norm(g1), g1)
        if shift_in_loss:  # the gradient at the parameters, the shift a constant inside the loss
            shift = jax.lax.stop_gradient(shift)
            g2 = jax.grad(lambda q: _two_layer_loss(jax.tree.map(jnp.add, q, shift), x, y))(p)
        else:  # the gradient at the perturbed point, a value computed from the parameters
            g2 = jax.grad(_two_layer_loss)(jax.tree.map(jnp.add, p, shift), x, y)
        u, s = _SAM_TX.update(zero(g2), s, p)
        return optax.apply_updates(p, u), s, optax.tree.norm(zero(g2))
    return step


_SAM_TX = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))


def _sam_data():
    k = jax.random.split(jax.random.key(0), 4)
    p = {"enc": jax.random.normal(k[0], (8, 16)), "head": jax.random.normal(k[1], (16, 3))}
    return p, jax.random.normal(k[2], (12, 8)) * 3, jax.random.normal(k[3], (12, 3)) * 20


def test_a_gradient_at_a_perturbed_point_is_refused_under_a_scheme():
    # SAM's second gradient is taken at p + rho * g / |g|: pockjax saw no gradient of the
    # parameters there, so the frozen entries of it were computed and counted in
    # clip_by_global_norm, and the trained 'head' moved by 0.03 more than under jax.jit
    # with 'enc' untrained (its global norm: 84.2 against 34.5). Now refused, with the fix.
    p, x, y = _sam_data()
    scheme = pockjax.UpdateScheme({"head": "full"})
    with pytest.raises(pockjax.SchemeError, match="gradient taken at a value computed from the parameters"
                       ".*stop_gradient"):
        pockjax.compile(_sam_step(_SAM_TX, False), scheme=scheme)(p, _SAM_TX.init(p), x, y)
    # the fix the message gives: the same SAM step, exactly jax.jit's with 'enc' untrained
    ref = jax.jit(_sam_step(_SAM_TX, True, zero_frozen=True))(jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    got = pockjax.compile(_sam_step(_SAM_TX, True), scheme=scheme)(jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    assert float(got[2]) == pytest.approx(float(ref[2]), rel=1e-6)
    np.testing.assert_allclose(np.asarray(got[0]["head"]), np.asarray(ref[0]["head"]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[0]["enc"]), np.asarray(p["enc"]))
    # without frozen parameters there is nothing to restrict: the perturbed-point step runs as under jit
    full = pockjax.compile(_sam_step(_SAM_TX, False), scheme=pockjax.UpdateScheme.full())
    out = full(jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    ref = jax.jit(_sam_step(_SAM_TX, False))(jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    np.testing.assert_allclose(np.asarray(out[0]["head"]), np.asarray(ref[0]["head"]), atol=1e-6)


def _fgsm(p, x, y):
    """An adversarial batch from the gradient of the input, then the gradient of the parameters."""
    gp, gx = jax.grad(_two_layer_loss, argnums=(0, 1))(p, x, y)
    return jax.value_and_grad(_two_layer_loss)(p, x + 0.1 * jnp.sign(gx), y)


def _gradient_penalty(p, x, y):
    def total(p):
        gx = jax.grad(lambda xx: jnp.sum(jnp.tanh(xx @ p["enc"]) @ p["head"]))(x)
        return _two_layer_loss(p, x, y) + 0.1 * jnp.mean(jnp.sum(gx ** 2, -1))
    return jax.value_and_grad(total)(p)


def _maml(p, x, y):
    def outer(p):
        g = jax.grad(_two_layer_loss)(p, x, y)
        return _two_layer_loss(jax.tree.map(lambda a, b: a - 0.1 * b, p, g), x, y)
    return jax.value_and_grad(outer)(p)


@pytest.mark.parametrize("grads", [_fgsm, _gradient_penalty, _maml], ids=["fgsm", "gradient-penalty", "maml"])
def test_other_backward_passes_are_not_taken_for_hidden_gradients(grads):
    # Backward passes that reach the parameters only through their tagged gradient (an
    # adversarial batch, a penalty on an input gradient, a gradient through an inner step)
    # compile as jax.jit computes them with the frozen gradients zeroed.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    p, x, y = _sam_data()
    scheme = pockjax.UpdateScheme({"head": "full"})

    def make(zero_frozen):
        def step(p, s, x, y):
            loss, g = grads(p, x, y)
            g = {**g, "enc": jnp.zeros_like(g["enc"])} if zero_frozen else g
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss
        return step

    ref_step, got_step = jax.jit(make(True)), pockjax.compile(make(False), scheme=scheme)
    rp, rs = jax.tree.map(jnp.copy, p), tx.init(p)
    gp, gs = jax.tree.map(jnp.copy, p), pockjax.init_opt_state(tx, p, scheme)
    for _ in range(3):
        rp, rs, rloss = ref_step(rp, rs, x, y)
        gp, gs, gloss = got_step(gp, gs, x, y)
        assert float(gloss) == pytest.approx(float(rloss), rel=1e-5)
    for a, b in zip(jax.tree.leaves(rp), jax.tree.leaves(gp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_an_nnx_jit_decorated_step_takes_a_scheme():
    # nnx.jit's own tracers hid the parameters from pockjax's gradient tags: with any scheme
    # the step was refused as one that "differentiates none of its parameters".
    def make(decorate):
        def step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, grads)
            return loss
        return nnx.jit(step) if decorate else step

    scheme = pockjax.UpdateScheme({"l2.*": "full"})
    x, y = jnp.ones((5, 4)), jnp.zeros((5, 3))
    losses, kernels = [], []
    for decorate in (True, False):
        model = _Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=scheme.nnx_wrt())
        step = pockjax.compile(make(decorate), scheme=scheme)
        losses.append([float(step(model, opt, x, y)) for _ in range(3)])
        kernels.append((np.asarray(model.l1.kernel[...]), np.asarray(model.l2.kernel[...])))
    assert losses[0] == losses[1] and losses[0][2] < losses[0][0]
    np.testing.assert_array_equal(kernels[0][1], kernels[1][1])
    np.testing.assert_array_equal(kernels[0][0], np.asarray(_Net(nnx.Rngs(0)).l1.kernel[...]))  # frozen


def test_a_factored_optimizer_state_cannot_be_kept_by_channel():
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    p = {"mid": jnp.ones((8, 16)), "head": jnp.ones((16, 3))}
    scheme = pockjax.UpdateScheme({"mid": pockjax.channels(4), "head": "full"})
    with pytest.raises(pockjax.SchemeError, match="optimizer state '0.v_row.mid' comes out of tx.init with shape"
                       " \\(4,\\).*needs \\(8,\\).*tx.init\\(params\\)"):
        pockjax.init_opt_state(tx, p, scheme)


def test_an_nnx_model_and_optimizer_keeps_the_models_paths():
    # nnx.ModelAndOptimizer holds the model under .model: its parameters were named
    # 'model.l2.kernel', so one scheme could not serve both nnx_wrt() and compile, and the
    # optimizer's state was model state, never pruned. Now the model's own paths and the
    # optimizer's state as optimizer state, as with step(model, optimizer, ...).
    if not hasattr(nnx, "ModelAndOptimizer"):
        pytest.skip("this Flax has no nnx.ModelAndOptimizer")  # pragma: no cover

    def step(optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(optimizer.model)
        optimizer.update(grads)
        return loss

    scheme = pockjax.UpdateScheme({"l2.*": "full"})
    x, y = jax.random.normal(jax.random.key(1), (5, 4)), jax.random.normal(jax.random.key(2), (5, 3))
    runs = []
    for compiled in (True, False):
        opt = nnx.ModelAndOptimizer(_Net(nnx.Rngs(0)), optax.adam(1e-2), wrt=scheme.nnx_wrt())
        f = pockjax.compile(step, scheme=scheme) if compiled else nnx.jit(step)
        runs.append(([float(f(opt, x, y)) for _ in range(3)], nnx.state(opt)))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    lowered = pockjax.compile(step, scheme=scheme)._nnx_lowered(nnx.ModelAndOptimizer(
        _Net(nnx.Rngs(0)), optax.adam(1e-2), wrt=scheme.nnx_wrt()), x, y)[0]
    params = [p for p, r in zip(lowered.traced.in_paths, lowered.traced.in_roles) if r == "param"]
    assert sorted(params) == ["l1.bias", "l1.kernel", "l2.bias", "l2.kernel"]
    assert any(r == "opt_state" for r in lowered.traced.in_roles)


@pytest.mark.parametrize("tx", [optax.adamw(1e-1, weight_decay=0.5),
                                optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1)),
                                optax.chain(optax.add_decayed_weights(0.5), optax.clip_by_global_norm(1.0),
                                            optax.sgd(0.1)),
                                # the update is made inside a cond (the skip test, the finite check)
                                optax.MultiSteps(optax.adamw(1e-1, weight_decay=0.5), 2),
                                optax.apply_if_finite(optax.adamw(1e-1, weight_decay=0.5), 3),
                                optax.apply_if_finite(optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1)), 3),
                                # L2 before momentum: its trace reads b and no gradient, yet is no average
                                optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1, momentum=0.9))],
                         ids=["adamw", "decay-sgd", "decay-clip-sgd", "multisteps-adamw", "if-finite-adamw",
                              "if-finite-decay-sgd", "l2-momentum"])
def test_a_frozen_parameter_the_loss_does_not_read_stays_frozen(tx):
    # Its gradient is a zero autodiff leaves untagged, so pockjax took it for model state:
    # AdamW's weight decay moved the frozen 'b' (1.0 -> 0.95 in a step), and the state of
    # pockjax.init_opt_state did not fit the step. It is a parameter (its own optimizer state
    # updates it; under a stateless optimizer, its decay alone, reading nothing but itself and
    # scalars): frozen, it stays; trained, it decays as under jax.jit.

    def step(params, opt_state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params = {"w": jnp.full((8, 8), 0.1), "b": jnp.ones((8, 4))}
    x = jnp.ones((2, 8))

    def reference(keep_b):  # jax.jit, a frozen 'b' put back after each step (its gradient is zero)
        p, s = jax.tree.map(jnp.copy, params), tx.init(params)
        for _ in range(2):
            p, s, _ = jax.jit(step)(p, s, x)
            p = {**p, "b": params["b"]} if keep_b else p
        return p

    trained, frozen = reference(False), reference(True)
    for rules, want in (({"w": "full"}, frozen), ({"w": "full", "b": "full"}, trained)):
        scheme = pockjax.UpdateScheme(rules)
        for state in (tx.init(params), pockjax.init_opt_state(tx, params, scheme)):
            p, s = jax.tree.map(jnp.copy, params), state
            f = pockjax.compile(step, scheme=scheme)
            for _ in range(2):
                p, s, _ = f(p, s, x)
            for k in ("w", "b"):
                np.testing.assert_allclose(np.asarray(p[k]), np.asarray(want[k]), atol=1e-6)
    assert float(trained["b"][0, 0]) < 0.995  # the check can tell: jit decays it


@pytest.mark.parametrize("tx", [optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1)),
                                optax.adamw(0.1, weight_decay=0.5)], ids=["decay-sgd", "adamw"])
def test_statistics_in_a_differentiated_tree_stay_model_state(tx):
    # The stateless-decay rule once took every scalar for a hyperparameter and any leaf that
    # read only itself for a decayed parameter: a loss average, a counter, a reset, an annealed
    # temperature (p * 0.9, also under AdamW) and statistics of the batch or of the new weights
    # turned into parameters, frozen by the scheme's default rule, and stopped updating
    # (temperature 2.0 against jax.jit's 1.458 after 3 steps). Only 'u', which the optimizer's
    # decay alone moves, is one.
    params = {"w": jnp.full((4, 4), 0.1), "u": jnp.ones((4,)), "loss_ema": jnp.ones(()), "count": jnp.zeros(()),
              "vcount": jnp.zeros((3,)), "acc": jnp.ones((2,)), "xscale": jnp.ones((4,)), "wstat": jnp.ones((4,)),
              "temp": jnp.full((5,), 2.0), "affine": jnp.full((5,), 2.0), "after": jnp.zeros((3,))}
    x = jnp.ones((2, 4)) * 1.5

    def step(params, s, x):
        loss, g = jax.value_and_grad(lambda q: jnp.sum(jnp.tanh(x @ q["w"])))(params)
        u, s = tx.update(g, s, params)
        new = optax.apply_updates(params, u)
        return {**new, "loss_ema": 0.9 * params["loss_ema"] + 0.1 * loss, "count": params["count"] + 1.0,
                "vcount": params["vcount"] + 1.0, "acc": jnp.zeros_like(params["acc"]),
                "xscale": params["xscale"] * jnp.mean(x ** 2),
                "wstat": 0.9 * params["wstat"] + 0.1 * jnp.abs(new["w"]).max(),
                "temp": params["temp"] * 0.9, "affine": params["affine"] * 0.9 + 1.0,
                "after": new["after"] + 1.0}, s  # a counter of the optimizer's output (read its AdamW state)

    traced = pockjax.trace_step(step, (params, tx.init(params), x))
    roles = {p: r for p, r in zip(traced.in_paths, traced.in_roles) if p in params}
    assert roles == {"w": "param", "u": "param", **{k: "model_state" for k in params if k not in ("w", "u")}}
    got = pockjax.compile(step, scheme=pockjax.UpdateScheme({"w": "full"}))(
        jax.tree.map(jnp.copy, params), tx.init(params), x)[0]
    ref = jax.jit(step)(jax.tree.map(jnp.copy, params), tx.init(params), x)[0]
    for k in params:
        want = params["u"] if k == "u" else ref[k]  # u: frozen by the scheme, kept
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want), atol=1e-7, err_msg=k)
    assert not np.array_equal(np.asarray(ref["u"]), np.asarray(params["u"]))  # jax.jit decays it


def test_sam_with_its_loss_under_jax_jit_is_refused_too():
    # inlining the loss's jit dropped the backward pass's name stack, and the second
    # gradient went unnoticed: 'head' ended 0.016 away from jax.jit with 'enc' untrained
    p, x, y = _sam_data()

    def step(p, s, x, y):
        loss = jax.jit(_two_layer_loss)
        g1 = jax.grad(loss)(p, x, y)
        g2 = jax.grad(loss)(jax.tree.map(lambda a, g: a + 0.5 * g / optax.tree.norm(g1), p, g1), x, y)
        u, s = _SAM_TX.update(g2, s, p)
        return optax.apply_updates(p, u), s

    with pytest.raises(pockjax.SchemeError, match="gradient taken at a value computed from the parameters"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"head": "full"}))(p, _SAM_TX.init(p), x, y)


def test_a_loss_at_an_adversarial_batch_may_drive_the_optimizer():
    # reduce_on_plateau reads the loss at x + eps * sign(grad_x): a value, not a gradient
    tx = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau())
    p, x, y = _sam_data()

    def step(p, s, x, y, zero_frozen=False):
        gx = jax.grad(_two_layer_loss, argnums=1)(p, x, y)
        loss, g = jax.value_and_grad(_two_layer_loss)(p, x + 0.1 * jnp.sign(gx), y)
        if zero_frozen:
            g = {**g, "enc": jnp.zeros_like(g["enc"])}
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s, loss

    got = pockjax.compile(step, scheme=pockjax.UpdateScheme({"head": "full"}))(
        jax.tree.map(jnp.copy, p), tx.init(p), x, y)
    ref = jax.jit(functools.partial(step, zero_frozen=True))(jax.tree.map(jnp.copy, p), tx.init(p), x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("tx", [optax.adamw(0.1), optax.apply_if_finite(optax.adamw(0.1), 3),
                                optax.chain(optax.adamw(0.1), optax.clip_by_global_norm(1.0)),
                                optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1))],
                         ids=["adamw", "apply_if_finite", "clip-after", "decay-sgd"])
@pytest.mark.parametrize("after_update", [False, True], ids=["from-old", "from-updated"])
def test_an_ema_in_the_params_stays_model_state_whatever_the_optimizer_couples(tx, after_update):
    # A reduction over all the updates (a global norm, a finiteness check) once carried every
    # leaf's state into every update, so the EMA looked updated by its own state: frozen. And an
    # EMA computed from the optimizer's own update of it (a zero gradient, then decay) read its
    # own AdamW state, was taken for a parameter and stopped updating (0.1 against jax.jit's 0.09).
    params = {"w": jnp.full((4, 4), 0.1), "ema": jnp.full((4, 4), 0.1)}
    x = jnp.ones((2, 4))

    def step(params, s, x):
        g = jax.grad(lambda q: jnp.sum(jnp.tanh(x @ q["w"])))(params)
        u, s = tx.update(g, s, params)
        new = optax.apply_updates(params, u)
        return {"w": new["w"], "ema": 0.9 * (new if after_update else params)["ema"] + 0.1 * new["w"]}, s

    traced = pockjax.trace_step(step, (params, tx.init(params), x))
    assert dict(zip(traced.in_paths[:2], traced.in_roles[:2])) == {"ema": "model_state", "w": "param"}
    got = pockjax.compile(step, scheme=pockjax.UpdateScheme({"w": "full"}))(
        jax.tree.map(jnp.copy, params), tx.init(params), x)[0]
    ref = jax.jit(step)(jax.tree.map(jnp.copy, params), tx.init(params), x)[0]
    np.testing.assert_allclose(np.asarray(got["ema"]), np.asarray(ref["ema"]), atol=1e-7)
    assert not np.array_equal(np.asarray(got["ema"]), np.asarray(params["ema"]))


def _per_example_step(tx, how, zero_a=False):
    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"] - y) ** 2)

    def step(params, opt_state, x, y):
        if how == "vmap":
            per = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
        else:  # jacrev of the per-example losses
            per = jax.jacrev(lambda p: jax.vmap(loss, in_axes=(None, 0, 0))(p, x[:, None], y[:, None]))(params)
        if zero_a:  # the reference: the frozen parameter's per-example gradients are zeros
            per = {**per, "a": jnp.zeros_like(per["a"])}
        # DP-SGD: each example's gradient clipped to norm 0.01, then averaged
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(per)))
        scale = jnp.minimum(1.0, 0.01 / norms)
        grads = jax.tree.map(lambda g: jnp.mean(g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), axis=0), per)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norms

    return step


@pytest.mark.parametrize("how", ["vmap", "jacrev"])
def test_per_example_gradients_of_a_frozen_parameter_are_zeros(how):
    # The gradient tag of jax.vmap(jax.grad) holds a batch axis, and pockjax took it for a tag
    # an earlier sparse_grad had sliced: the frozen 'a' kept its value, but its per-example
    # gradients counted in each example's clipping norm, as if it trained (b: 0.4999560 against
    # jax.jit's 0.4995670 with a's gradients zeroed).
    params = {"a": jnp.full((4, 3), 0.1), "b": jnp.full((3, 1), 0.5)}
    x = jnp.arange(16, dtype=jnp.float32).reshape(4, 4) / 10
    y = jnp.ones((4, 1))
    tx = optax.sgd(1.0)
    scheme = pockjax.UpdateScheme({"b": "full"})
    ref = jax.jit(_per_example_step(tx, how, zero_a=True))(jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    got = pockjax.compile(_per_example_step(tx, how), scheme=scheme)(
        jax.tree.map(jnp.copy, params), pockjax.init_opt_state(tx, params, scheme), x, y)
    unmasked = jax.jit(_per_example_step(tx, how))(jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    np.testing.assert_allclose(np.asarray(got[0]["b"]), np.asarray(ref[0]["b"]), atol=1e-7)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=1e-6)  # the per-example norms
    np.testing.assert_array_equal(np.asarray(got[0]["a"]), np.asarray(params["a"]))
    assert float(jnp.abs(unmasked[0]["b"] - ref[0]["b"]).max()) > 1e-5  # the check can tell


def test_a_channels_rule_on_per_example_gradients_is_refused():
    params = {"a": jnp.full((4, 3), 0.1), "b": jnp.full((3, 1), 0.5)}
    tx = optax.sgd(1.0)
    scheme = pockjax.UpdateScheme({"a": pockjax.channels(1), "b": "full"})
    with pytest.raises(pockjax.SchemeError, match=r"per-example gradients .* of 'a', which the scheme trains by a"
                                                  r" channels rule.*jax.lax.map"):
        pockjax.compile(_per_example_step(tx, "vmap"), scheme=scheme)(
            params, tx.init(params), jnp.ones((4, 4)), jnp.ones((4, 1)))


def test_state_donated_to_an_earlier_call_is_named():
    # XLA's "Invalid buffer passed to Execute() as argument 2" named a flat index and no fix
    tx = optax.adam(1e-2)

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"]))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    scheme = pockjax.UpdateScheme({"b": "full"})
    p, x = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 2))}, jnp.ones((2, 4))
    f = pockjax.compile(step, scheme=scheme)
    _, s1, _ = f(p, pockjax.init_opt_state(tx, p, scheme), x)
    with pytest.raises(pockjax.StepSignatureError, match=r"args\[0\]\['b'\] was donated to an earlier call of the"
                                                         r" compiled step.*pass the state that call returned"):
        f(p, s1, x)
    # a step that donates nothing does not blame itself
    q = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 2))}
    kept = pockjax.compile(step, scheme=scheme, donate=False)
    q["b"].delete()
    with pytest.raises(pockjax.StepSignatureError, match=r"args\[0\]\['b'\] was deleted before this call"):
        kept(q, pockjax.init_opt_state(tx, q, scheme), x)


def _sam_in_a_loop(kind: str, shift_in_loss: bool):
    """SAM with its gradients accumulated over two micro-batches in a lax.scan or fori_loop."""
    def sam_grad(p, x, y):
        g1 = jax.grad(_two_layer_loss)(p, x, y)
        shift = jax.tree.map(lambda g: 0.5 * g / optax.tree.norm(g1), g1)
        if shift_in_loss:
            shift = jax.lax.stop_gradient(shift)
            return jax.grad(lambda q: _two_layer_loss(jax.tree.map(jnp.add, q, shift), x, y))(p)
        return jax.grad(_two_layer_loss)(jax.tree.map(jnp.add, p, shift), x, y)

    def step(p, s, x, y):
        xs, ys = x.reshape(2, -1, x.shape[-1]), y.reshape(2, -1, y.shape[-1])
        zeros = jax.tree.map(jnp.zeros_like, p)
        if kind == "scan":
            g, _ = jax.lax.scan(lambda acc, b: (jax.tree.map(jnp.add, acc, sam_grad(p, *b)), None), zeros, (xs, ys))
        else:
            g = jax.lax.fori_loop(0, 2, lambda i, acc: jax.tree.map(jnp.add, acc, sam_grad(p, xs[i], ys[i])), zeros)
        u, s = _SAM_TX.update(g, s, p)
        return optax.apply_updates(p, u), s
    return step


@pytest.mark.parametrize("kind", ["scan", "fori_loop"])
def test_a_gradient_at_a_perturbed_point_inside_a_loop_is_refused(kind):
    # The loop counted as one equation, so SAM's second gradient inside it went unnoticed
    # (left open in the tenth session); the rewrite the message gives compiles and matches
    p, x, y = _sam_data()
    scheme = pockjax.UpdateScheme({"head": "full"})
    with pytest.raises(pockjax.SchemeError, match="gradient taken at a value computed from the parameters"):
        pockjax.compile(_sam_in_a_loop(kind, False), scheme=scheme)(jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    got = pockjax.compile(_sam_in_a_loop(kind, True), scheme=scheme)(jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    np.testing.assert_array_equal(np.asarray(got[0]["enc"]), np.asarray(p["enc"]))
    # under a scheme that trains everything there is nothing to restrict: it compiles, as jax.jit
    full = pockjax.compile(_sam_in_a_loop(kind, False), scheme=pockjax.UpdateScheme.full())(
        jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    ref = jax.jit(_sam_in_a_loop(kind, False))(jax.tree.map(jnp.copy, p), _SAM_TX.init(p), x, y)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_a_statistic_the_loss_reads_and_the_step_overwrites_is_refused_under_a_scheme():
    # It has a gradient, so it is a parameter; a scheme that freezes it kept its old value
    # while jax.jit updated it from the batch (0.0058 apart, and 'head' 1.2e-5 off).
    tx = optax.adamw(0.1)
    params = {"w": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1)), "mean": jnp.zeros((3,))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))

    def make(stop):
        def step(params, s, x, y):
            def loss(p):
                h = jnp.tanh(x @ p["w"])
                m = jax.lax.stop_gradient(p["mean"]) if stop else p["mean"]
                return jnp.mean(((h - m) @ p["head"] - y) ** 2), h
            (value, h), g = jax.value_and_grad(loss, has_aux=True)(params)
            u, s = tx.update(g, s, params)
            new = optax.apply_updates(params, u)
            return {**new, "mean": 0.9 * params["mean"] + 0.1 * h.mean(0)}, s, value
        return step

    scheme = pockjax.UpdateScheme({"head": "full"})
    with pytest.raises(pockjax.SchemeError, match=r"sets 'mean', which the loss reads .*jax.lax.stop_gradient"):
        pockjax.compile(make(False), scheme=scheme)(jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    # read under stop_gradient it is model state, updated as under jax.jit
    got = pockjax.compile(make(True), scheme=scheme)(jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    ref = jax.jit(make(True))(jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    np.testing.assert_allclose(np.asarray(got["mean"]), np.asarray(ref["mean"]), atol=1e-7)
    assert float(jnp.abs(got["mean"]).max()) > 0
    # trained in full there is nothing to keep: as jax.jit
    full = pockjax.compile(make(False), scheme=pockjax.UpdateScheme.full())(
        jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    ref = jax.jit(make(False))(jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    for k in params:
        np.testing.assert_allclose(np.asarray(full[k]), np.asarray(ref[k]), atol=1e-6)


def test_a_sparse_state_missing_a_model_state_leafs_state_says_to_pass_the_full_state():
    # "leaf 1 has shape none" told the user to pass the init_opt_state they had passed
    tx = optax.sgd(0.1, momentum=0.9)
    params = {"w": jnp.ones((4, 8)) / 4, "head": jnp.ones((8, 1)), "stats": jnp.zeros((8,))}

    def step(params, opt_state, x, y):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w"])
            return jnp.mean((h @ p["head"] - y) ** 2), h
        (loss, h), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        u, opt_state = tx.update(g, opt_state, params)
        new = optax.apply_updates(params, u)
        return {**new, "stats": 0.9 * params["stats"] + 0.1 * h.mean(0)}, opt_state, loss

    scheme = pockjax.UpdateScheme({"head": "full"})
    x, y = jnp.ones((16, 4)), jnp.zeros((16, 1))
    f = pockjax.compile(step, scheme=scheme)
    with pytest.raises(pockjax.StepSignatureError, match=r"leaf 1 \(opt_state.0.trace.stats\) has shape none .*"
                                                         r"pass the full state, tx.init\(params\)"):
        f(jax.tree.map(jnp.copy, params), pockjax.init_opt_state(tx, params, scheme), x, y)
    got = f(jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    ref = jax.jit(step)(jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    np.testing.assert_allclose(np.asarray(got["stats"]), np.asarray(ref["stats"]), atol=1e-7)


@pytest.mark.parametrize("after", ["reduce_on_plateau", "clip_by_global_norm"])
def test_set_to_zero_then_a_global_scale_is_not_taken_for_an_overwritten_statistic(after):
    # multi_transform's set_to_zero freezes 'enc' as p + scale * 0; a scale read from the loss or
    # the other updates made that read the batch, and the step was refused (review finding)
    params = {"enc": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))
    inner = optax.multi_transform({"a": optax.adam(0.1), "z": optax.set_to_zero()}, {"enc": "z", "head": "a"})
    tx = optax.chain(inner, optax.contrib.reduce_on_plateau() if after == "reduce_on_plateau"
                     else optax.clip_by_global_norm(1.0))

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(_two_layer_loss)(p, x, y)
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s, loss

    got = pockjax.compile(step, scheme=pockjax.UpdateScheme({"head": "full"}))(
        jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    ref = jax.jit(step)(jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_a_statistic_fed_from_a_scan_is_refused_too():
    # the scan's outputs once read every gradient taken inside it, the statistic its own among them
    tx = optax.adamw(0.1)
    params = {"w": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1)), "mean": jnp.zeros((3,))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))

    def step(p, s, x, y):
        def micro(acc, b):
            def loss(q):
                h = jnp.tanh(b[0] @ q["w"])
                return jnp.mean(((h - q["mean"]) @ q["head"] - b[1]) ** 2), h
            (_, h), g = jax.value_and_grad(loss, has_aux=True)(p)
            return jax.tree.map(jnp.add, acc, g), h.mean(0)
        g, hm = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, p), (x[:, None], y[:, None]))
        u, s = tx.update(g, s, p)
        return {**optax.apply_updates(p, u), "mean": 0.9 * p["mean"] + 0.1 * hm.mean(0)}, s

    with pytest.raises(pockjax.SchemeError, match="sets 'mean', which the loss reads"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"head": "full"}))(
            jax.tree.map(jnp.copy, params), tx.init(params), x, y)


@pytest.mark.parametrize("kind", ["while", "cond"])
def test_a_statistic_set_in_a_while_loop_or_a_branch_is_refused_too(kind):
    # a while or cond gave each output every gradient taken inside it, the statistic's own among
    # them: the step looked as if it updated 'mean' from its gradient, and the frozen statistic
    # kept its old value where jax.jit updated it
    tx = optax.adamw(0.1)
    params = {"w": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1)), "mean": jnp.zeros((3,))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))

    def loss(q, b, t):
        h = jnp.tanh(b @ q["w"])
        return jnp.mean(((h - q["mean"]) @ q["head"] - t) ** 2), h

    def step(p, s, x, y):
        if kind == "while":
            def body(c):
                i, acc, hs = c
                (_, h), g = jax.value_and_grad(loss, has_aux=True)(p, x[i][None], y[i][None])
                return i + 1, jax.tree.map(jnp.add, acc, g), hs + h.mean(0)
            _, g, hs = jax.lax.while_loop(lambda c: c[0] < x.shape[0], body,
                                          (0, jax.tree.map(jnp.zeros_like, p), jnp.zeros(3)))
            mean = 0.9 * p["mean"] + 0.1 * hs / x.shape[0]
        else:
            def taken():
                (_, h), g = jax.value_and_grad(loss, has_aux=True)(p, x, y)
                return g, 0.9 * p["mean"] + 0.1 * h.mean(0)
            g, mean = jax.lax.cond(jnp.sum(x) > 0, taken, lambda: (jax.tree.map(jnp.zeros_like, p), p["mean"]))
        u, s = tx.update(g, s, p)
        return {**optax.apply_updates(p, u), "mean": mean}, s

    with pytest.raises(pockjax.SchemeError, match="sets 'mean', which the loss reads"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"head": "full"}))(
            jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    # trained in full, as jax.jit
    got = pockjax.compile(step, scheme=pockjax.UpdateScheme.full())(
        jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    ref = jax.jit(step)(jax.tree.map(jnp.copy, params), tx.init(params), x, y)[0]
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), atol=1e-6)


@pytest.mark.parametrize("rule", ["anneal", "schedule", "reset", "floor", "toward", "batch-scalar"])
def test_a_parameter_the_step_changes_from_itself_alone_is_refused_when_frozen(rule):
    # temp, read by the loss, annealed as temp * 0.9 (or by a schedule of the step count, or
    # reset): it read nothing but itself, so it passed as set_to_zero's p + 0 does, and a
    # scheme that froze it kept 2.0 where jax.jit made it 1.8
    tx = optax.adam(0.1)
    params = {"w": jnp.full((4, 3), 0.1), "temp": jnp.full((3,), 2.0)}
    x = jnp.arange(8.0).reshape(2, 4) / 8

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda q: jnp.sum(jnp.tanh(x @ q["w"]) / q["temp"]))(p)
        u, s = tx.update(g, s, p)
        t = p["temp"]
        new = {"anneal": t * 0.9, "schedule": t * (1.0 / (1.0 + s[0].count)), "reset": jnp.ones_like(t),
               # review findings: accepted as an update applied, frozen at 2.0 where jax.jit moved it
               "floor": jnp.maximum(t * 0.9, 0.5), "toward": 0.9 * t + 0.1,
               "batch-scalar": 0.9 * t + 0.1 * jnp.std(x)}[rule]
        return {**optax.apply_updates(p, u), "temp": new}, s

    with pytest.raises(pockjax.SchemeError, match=r"sets 'temp', which the loss reads .*p \* 0.9"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"w": "full"}))(
            jax.tree.map(jnp.copy, params), tx.init(params), x)
    got = pockjax.compile(step, scheme=pockjax.UpdateScheme.full())(
        jax.tree.map(jnp.copy, params), tx.init(params), x)[0]
    ref = jax.jit(step)(jax.tree.map(jnp.copy, params), tx.init(params), x)[0]
    np.testing.assert_allclose(np.asarray(got["temp"]), np.asarray(ref["temp"]), atol=1e-7)
    assert float(ref["temp"][0]) != 2.0


def test_set_to_zero_on_a_bf16_parameter_is_not_taken_for_a_new_value():
    # p + 0 in float32, cast back to bfloat16: the parameter's own value, frozen as it is
    params = {"enc": jnp.full((4, 3), 0.1, jnp.bfloat16), "head": jnp.ones((3, 1))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))
    tx = optax.multi_transform({"a": optax.adam(0.1), "z": optax.set_to_zero()}, {"enc": "z", "head": "a"})

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(
            lambda q: jnp.mean((jnp.tanh(x @ q["enc"].astype(jnp.float32)) @ q["head"] - y) ** 2))(p)
        u, s = tx.update(g, s, p)
        return jax.tree.map(lambda a, b: (a.astype(jnp.float32) + b).astype(a.dtype), p, u), s, loss

    got = pockjax.compile(step, scheme=pockjax.UpdateScheme({"head": "full"}))(
        jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    ref = jax.jit(step)(jax.tree.map(jnp.copy, params), tx.init(params), x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6)


@pytest.mark.parametrize("guard", ["cond", "where", "while"])
def test_a_statistic_behind_a_finite_check_of_the_gradients_is_refused(guard):
    # the check reads every gradient, the statistic's own among them: the statistic looked
    # updated from its gradient and a scheme that froze it kept [0 0 0] where jax.jit gave 0.0172
    tx = optax.adamw(0.1)
    params = {"w": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1)), "mean": jnp.zeros((3,))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))

    def step(p, s, x, y):
        def loss(q):
            h = jnp.tanh(x @ q["w"])
            return jnp.mean(((h - q["mean"]) @ q["head"] - y) ** 2), h
        (value, h), g = jax.value_and_grad(loss, has_aux=True)(p)
        ok = jnp.isfinite(optax.tree.norm(g))
        u, s = tx.update(g, s, p)
        new = optax.apply_updates(p, u)
        if guard == "cond":
            new["mean"] = jax.lax.cond(ok, lambda: 0.9 * p["mean"] + 0.1 * h.mean(0), lambda: p["mean"])
        elif guard == "where":
            new["mean"] = jnp.where(ok, 0.9 * p["mean"] + 0.1 * h.mean(0), p["mean"])
        else:
            new["mean"] = jax.lax.while_loop(lambda c: c[0] < jnp.where(ok, 1, 0),
                                             lambda c: (c[0] + 1, 0.9 * c[1] + 0.1 * h.mean(0)), (0, p["mean"]))[1]
        return new, s, value

    with pytest.raises(pockjax.SchemeError, match="sets 'mean', which the loss reads"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"w": "full", "head": "full"}))(
            jax.tree.map(jnp.copy, params), tx.init(params), x, y)


@pytest.mark.parametrize("rule", ["decay-after", "decay-by-hand", "clip", "lr-argument", "skip-if-not-finite",
                                  "clip-in-skip", "clip-update", "sign-update"])
def test_a_frozen_parameter_moved_only_by_decay_a_clip_or_a_skip_is_kept(rule):
    # set_to_zero freezes 'w'; what else moves it is the optimizer's (decay, a clip, a skip on a
    # non-finite loss): kept, as PyTorch keeps a parameter without a gradient. These were refused
    # as "a value annealed from itself" by a first version of the check.
    params = {"w": jnp.full((4, 3), 0.1), "b": jnp.zeros((3,)), "head": jnp.ones((3, 1))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))
    mt = optax.multi_transform({"a": optax.adam(0.1), "z": optax.set_to_zero()}, {"w": "z", "b": "a", "head": "a"})
    tx = {"decay-after": optax.chain(mt, optax.add_decayed_weights(0.1), optax.scale(-0.1)),
          # set_to_zero's zeros clipped, or their sign taken: still zero (review finding: refused)
          "clip-update": optax.chain(mt, optax.clip(0.5)),
          "sign-update": optax.chain(mt, optax.scale_by_sign(), optax.scale(-0.01))}.get(rule, mt)

    def make(frozen_w):
        def step(p, s, x, y, lr):
            def loss(q):
                w = jax.lax.stop_gradient(q["w"]) if frozen_w else q["w"]
                return jnp.mean((jnp.tanh(x @ w + q["b"]) @ q["head"] - y) ** 2)
            value, g = jax.value_and_grad(loss)(p)
            u, s2 = tx.update(g, s, p)
            if rule == "decay-by-hand":
                new = jax.tree.map(lambda a, b: a * (1 - 0.1 * 0.01) + b, p, u)
            elif rule == "clip":
                new = jax.tree.map(lambda a: jnp.clip(a, -1.0, 1.0), optax.apply_updates(p, u))
            elif rule == "lr-argument":
                new = jax.tree.map(lambda a, b: a - lr * b, p, u)
            elif rule == "skip-if-not-finite":
                new, s2 = jax.lax.cond(jnp.isfinite(value), lambda: (optax.apply_updates(p, u), s2), lambda: (p, s))
            elif rule == "clip-in-skip":  # the clip a call inside the branch, of p + u
                new, s2 = jax.lax.cond(jnp.isfinite(value), lambda: (jax.tree.map(
                    lambda a: jnp.clip(a, -1.0, 1.0), optax.apply_updates(p, u)), s2), lambda: (p, s))
            else:
                new = optax.apply_updates(p, u)
            return new, s2, value
        return step

    lr = jnp.float32(0.5)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    f = pockjax.compile(make(False), scheme=pockjax.UpdateScheme({"b": "full", "head": "full"}))
    q, t = jax.tree.map(jnp.copy, params), tx.init(params)
    for _ in range(2):
        p, s, _ = f(p, s, x, y, lr)
        q, t, _ = jax.jit(make(True))(q, t, x, y, lr)  # jax.jit, w's gradient zero and w put back
        q = {**q, "w": params["w"]}
    np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(params["w"]))
    for k in ("b", "head"):
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(q[k]), atol=1e-6)
    assert float(jnp.abs(p["b"]).max()) > 0


@pytest.mark.parametrize("opt, of", [("adam", "new"), ("adam", "old"), ("adamw", "new")])
def test_an_average_of_the_weights_in_the_optimizer_state_follows_a_frozen_parameter(opt, of):
    # optax.ema of the weights kept beside the optimizer's state: its average of a frozen 'enc' was
    # kept at 0 while its count advanced, so the debiased average fell 0.1 -> 0.0526 -> 0.0369;
    # it is the kept 0.1 (under adamw too: decay moves no frozen parameter, nor its average)
    tx = optax.adam(0.1) if opt == "adam" else optax.adamw(0.1, weight_decay=0.5)
    ema = optax.ema(0.9)
    params = {"enc": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1))}
    x, y = jnp.arange(8.0).reshape(2, 4) / 8, jnp.ones((2, 1))

    def make(frozen):
        def step(p, s, x, y):
            value, g = jax.value_and_grad(_two_layer_loss)(p, x, y, frozen)
            u, os = tx.update(g, s[0], p)
            new = optax.apply_updates(p, u)
            if frozen:
                new = {**new, "enc": p["enc"]}  # the reference: enc put back before the average reads it
            average, es = ema.update(new if of == "new" else p, s[1])
            return new, (os, es), average
        return step

    scheme = pockjax.UpdateScheme({"head": "full"})
    f = pockjax.compile(make(False), scheme=scheme)
    p, s = jax.tree.map(jnp.copy, params), (tx.init(params), ema.init(params))
    q, t = jax.tree.map(jnp.copy, params), (tx.init(params), ema.init(params))
    for _ in range(3):
        p, s, got = f(p, s, x, y)
        q, t, want = jax.jit(make(True))(q, t, x, y)
        for a, b in zip(jax.tree.leaves((p, s, got)), jax.tree.leaves((q, t, want))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["enc"]), 0.1, atol=1e-6)
    sparse = (pockjax.init_opt_state(tx, params, scheme), pockjax.init_opt_state(ema, params, scheme))
    with pytest.raises(pockjax.PockjaxError, match=r"'opt_state.1.ema.enc' of the frozen parameter 'enc' is computed"
                                                   r" from the parameter .*tx.init\(params\)"):
        f(jax.tree.map(jnp.copy, params), sparse, x, y)


def test_apply_if_finite_takes_a_sparse_state():
    # the finite check's cond updated the state of every parameter, so the frozen one's (absent
    # from pockjax.init_opt_state's state) was read, and the step refused: now the branch computes
    # only what is read; a non-finite step is skipped as under jax.jit
    tx = optax.apply_if_finite(optax.adamw(0.1, weight_decay=0.1), 3)
    params = {"enc": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1))}
    y = jnp.ones((2, 1))
    xs = [jnp.arange(8.0).reshape(2, 4) / 8, jnp.full((2, 4), jnp.nan), jnp.ones((2, 4))]

    def make(frozen):
        def step(p, s, x, y):
            value, g = jax.value_and_grad(_two_layer_loss)(p, x, y, frozen)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, value
        return step

    scheme = pockjax.UpdateScheme({"head": "full"})
    f = pockjax.compile(make(False), scheme=scheme)
    p, s = jax.tree.map(jnp.copy, params), pockjax.init_opt_state(tx, params, scheme)
    q, t = jax.tree.map(jnp.copy, params), tx.init(params)
    for x in xs:
        p, s, _ = f(p, s, x, y)
        q, t, _ = jax.jit(make(True))(q, t, x, y)
        q = {**q, "enc": params["enc"]}
        np.testing.assert_array_equal(np.asarray(p["enc"]), np.asarray(params["enc"]))
        np.testing.assert_allclose(np.asarray(p["head"]), np.asarray(q["head"]), atol=1e-6)
    assert int(t.total_notfinite) == int(s.leaves[2]) == 1  # (notfinite_count, last_finite, total_notfinite, ...)
    assert float(p["head"][0, 0]) != 1.0


def test_a_step_reading_a_frozen_parameters_state_refuses_a_sparse_state():
    # a sparse state does not hold it: a clear error, not a read of something absent
    tx = optax.adam(0.1)
    params = {"enc": jnp.full((4, 3), 0.1), "head": jnp.ones((3, 1))}
    x, y = jnp.ones((2, 4)), jnp.ones((2, 1))

    def step(p, s, x, y):
        value, g = jax.value_and_grad(lambda q: jnp.mean((jnp.tanh(x @ q["enc"]) @ q["head"] - y) ** 2))(p)
        u, s2 = tx.update(g, s, p)
        return optax.apply_updates(p, u), s2, value, jnp.sum(s[0].mu["enc"])  # logs the moment

    scheme = pockjax.UpdateScheme({"head": "full"})
    with pytest.raises(pockjax.PockjaxError, match=r"optimizer state 'opt_state.0.mu.enc' of a frozen parameter is"
                                                   r" read by the step; .*initialise it with tx.init\(params\)"):
        pockjax.compile(step, scheme=scheme)(jax.tree.map(jnp.copy, params),
                                             pockjax.init_opt_state(tx, params, scheme), x, y)


def test_an_unread_parameter_under_adamw_and_reduce_on_plateau_stays_a_parameter():
    # the plateau's scale reads the loss (the batch): the own-state rule once called the unread,
    # decaying 'u' model state, and a scheme that freezes it let it decay
    tx = optax.chain(optax.adamw(0.1, weight_decay=0.5), optax.contrib.reduce_on_plateau())
    params = {"w": jnp.full((4, 4), 0.1), "u": jnp.ones((4,))}
    x = jnp.ones((2, 4))

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda q: jnp.sum(jnp.tanh(x @ q["w"])))(p)
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s

    traced = pockjax.trace_step(step, (params, tx.init(params), x))
    assert dict(zip(traced.in_paths[:2], traced.in_roles[:2])) == {"u": "param", "w": "param"}
    got = pockjax.compile(step, scheme=pockjax.UpdateScheme({"w": "full"}))(
        jax.tree.map(jnp.copy, params), tx.init(params), x)[0]
    np.testing.assert_array_equal(np.asarray(got["u"]), np.asarray(params["u"]))


def test_layers_handed_back_by_a_scan_through_remat_stay_frozen():
    # nnx.scan over stacked layers with nnx.remat in its body returns the layers as the scan's
    # stacked outputs (without remat JAX forwards them): a frozen stack was refused as "set from
    # other values than its gradient"; it is the stack handed back, and matches nnx.jit
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return nnx.Linear(4, 4, rngs=rngs)
            self.layers = make(rngs)
            self.out = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(h, block):
                return nnx.remat(lambda h, b: h + jnp.tanh(b(h)))(h, block)
            return self.out(run(x, self.layers))

    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    x, y = jnp.linspace(-1, 1, 20).reshape(5, 4), jnp.ones((5, 2))
    scheme = pockjax.UpdateScheme({"out.*": "full"})
    runs = []
    for f in (pockjax.compile(step, scheme=scheme), nnx.jit(step)):
        model = Model(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=scheme.nnx_wrt())
        start = np.asarray(model.layers.kernel[...])
        runs.append(([float(f(model, opt, x, y)) for _ in range(3)], np.asarray(model.out.kernel[...])))
        np.testing.assert_array_equal(np.asarray(model.layers.kernel[...]), start)
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    np.testing.assert_allclose(runs[0][1], runs[1][1], atol=1e-6)


@pytest.mark.parametrize("how", ["scaled", "counter"])
def test_a_scan_that_changes_the_stacked_layers_it_hands_back_is_refused(how):
    # the scan's stacked output is the stack scaled slice by slice, or shifted by a counter the
    # loop carries from zero (w[i] + i: the carry starts at zero but is not zero inside the loop)
    tx = optax.adam(0.1)
    params = {"w": jnp.full((3, 4), 0.5), "head": jnp.ones((4,))}
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)

    def hand_back(w):
        if how == "scaled":
            return jax.lax.scan(lambda h, w: (h, w * 0.9), x, w)[1]
        return jax.lax.scan(lambda c, w: (c + 1.0, w + c), jnp.zeros(4), w)[1]

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda q: jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h * w), None), x,
                                                                     q["w"])[0] @ q["head"]))(p)
        u, s = tx.update(g, s, p)
        new = optax.apply_updates(p, u)
        return {**new, "w": hand_back(p["w"])}, s, loss

    with pytest.raises(pockjax.SchemeError, match="sets 'w', which the loss reads"):
        pockjax.compile(step, scheme=pockjax.UpdateScheme({"head": "full"}))(params, tx.init(params), x)


def test_an_average_of_a_channel_ruled_parameter_reads_it_as_it_comes_back():
    # the untrained channels are put back in the returned weight, but other readers of its new
    # value (an EMA kept in the tree, an EMA teacher) read it decayed: 0.056 off under adamw
    tx = optax.adamw(0.1, weight_decay=0.5)
    params = {"w": jnp.full((4, 4), 0.5), "ema": jnp.full((4, 4), 0.5)}
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda q: jnp.mean(jnp.tanh(x @ q["w"]) ** 2))(p)
        u, s = tx.update(g, s, p)
        new = optax.apply_updates(p, u)
        return {"w": new["w"], "ema": 0.5 * p["ema"] + 0.5 * new["w"]}, s, loss

    f = pockjax.compile(step, scheme=pockjax.UpdateScheme({"w": pockjax.channels(2)}))
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    for _ in range(3):
        ema = np.asarray(p["ema"]).copy()  # the step donates its params
        p, s, _ = f(p, s, x)
        np.testing.assert_allclose(np.asarray(p["ema"]), 0.5 * ema + 0.5 * np.asarray(p["w"]), atol=1e-7)
    np.testing.assert_array_equal(np.asarray(p["w"][:, 2:]), 0.5)  # the untrained channels, kept
    assert not np.allclose(np.asarray(p["w"][:, :2]), 0.5)

"""Clear errors, pass structure, idempotence, and Flax NNX steps."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax
from pockjax import _compat as C
from toy_models import MLP, Transformer, make_step, nnx_mse_step


def _setup(model=None, tx=None):
    model = model or MLP()
    tx = tx or optax.adam(1e-2)
    params = model.init(jax.random.key(0))
    return model, tx, params, tx.init(params), model.batch(jax.random.key(1))


def test_step_outputs_must_match_inputs():
    model, tx, params, opt_state, batch = _setup()

    def swapped(params, opt_state, batch):
        p, s, loss = make_step(model, tx)(params, opt_state, batch)
        return s, p, loss

    with pytest.raises(pockjax.StepSignatureError, match="structure of its input params"):
        pockjax.compile(swapped)(params, opt_state, batch)

    def only_loss(params, opt_state, batch):
        return model.loss(params, batch)

    with pytest.raises(pockjax.StepSignatureError, match=r"must return \(new_params, new_opt_state, \*aux\)"):
        pockjax.compile(only_loss)(params, opt_state, batch)

    def reshaped(params, opt_state, batch):
        p, s, loss = make_step(model, tx)(params, opt_state, batch)
        p = jax.tree.map(lambda x: x.reshape(-1), p)
        return p, s, loss

    with pytest.raises(pockjax.StepSignatureError, match="keep the old shape"):
        pockjax.compile(reshaped)(params, opt_state, batch)


def test_unmatched_pattern_and_channel_errors_surface_from_compile():
    model, tx, params, opt_state, batch = _setup()
    with pytest.raises(pockjax.UnmatchedPatternError, match="dense0.kernel"):
        pockjax.compile(make_step(model, tx), scheme=pockjax.UpdateScheme({"dense0.kernal": "full"}))(
            params, opt_state, batch
        )
    with pytest.raises(pockjax.ChannelRuleError, match="larger than axis"):
        pockjax.compile(make_step(model, tx), scheme=pockjax.UpdateScheme({"dense0.bias": pockjax.channels(99)}))(
            params, opt_state, batch
        )


# A primitive that carries a jaxpr pockjax does not know how to enter.
opaque_call_p = C.Primitive("opaque_call")
opaque_call_p.multiple_results = True
opaque_call_p.def_impl(lambda *args, jaxpr: C.jaxpr_as_fun(jaxpr)(*args))
opaque_call_p.def_abstract_eval(lambda *avals, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])


def test_unsupported_primitive_is_named():
    model, tx, params, opt_state, batch = _setup()
    inner = make_step(model, tx)

    def step(params, opt_state, batch):
        flat, tree = jax.tree.flatten((params, opt_state, batch))
        closed = jax.make_jaxpr(lambda *xs: jax.tree.leaves(inner(*jax.tree.unflatten(tree, xs))))(*flat)
        outs = opaque_call_p.bind(*flat, jaxpr=closed)
        return jax.tree.unflatten(jax.tree.structure(inner(params, opt_state, batch)), outs)

    graph = pockjax.trace_step(step, (params, opt_state, batch))
    with pytest.raises(pockjax.UnsupportedPrimitiveError, match="opaque_call"):
        pockjax.dce()(graph)


def test_passes_give_valid_jaxprs_and_are_idempotent():
    model, tx, params, opt_state, batch = _setup(Transformer(layers=2), optax.adamw(1e-2))
    scheme = pockjax.UpdateScheme({"layers.1.attn.*.kernel": pockjax.channels(0.5), "layers.1.mlp.w1.kernel": "full"})
    graph = pockjax.trace_step(make_step(model, tx), (params, opt_state, batch))
    once = pockjax.dce()(pockjax.sparse_grad(scheme)(graph))
    twice = pockjax.dce()(pockjax.sparse_grad(scheme)(once))
    for g in (once, twice):
        C.check_jaxpr(g.jaxpr)
    assert pockjax.count_primitives(once)["dot_general"] == pockjax.count_primitives(twice)["dot_general"]
    assert pockjax.count_flops(twice) <= pockjax.count_flops(once) * 1.001
    assert len(pockjax.dce()(once).jaxpr.eqns) == len(once.jaxpr.eqns)  # dce is idempotent
    stripped = pockjax.strip_tags()(once)
    assert not any(k.startswith("pockjax_") for k in pockjax.count_primitives(stripped))
    args = jax.tree.leaves((params, opt_state, batch))
    run_once, run_twice = (C.jaxpr_as_fun(pockjax.strip_tags()(g).closed_jaxpr) for g in (once, twice))
    a, b = jax.jit(lambda *xs: (run_once(*xs), run_twice(*xs)))(*args)  # one compile, not ~750 eager ops
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_frozen_step_has_no_weight_gradient_for_frozen_layers_inside_scan():
    model, tx, params, opt_state, batch = _setup(Transformer(layers=3, scan=True), optax.sgd(0.1))
    graph = pockjax.trace_step(make_step(model, tx), (params, opt_state, batch))
    full_dots = pockjax.count_primitives(graph)["dot_general"]
    sparse = pockjax.dce()(pockjax.sparse_grad(pockjax.UpdateScheme({"layers.attn.wq.kernel": "full"}))(graph))
    # inside the backward scan body only the dots wq's gradient needs remain
    assert pockjax.count_primitives(sparse)["dot_general"] < full_dots
    assert pockjax.count_flops(sparse) < 0.8 * pockjax.count_flops(graph)


# -- one pass shape -----------------------------------------------------------------
PASS_FACTORIES = {
    "sparse_grad": lambda: pockjax.sparse_grad(pockjax.UpdateScheme({"dense1.*": "full"})),
    "dce": pockjax.dce,
    "fold_dot_transpose": pockjax.fold_dot_transpose,
    "inplace_update": pockjax.inplace_update,
    "reorder_for_memory": pockjax.reorder_for_memory,
    "strip_tags": pockjax.strip_tags,
}


def _mlp_graph():
    model, tx, params, opt_state, batch = _setup()
    return pockjax.trace_step(make_step(model, tx), (params, opt_state, batch)), (params, opt_state, batch)


@pytest.mark.parametrize("name", sorted(PASS_FACTORIES))
def test_every_pass_is_a_named_frozen_pass_that_composes(name):
    made = PASS_FACTORIES[name]()
    assert isinstance(made, pockjax.Pass) and made.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.name = "other"
    graph, args = _mlp_graph()
    once = pockjax.chain(made, pockjax.dce())(graph)
    C.check_jaxpr(once.jaxpr)
    assert once.pass_names == (name, "dce")
    assert graph.history == ()  # passes are pure: the input graph is untouched
    # idempotent: a second run changes what the graph computes in no way
    twice = pockjax.chain(made, pockjax.dce())(once)
    assert pockjax.count_primitives(twice) == pockjax.count_primitives(once)
    strip = pockjax.strip_tags()
    a = C.jaxpr_as_fun(strip(once).closed_jaxpr)(*jax.tree.leaves(args))
    b = C.jaxpr_as_fun(strip(twice).closed_jaxpr)(*jax.tree.leaves(args))
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_check_false_builds_the_same_graph_and_only_skips_check_jaxpr(monkeypatch):
    """``check=False`` (the search's graphs, analysed and never compiled) skips the passes' ``check_jaxpr``."""
    import importlib

    graph, _ = _mlp_graph()
    scheme = pockjax.UpdateScheme.full()
    checked = pockjax.default_passes(scheme)(graph)
    unchecked = pockjax.default_passes(scheme, check=False)(graph)
    assert checked.record(pockjax.transforms.FoldDotTransposeRecord).folded > 0  # the fold's check ran
    assert str(unchecked.jaxpr) == str(checked.jaxpr) and unchecked.history == checked.history
    # a rewrite that breaks the program: refused with check=True, let through with check=False
    dce_mod = importlib.import_module("pockjax.transforms.dce")
    monkeypatch.setitem(dce_mod.DCE_RULES, C.primitives.dot_general_p,
                        lambda used, eqn: ([True] * len(eqn.invars), None))  # drops a used matmul
    with pytest.raises(jax.errors.JaxprTypeError, match="not defined"):
        pockjax.dce()(graph)
    pockjax.dce(check=False)(graph)
    monkeypatch.undo()
    fold_mod = importlib.import_module("pockjax.transforms.fold_dot_transpose")
    monkeypatch.setattr(fold_mod, "fold_dot_transpose_jaxpr", lambda j: (j.replace(eqns=j.eqns[1:]), 1))
    with pytest.raises(jax.errors.JaxprTypeError, match="not defined"):
        pockjax.fold_dot_transpose()(graph)
    pockjax.fold_dot_transpose(check=False)(graph)


def test_chain_refuses_what_is_not_a_pass_and_names_the_fix():
    with pytest.raises(TypeError, match=r"call it \(pockjax\.dce\(\)"):
        pockjax.chain(pockjax.sparse_grad(pockjax.UpdateScheme.full()), pockjax.dce)

    def my_pass(graph):
        return graph

    with pytest.raises(TypeError, match=r"wrap it: pockjax\.Pass\('my_pass', my_pass\)"):
        pockjax.chain(pockjax.dce(), my_pass)
    with pytest.raises(TypeError, match="not a pockjax.Pass"):
        pockjax.chain("dce")
    with pytest.raises(TypeError, match="takes an UpdateScheme"):
        pockjax.sparse_grad({"dense1.*": "full"})
    graph, _ = _mlp_graph()
    with pytest.raises(TypeError, match="returned dict, not a TrainGraph"):
        pockjax.Pass("broken", lambda g: {})(graph)
    with pytest.raises(TypeError, match="rewrites a pockjax.TrainGraph"):
        pockjax.dce()(graph.closed_jaxpr)


def test_passes_record_typed_facts():
    graph, _ = _mlp_graph()
    scheme = pockjax.UpdateScheme({"dense1.*": "full"})
    out = pockjax.default_passes(scheme)(graph)
    assert out.pass_names == ("sparse_grad", "dce", "fold_dot_transpose")
    sparse = out.record(pockjax.transforms.SparseGradRecord)
    assert sparse.scheme is scheme and not sparse.sparse_opt_state
    assert dict(sparse.rules) == {"dense0.bias": pockjax.Frozen(), "dense0.kernel": pockjax.Frozen(),
                                  "dense1.bias": pockjax.Full(), "dense1.kernel": pockjax.Full()}
    assert dataclasses.asdict(sparse)["sparse_opt_state"] is False
    # dense1's input (8 wide) is wider than its output gradient (4): that pair stays;
    # dense0's (6 -> 8) is folded
    assert out.record(pockjax.transforms.FoldDotTransposeRecord).folded == 0
    first = pockjax.default_passes(pockjax.UpdateScheme({"dense0.*": "full"}))(graph)
    assert first.record(pockjax.transforms.FoldDotTransposeRecord).folded >= 1
    assert out.record(pockjax.transforms.InplaceUpdateRecord) is None
    assert out.step_name == "make_step.<locals>.step"


def test_one_phase_decision_for_every_equation():
    from pockjax._src.jaxpr import Phase, phase

    graph, _ = _mlp_graph()
    phases = [phase(e) for e in graph.jaxpr.eqns]
    assert set(phases) == {Phase.FORWARD, Phase.BACKWARD, Phase.OTHER}
    grads = [p for e, p in zip(graph.jaxpr.eqns, phases) if e.primitive.name == "pockjax_grad_tag"]
    assert grads and all(p is Phase.BACKWARD for p in grads)
    params = [p for e, p in zip(graph.jaxpr.eqns, phases) if e.primitive.name == "pockjax_param_tag"]
    assert params and all(p is Phase.FORWARD for p in params)
    assert phases[-1] is Phase.OTHER  # the optimizer update comes last


def test_nnx_step_in_place():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.RMSNorm(8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.norm(self.l1(x))))

    x, y = jnp.ones((3, 4)), jnp.zeros((3, 2))
    ref_model = Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    l1_before = np.asarray(model.l1.kernel[...])
    step = pockjax.compile(nnx_mse_step, scheme=pockjax.UpdateScheme({"l2.*": "full", "norm.scale": "full"}))
    losses = [float(step(model, opt, x, y)) for _ in range(3)]
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(np.asarray(model.l1.kernel[...]), l1_before)  # frozen
    assert int(opt.step[...]) == 3

    # all-full equals nnx's own step
    full = pockjax.compile(nnx_mse_step)
    m2 = Net(nnx.Rngs(0))
    o2 = nnx.Optimizer(m2, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(2):
        got = full(m2, o2, x, y)
        want = nnx.jit(nnx_mse_step)(ref_model, ref_opt, x, y)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(m2.l2.kernel[...], ref_model.l2.kernel[...], rtol=1e-6, atol=1e-7)


def test_functional_nnx_split_state():
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.sgd(0.1)

    def step(params, opt_state, x):
        def loss_fn(p):
            return jnp.sum(nnx.merge(graphdef, p)(x) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    scheme = pockjax.UpdateScheme({"bias": "full"})
    compiled = pockjax.compile(step, scheme=scheme)
    kernel = np.asarray(params["kernel"][...])
    new_params, _, _ = compiled(params, tx.init(params), jnp.ones((4, 3)))
    np.testing.assert_array_equal(np.asarray(new_params["kernel"][...]), kernel)
    assert not np.allclose(np.asarray(new_params["bias"][...]), 0)


@jax.custom_vjp
def scaled_tanh(x):
    return jnp.tanh(x)


def _scaled_tanh_fwd(x):
    y = jnp.tanh(x)
    return y, y


def _scaled_tanh_bwd(y, ct):
    return (ct * (1 - y * y),)


scaled_tanh.defvjp(_scaled_tanh_fwd, _scaled_tanh_bwd)


def test_nested_primitives_keep_reference_semantics():
    """remat, cond, custom_vjp, custom_jvp (relu), scan and a while loop in one step."""
    from test_sparse_semantics import reference_step

    class Nested:
        def init(self, key):
            ks = jax.random.split(key, 4)
            return {
                "a": {"kernel": jax.random.normal(ks[0], (4, 6)) / 2},
                "b": {"kernel": jax.random.normal(ks[1], (6, 6)) / 3},
                "stack": {"kernel": jax.random.normal(ks[2], (3, 6, 6)) / 3},
                "c": {"kernel": jax.random.normal(ks[3], (6, 2)) / 3},
            }

        def loss(self, params, batch):
            x, y = batch

            @jax.checkpoint
            def first(h):
                return scaled_tanh(h @ params["a"]["kernel"])

            h = first(x)
            h = jax.lax.cond(jnp.sum(x) > 0, lambda h: jax.nn.relu(h @ params["b"]["kernel"]),
                             lambda h: jnp.sin(h @ params["b"]["kernel"]), h)
            h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, params["stack"]["kernel"])
            return jnp.mean((h @ params["c"]["kernel"] - y) ** 2)

        def batch(self, key):
            k1, k2 = jax.random.split(key)
            return jax.random.normal(k1, (5, 4)), jax.random.normal(k2, (5, 2))

    model, tx = Nested(), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        # an undifferentiated while loop in the step
        n = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, loss))[1]
        return optax.apply_updates(params, updates), opt_state, loss, n

    params = model.init(jax.random.key(0))
    opt_state = tx.init(params)
    batch = model.batch(jax.random.key(1))
    scheme = pockjax.UpdateScheme({"b.kernel": pockjax.channels(3), "stack.kernel": pockjax.channels(1, axis=0), "c.kernel": "full"})
    rules = scheme.resolve_tree(params)
    want_p, want_s, want_loss, _, _ = reference_step(model, tx, rules, params, opt_state, batch)
    compiled = pockjax.compile(step, scheme=scheme, donate=False)
    got_p, got_s, got_loss, n = compiled(params, opt_state, batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(n, want_loss / 8, rtol=1e-6)
    for g, w in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_p["a"]["kernel"], params["a"]["kernel"])
    prims = pockjax.count_primitives(pockjax.trace_step(step, (params, opt_state, batch)))
    assert {"cond", "scan", "while"} <= set(prims), prims
    assert {"checkpoint", "remat2"} & set(prims), prims


def test_traces_once_per_signature():
    model, tx, params, opt_state, batch = _setup()
    calls = []
    inner = make_step(model, tx)

    def step(*args):
        calls.append(1)
        return inner(*args)

    compiled = pockjax.compile(step, scheme=pockjax.UpdateScheme({"dense1.*": "full"}))
    for _ in range(3):
        params, opt_state, _ = compiled(params, opt_state, batch)
    assert len(calls) == 1
    bigger = (jnp.ones((7, batch[0].shape[1])), jnp.ones((7, batch[1].shape[1])))
    compiled(params, opt_state, bigger)
    assert len(calls) == 2


def test_xla_options_reach_the_cpu_compile():
    from pockjax.train.steps import XLA_OWN_DOT_KERNELS

    model, tx, params, opt_state, batch = _setup(Transformer())
    step = make_step(model, tx)
    default = pockjax.compile(step).lower(params, opt_state, batch).compile()
    assert default.executable.options == {}
    assert "__ynn_fusion" in default.executable.compiled.as_text()
    tuned = pockjax.compile(step, xla_options=XLA_OWN_DOT_KERNELS)
    low = tuned.lower(params, opt_state, batch).compile()
    assert low.executable.options == XLA_OWN_DOT_KERNELS
    hlo = low.executable.compiled.as_text()
    assert "dot(" in hlo and "__ynn_fusion" not in hlo
    fresh = lambda: jax.tree.map(jnp.copy, (params, opt_state))  # the step donates its state
    a = pockjax.compile(step)(*fresh(), batch)[-1]
    b = tuned(*fresh(), batch)[-1]
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_bad_xla_option_is_a_clear_error():
    model, tx, params, opt_state, batch = _setup()
    step = pockjax.compile(make_step(model, tx), xla_options={"xla_cpu_no_such_option": True})
    with pytest.raises(pockjax.BackendError, match="xla_cpu_no_such_option.*xla_options"):
        step(params, opt_state, batch)
    with pytest.raises(pockjax.BackendError, match="xla_options apply to the in-process XLA step"):
        pockjax.compile(make_step(model, tx), target="cpu", xla_options={"a": 1})

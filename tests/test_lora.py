"""LoRA as a scheme rule: the rule, the adapters in the params tree, the low_rank pass, merging."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax import quant
from pockjax.adapters import LoraTensor, merge
from pockjax.errors import SchemeError
from pockjax.models import llama
from pockjax.train.steps import answer_train_step

ATTN = "layers.*.attn.w[qkvo].kernel"


# -- the rule -------------------------------------------------------------------------
def test_rule_text_and_files_round_trip():
    assert pockjax.scheme.as_rule("lora(8, alpha=16)") == pockjax.lora(8, alpha=16)
    assert pockjax.scheme.as_rule("lora(4)").scale == 1.0
    s = pockjax.UpdateScheme({ATTN: pockjax.lora(8, alpha=16), "**.*norm*.scale": "full"})
    assert pockjax.UpdateScheme.from_dict(s.to_dict()) == s
    assert s.to_dict()["rules"][0][1] == {"lora": 8, "alpha": 16.0}
    assert s.has_lora and not pockjax.UpdateScheme.full().has_lora


@pytest.mark.parametrize("make, message", [
    (lambda: pockjax.lora(0), "rank must be a positive int"),
    (lambda: pockjax.lora(4, alpha=-1.0), "alpha must be a finite number > 0"),
    (lambda: pockjax.lora(4, dropout=0.1), "dropout is not supported yet"),
    (lambda: pockjax.UpdateScheme.from_dict({"rules": [["w", {"lora": "8"}]]}), "rules\\[0\\]\\[1\\]: 'lora'"),
    (lambda: pockjax.UpdateScheme.from_dict({"rules": [["w", {"lora": 8, "beta": 1}]]}), "'lora' \\(the rank\\)"),
])
def test_bad_rules_are_refused(make, message):
    with pytest.raises(SchemeError, match=message):
        make()


def test_adapters_paths_rules_and_optimizer_state():
    params = {"wq": jnp.ones((8, 6)), "norm": jnp.ones(8)}
    scheme = pockjax.UpdateScheme({"wq": pockjax.lora(2, alpha=4)}, default="full")
    tuned = pockjax.add_adapters(params, scheme, seed=3)
    assert pockjax.leaf_paths(tuned) == ["norm", "wq.base", "wq.lora_a", "wq.lora_b"]
    t = tuned["wq"]
    assert t.lora_a.shape == (8, 2) and t.lora_b.shape == (2, 6) and t.scale == 2.0
    assert float(jnp.abs(t.lora_b).max()) == 0.0 and 0 < float(jnp.abs(t.lora_a).max()) <= 1 / np.sqrt(8)
    np.testing.assert_array_equal(jnp.asarray(t), params["wq"])  # starts equal to the model
    state = pockjax.init_opt_state(optax.adam(1e-3), tuned, scheme)
    # count, then mu and nu of norm, lora_a, lora_b: nothing for the frozen base
    assert sorted(tuple(x.shape) for x in state.leaves) == sorted([()] + [(8,), (8, 2), (2, 6)] * 2)
    assert pockjax.add_adapters(tuned, scheme) is not tuned  # idempotent on adapted tensors
    assert pockjax.add_adapters(tuned, scheme)["wq"] is t


def test_a_tensor_of_more_than_two_axes_needs_stacked():
    # A DenseGeneral kernel (features, heads, head_dim) got one adapter per input feature, silently.
    params = {"w": jnp.ones((4, 3, 8)), "v": jnp.ones((4, 6))}
    with pytest.raises(SchemeError, match=r"w has shape \(4, 3, 8\).*stacked=True.*DenseGeneral"):
        pockjax.add_adapters(params, pockjax.UpdateScheme({"w": pockjax.lora(2)}))
    scheme = pockjax.UpdateScheme({"w": pockjax.lora(2, stacked=True)})
    tuned = pockjax.add_adapters(params, scheme)
    assert tuned["w"].lora_a.shape == (4, 3, 2) and tuned["w"].lora_b.shape == (4, 2, 8)  # one per matrix
    # the option survives rule text and scheme files, and older files read as before
    assert pockjax.scheme.as_rule(str(scheme.rules[0][1])) == pockjax.lora(2, stacked=True)
    assert pockjax.UpdateScheme.from_dict(scheme.to_dict()) == scheme
    assert scheme.to_dict()["rules"][0][1] == {"lora": 2, "alpha": 2.0, "stacked": True}
    with pytest.raises(SchemeError, match="'stacked' must be true or false"):
        pockjax.UpdateScheme.from_dict({"rules": [["w", {"lora": 2, "stacked": "yes"}]]})
    with pytest.raises(SchemeError, match="stacked must be True or False"):
        pockjax.lora(2, stacked=1)


def test_guards_name_the_tensor():
    scheme = pockjax.UpdateScheme({"w": pockjax.lora(2)})
    with pytest.raises(SchemeError, match="w has the rule lora\\(2, alpha=2\\), but holds no adapter"):
        scheme.resolve_tree({"w": jnp.ones((4, 4))})
    with pytest.raises(SchemeError, match="needs a matrix"):
        pockjax.add_adapters({"w": jnp.ones(4)}, scheme)
    with pytest.raises(SchemeError, match="rank 2 is larger"):
        pockjax.add_adapters({"w": jnp.ones((1, 4))}, scheme)


# -- the step -------------------------------------------------------------------------
def _tiny():
    cfg = llama.LlamaConfig.tiny()
    graphdef, params = llama.split(llama.Llama(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab, (4, 8))
    batch = {"tokens": jnp.array(tokens), "targets": jnp.array(np.roll(tokens, -1, 1)),
             "loss_mask": jnp.ones((4, 8)).at[:, :5].set(0), "loss_start": jnp.full((4,), 5)}
    return cfg, graphdef, params, batch


def _masked_reference(graphdef, tx, params, scheme):
    """jax.jit of the same step with the updates of frozen entries (and channels) set to zero."""
    leaves = jax.tree.leaves(params)
    masks = []
    for x, r in zip(leaves, scheme.resolve_tree(params)):
        m = np.zeros(np.shape(x), np.float32) if isinstance(r, pockjax.Frozen) else np.ones(np.shape(x), np.float32)
        if isinstance(r, pockjax.scheme.ChannelSelect):
            m = np.zeros(np.shape(x), np.float32)
            np.moveaxis(m, r.axis, 0)[list(r.indices)] = 1.0
        masks.append(jnp.asarray(m))
    mask = jax.tree.unflatten(jax.tree.structure(params), masks)
    keep = optax.stateless(lambda updates, _: jax.tree.map(lambda u, m: u * m, updates, mask))
    rtx = optax.chain(tx, keep)
    return jax.jit(answer_train_step(graphdef, rtx, window=2)), rtx.init(params)


def _side_by_side(a, b, batch, *, steps: int, atol: float):
    """Runs two ``(step, params, opt_state)`` side by side: equal losses each step, equal params at the end."""
    (fa, pa, sa), (fb, pb, sb) = a, b
    for _ in range(steps):
        pa, sa, la = fa(pa, sa, batch)
        pb, sb, lb = fb(pb, sb, batch)
        np.testing.assert_allclose(float(lb), float(la), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol)
    return pa, pb


def test_lora_step_equals_jit_and_never_forms_the_delta():
    cfg, graphdef, params, batch = _tiny()
    # LoRA on attention + sparse FFN channels of the last block + full norms, in one scheme
    rules = {ATTN: pockjax.lora(4, alpha=8), "**.*norm*.scale": "full",
             f"layers.{cfg.n_layers - 1}.mlp.w2.kernel": pockjax.channels(8)}
    scheme = pockjax.UpdateScheme(rules)
    p = pockjax.add_adapters(params, scheme)
    tx = optax.adamw(1e-2)
    step = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=scheme)
    state = pockjax.init_opt_state(tx, p, scheme)
    record = step.lower(p, state, batch).graph.record(pockjax.LowRankRecord)
    n = 4 * cfg.n_layers
    # every adapted product (forward and input gradient) and adapter gradient from the factors
    assert (record.adapters, record.factored_products, record.factored_gradients, record.dense) == (n, 2 * n, n, 0)
    ref, rstate = _masked_reference(graphdef, tx, p, scheme)
    _, p = _side_by_side((ref, p, rstate), (step, p, state), batch, steps=6, atol=2e-5)
    assert float(jnp.abs(p["layers"][0]["attn"]["wq"]["kernel"].lora_b).max()) > 0  # trained


def test_adapter_a_gradient_is_computed_rank_first_and_runs_on_iree():
    # XLA's CPU dot runs (r x tokens) . (tokens x m) ~3x faster than the same product
    # with the m-wide operand first; the pass computes it that way and transposes the
    # (r, m) result behind a barrier, so that XLA cannot fold the transpose back in.
    cfg, graphdef, params, batch = _tiny()
    scheme = pockjax.UpdateScheme({ATTN: pockjax.lora(4, alpha=8)})
    p = pockjax.add_adapters(params, scheme)
    tx = optax.sgd(0.1)
    step = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=scheme)
    state = pockjax.init_opt_state(tx, p, scheme)
    eqns = step.lower(p, state, batch).graph.jaxpr.eqns
    barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
    shapes = sorted({tuple(v.aval.shape) for e in barriers for v in e.outvars})
    assert len(barriers) == 4 * cfg.n_layers and shapes == [(4, cfg.dim)]
    readers = {id(e.invars[0]): e.primitive.name for e in eqns if e.invars and hasattr(e.invars[0], "aval")}
    assert {readers.get(id(e.outvars[0])) for e in barriers} == {"transpose"}
    # the barrier lowers on IREE too: the same step there equals XLA's
    iree = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=scheme, target="cpu")
    _side_by_side((iree, jax.tree.map(jnp.copy, p), pockjax.init_opt_state(tx, p, scheme)), (step, p, state),
                  batch, steps=3, atol=1e-5)


def test_the_rank_first_barrier_is_pinned_on_a_cpu_backend_only(monkeypatch):
    # On an H100 the barrier bought nothing (20.58 against 20.02 ms, 20.71 against 20.64 ms
    # per llama-1b LoRA step): a GPU backend goes without
    from pockjax.transforms import low_rank

    cfg, graphdef, params, batch = _tiny()
    scheme = pockjax.UpdateScheme({ATTN: pockjax.lora(4, alpha=8)})
    p = pockjax.add_adapters(params, scheme)
    tx = optax.sgd(0.1)

    def barriers(passes=None):
        step = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=scheme, passes=passes)
        eqns = step.lower(p, pockjax.init_opt_state(tx, p, scheme), batch).graph.jaxpr.eqns
        return sum(e.primitive.name == "optimization_barrier" for e in eqns)

    assert barriers() == 4 * cfg.n_layers
    monkeypatch.setattr(low_rank.jax, "default_backend", lambda: "gpu")
    assert barriers() == 0
    # an IREE module gets it whatever backend compiles it (an arm64 module built on a GPU host)
    iree = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=scheme, target="cpu")
    eqns = iree.lower(p, pockjax.init_opt_state(tx, p, scheme), batch).graph.jaxpr.eqns
    assert sum(e.primitive.name == "optimization_barrier" for e in eqns) == 4 * cfg.n_layers
    # forced, as the benchmark does
    assert barriers(pockjax.default_passes(scheme, sparse_opt_state=True, rank_first_barrier=True)) == 4 * cfg.n_layers


def test_a_non_product_reader_gets_the_dense_value_once():
    scheme = pockjax.UpdateScheme({"w": pockjax.lora(2)})
    p = pockjax.add_adapters({"w": jnp.linspace(-1, 1, 32).reshape(8, 4)}, scheme)
    p["w"].lora_b = jnp.full((2, 4), 0.1)
    tx = optax.sgd(0.1)

    def step(p, s, x):
        loss = lambda p: jnp.sum(jnp.tanh(x @ p["w"])) + jnp.sum(jnp.asarray(p["w"]) ** 2)  # noqa: E731
        g = jax.grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, None

    x = jnp.ones((3, 8))
    compiled = pockjax.compile(step, scheme=scheme)
    state = pockjax.init_opt_state(tx, p, scheme)
    record = compiled.lower(p, state, x).graph.record(pockjax.LowRankRecord)
    assert record.dense >= 1 and record.factored_products >= 1

    def masked(p, x):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])) + jnp.sum(jnp.asarray(p["w"]) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    ref = jax.jit(masked)(p, x)
    base = np.asarray(p["w"].base)
    out, _, _ = compiled(p, state, x)
    np.testing.assert_allclose(np.asarray(out["w"].lora_a), np.asarray(ref["w"].lora_a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["w"].lora_b), np.asarray(ref["w"].lora_b), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["w"].base), base)  # frozen


def test_quantized_base_trains_its_adapter():
    cfg, graphdef, params, batch = _tiny()
    scheme = pockjax.UpdateScheme({ATTN: pockjax.lora(4)})
    p = pockjax.add_adapters(params, scheme)
    p = jax.tree.map(lambda t: LoraTensor(quant.quantize(t.base, "q8_0"), t.lora_a, t.lora_b, scale=t.scale)
                     if isinstance(t, LoraTensor) else t, p, is_leaf=lambda t: isinstance(t, LoraTensor))
    tx = optax.adam(3e-2)
    step = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=scheme)
    state = pockjax.init_opt_state(tx, p, scheme)
    losses = []
    for _ in range(4):
        p, state, loss = step(p, state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    kernel = p["layers"][0]["attn"]["wq"]["kernel"]
    assert quant.is_qtensor(kernel.base)
    merged = merge(p)["layers"][0]["attn"]["wq"]["kernel"]
    assert merged.dtype == jnp.float32 and not quant.is_qtensor(merged)


def test_an_nnx_step_with_an_adapter_is_refused_by_name():
    # it was refused as a variable "holding 3 arrays", to be split into one variable per array
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    scheme = pockjax.UpdateScheme({"kernel": pockjax.lora(2), "bias": "full"})
    nnx.update(model, pockjax.add_adapters(nnx.state(model, nnx.Param), scheme))

    def step(model, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        return loss

    with pytest.raises(pockjax.StepSignatureError, match="holds a LoRA adapter .*functional steps"):
        pockjax.compile(step, scheme=scheme)(model, jnp.ones((2, 4)))


def test_an_adapted_weight_reads_as_an_array_in_the_users_own_code():
    # w.T, w.reshape, w.astype, 2 * w on a LoraTensor failed with a bare AttributeError/TypeError
    # in the user's loss (tied or transposed weights); now they read as jnp.asarray(w) does, the
    # transposed product still from the factors
    scheme = pockjax.UpdateScheme({"w": pockjax.lora(2, alpha=4), "v": "full"})
    params = {"w": jax.random.normal(jax.random.key(0), (8, 8)) / 4, "v": jnp.ones((8, 1)) / 8}
    p = pockjax.add_adapters(params, scheme)
    p["w"].lora_b = jnp.full_like(p["w"].lora_b, 0.1)  # a nonzero delta, so that its sign matters
    x, y = jax.random.normal(jax.random.key(1), (4, 8)), jnp.ones((4, 1))
    tx = optax.adam(1e-2)

    def step(q, s, x, y):
        def loss(r):
            w = r["w"]
            h = jnp.tanh(x @ w.T) + 0.5 * w.astype(jnp.float32).reshape(64)[:8] + (2 * w).sum() / 64
            return jnp.mean((h @ r["v"] - y) ** 2)
        value, g = jax.value_and_grad(loss)(q)
        u, s = tx.update(g, s, q)
        return optax.apply_updates(q, u), s, value

    f = pockjax.compile(step, scheme=scheme)
    state = pockjax.init_opt_state(tx, p, scheme)
    assert f.lower(p, state, x, y).graph.record(pockjax.LowRankRecord).factored_products >= 1
    dense = lambda q: q["w"].base + 2.0 * q["w"].lora_a @ q["w"].lora_b  # noqa: E731  scale = alpha / rank
    w = dense(p)
    want = jnp.mean(((jnp.tanh(x @ w.T) + 0.5 * w.reshape(64)[:8] + (2 * w).sum() / 64) @ p["v"] - y) ** 2)
    got = f(jax.tree.map(jnp.copy, p), state, x, y)[2]
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_adapters_the_loss_never_reads_are_refused():
    # a loss over a copy of the original weights trained nothing: the adapters' gradient was zero,
    # the run went on without a word
    scheme = pockjax.UpdateScheme({"w": pockjax.lora(2), "v": "full"})
    original = {"w": jnp.ones((8, 8)) / 8, "v": jnp.ones((8, 1))}
    p = pockjax.add_adapters(jax.tree.map(jnp.copy, original), scheme)
    tx = optax.adam(0.1)

    def step(q, s, x):
        value, g = jax.value_and_grad(lambda r: jnp.sum(jnp.tanh(x @ original["w"]) @ r["v"]))(q)
        u, s = tx.update(g, s, q)
        return optax.apply_updates(q, u), s, value

    with pytest.raises(pockjax.SchemeError, match=r"LoRA adapters on 'w', but .*step's loss never reads them"):
        pockjax.compile(step, scheme=scheme)(p, pockjax.init_opt_state(tx, p, scheme), jnp.ones((2, 8)))


def test_a_pattern_that_also_adapts_an_unused_tensor_warns_and_trains_the_rest():
    # "*.kernel": lora(...) over a model whose loss skips one module (a pooler): a warning naming
    # it, not a refusal; the adapters that are read train
    scheme = pockjax.UpdateScheme({"*.kernel": pockjax.lora(2), "v": "full"})
    params = {"used": {"kernel": jnp.ones((8, 8)) / 8}, "pooler": {"kernel": jnp.ones((8, 8))}, "v": jnp.ones((8, 1))}
    p = pockjax.add_adapters(params, scheme)
    p["used"]["kernel"].lora_b = jnp.full_like(p["used"]["kernel"].lora_b, 0.1)
    tx = optax.adam(0.1)

    def step(q, s, x):
        value, g = jax.value_and_grad(lambda r: jnp.sum(jnp.tanh(x @ r["used"]["kernel"]) @ r["v"]))(q)
        u, s = tx.update(g, s, q)
        return optax.apply_updates(q, u), s, value

    with pytest.warns(UserWarning, match=r"LoRA adapters on 'pooler.kernel' are never read"):
        new = pockjax.compile(step, scheme=scheme)(p, pockjax.init_opt_state(tx, p, scheme), jnp.ones((2, 8)))[0]
    assert not np.allclose(np.asarray(new["used"]["kernel"].lora_b), 0.1)  # trained

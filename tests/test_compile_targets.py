"""pockjax.compile(..., target=...): the IREE-compiled sparse step equals the XLA one."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax
from toy_models import Transformer, make_step

MODEL = Transformer(layers=2)
SCHEME = pockjax.UpdateScheme({"layers.1.attn.*.kernel": "full", "layers.1.mlp.w1.kernel": pockjax.channels(0.5)})


def _run(step, params, opt_state, batches):
    losses = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, b)
        losses.append(float(np.asarray(loss)))
    return params, opt_state, losses


@pytest.mark.parametrize("target", ["cpu", "dsp"])
def test_iree_target_matches_xla(target):
    tx = optax.adamw(1e-2)
    params = MODEL.init(jax.random.key(0))
    batches = [MODEL.batch(jax.random.key(i)) for i in range(3)]
    xla = pockjax.compile(make_step(MODEL, tx), scheme=SCHEME)
    iree = pockjax.compile(make_step(MODEL, tx), scheme=SCHEME, target=target)
    assert iree.backend == f"iree:{target}"
    p1, s1, l1 = _run(xla, jax.tree.map(jnp.copy, params), tx.init(params), batches)
    p2, s2, l2 = _run(iree, params, tx.init(params), batches)
    np.testing.assert_allclose(l2, l1, rtol=1e-4)
    for a, b in zip(jax.tree.leaves((p2, s2)), jax.tree.leaves((p1, s1))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # frozen parameters are untouched
    np.testing.assert_array_equal(np.asarray(p2["layers"]["0"]["mlp"]["w2"]["kernel"]), params["layers"]["0"]["mlp"]["w2"]["kernel"])


def test_iree_step_uploads_frozen_weights_once():
    """A frozen weight the step forwards unchanged is the same jax.Array next call: not uploaded again.

    A different array (or a NumPy array, which can change in place) is uploaded, and the step uses it.
    """
    tx = optax.adamw(1e-2)
    params = MODEL.init(jax.random.key(0))
    batches = [MODEL.batch(jax.random.key(i)) for i in range(3)]
    step = pockjax.compile(make_step(MODEL, tx), scheme=SCHEME, target="cpu")
    xla = pockjax.compile(make_step(MODEL, tx), scheme=SCHEME)
    p, s, _ = step(params, tx.init(params), batches[0])
    exe = step.lower(params, tx.init(params), batches[0]).compile().executable.exe
    n_batch = len(jax.tree.leaves(batches[0]))
    uploads = []
    put = exe.session.put
    exe.session.put = lambda a: (uploads.append(np.shape(a)), put(a))[1]
    p, s, _ = step(p, s, batches[1])
    assert len(uploads) == n_batch  # trainable state came back as device buffers, frozen weights are cached
    # A new array for one frozen weight is uploaded and used, as it is on the XLA step.
    w2 = jnp.asarray(p["layers"]["0"]["mlp"]["w2"]["kernel"]) * 2.0
    p_new = jax.tree.map(lambda x: x, p)
    p_new["layers"]["0"]["mlp"]["w2"]["kernel"] = w2
    ref = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), (p_new, s))
    uploads.clear()
    _, _, got = step(p_new, s, batches[2])
    assert len(uploads) == n_batch + 1
    _, _, want = xla(*ref, batches[2])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4)
    # A NumPy array is uploaded on every call: the caller may have written into it.
    w2_np = np.array(w2)
    p_new["layers"]["0"]["mlp"]["w2"]["kernel"] = w2_np
    for _ in range(2):
        uploads.clear()
        step(p_new, s, batches[2])
        assert len(uploads) == n_batch + 1


def test_export_and_continue_in_runtime(tmp_path):
    from pockjax import runtime

    tx = optax.sgd(0.1)
    params = MODEL.init(jax.random.key(0))
    opt_state = tx.init(params)
    batch = MODEL.batch(jax.random.key(1))
    step = pockjax.compile(make_step(MODEL, tx), scheme=SCHEME, target="cpu")
    path = step.export(tmp_path / "step", params, opt_state, batch)
    module = runtime.load(path)
    xla = pockjax.compile(make_step(MODEL, tx), scheme=SCHEME)
    p, s = params, opt_state
    for i in range(2):
        p, s, want = xla(p, s, batch)
        got = module.step(*[np.asarray(x) for x in jax.tree.leaves(batch)])
        np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-4)


def test_unknown_target_and_xla_only_analyses():
    with pytest.raises(pockjax.BackendError, match="unknown target 'tpu'"):
        pockjax.compile(lambda p, s: (p, s), target="tpu")
    tx = optax.sgd(0.1)
    params = MODEL.init(jax.random.key(0))
    step = pockjax.compile(make_step(MODEL, tx), scheme=SCHEME)
    with pytest.raises(pockjax.BackendError, match="only IREE-compiled steps export"):
        step.export("/tmp/never", params, tx.init(params), MODEL.batch(jax.random.key(1)))


def test_cli_export_tiny_llama_runs_in_runtime(tmp_path):
    from pockjax import runtime
    from pockjax.cli import main

    out = tmp_path / "tiny-dsp"
    assert main(["export", "--model", "tiny", "--scheme", "paper", "--blocks", "1", "--target", "dsp",
                 "--seq-len", "16", "--out", str(out)]) == 0
    module = runtime.load(out)
    tokens = np.ones((1, 16), np.int32)
    losses = [float(np.asarray(module.step(tokens, tokens, np.ones((1, 16), np.float32))[0])) for _ in range(3)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_cli_export_of_the_lora_scheme_runs_in_runtime_as_xla_computes_it(tmp_path):
    """``pockjax export --scheme lora`` adds the adapters ``pockjax finetune`` adds (it refused
    the scheme before): the module's steps equal the XLA-compiled LoRA step's. Over held frozen
    weights too (``--quantize int8``: the LoRA bases block-quantized, as finetune holds them)."""
    from flax import nnx

    from pockjax import runtime
    from pockjax.adapters import add_adapters
    from pockjax.cli import main
    from pockjax.models import llama
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import lm_train_step

    held = tmp_path / "tiny-lora-int8"
    assert main(["export", "--model", "tiny", "--scheme", "lora", "--quantize", "int8", "--target", "cpu",
                 "--seq-len", "16", "--out", str(held)]) == 0
    inputs = {i["name"]: i["dtype"] for i in json.loads((held / "module.json").read_text())["inputs"]}
    assert inputs["layers.0.attn.wq.kernel.base.q"] == "int8" and inputs["layers.0.attn.wq.kernel.lora_a"] == "float32"
    tokens = np.ones((1, 16), np.int32)
    losses = [float(np.asarray(runtime.load(held).step(tokens, tokens, np.ones((1, 16), np.float32))[0]))]
    assert np.isfinite(losses).all()

    out = tmp_path / "tiny-lora"
    assert main(["export", "--model", "tiny", "--scheme", "lora", "--target", "cpu", "--seq-len", "16",
                 "--lr", "0.01", "--out", str(out)]) == 0
    module = runtime.load(out)
    tokens = (np.arange(16, dtype=np.int32) % 7)[None]
    mask = np.ones((1, 16), np.float32)
    got = [float(np.asarray(module.step(tokens, tokens, mask)[0])) for _ in range(3)]

    model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    graphdef, params = llama.split(model)
    scheme = llama_scheme("lora", model.config)
    params = add_adapters(params, scheme)
    tx = optax.adamw(0.01)
    step = pockjax.compile(lm_train_step(graphdef, tx), scheme=scheme)
    opt_state, want = pockjax.init_opt_state(tx, params, scheme), []
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens), jnp.asarray(tokens), jnp.asarray(mask))
        want.append(float(loss))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[-1] < want[0]  # the adapters train


def test_iree_compile_cache_reuses_only_the_same_module_and_flags(tmp_path, monkeypatch):
    import iree.compiler as ic

    from pockjax.backends.iree.lowering import compile_stablehlo, export_stablehlo

    monkeypatch.setenv("POCKJAX_IREE_CACHE_DIR", str(tmp_path / "cache"))
    text = export_stablehlo(lambda x: (x * 2.0,), [jax.ShapeDtypeStruct((4,), jnp.float32)])
    calls = []
    real = ic.compile_str
    monkeypatch.setattr(ic, "compile_str", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = compile_stablehlo(text, "cpu")
    assert compile_stablehlo(text, "cpu") == first and len(calls) == 1   # read back, not compiled again
    assert len(list((tmp_path / "cache").iterdir())) == 1
    compile_stablehlo(text, "cpu", extra_flags=["--iree-opt-level=O1"])  # other flags: compiled
    compile_stablehlo(text.replace("2.0", "3.0"), "cpu")                # other module: compiled
    assert len(calls) == 3 and len(list((tmp_path / "cache").iterdir())) == 3
    monkeypatch.delenv("POCKJAX_IREE_CACHE_DIR")
    compile_stablehlo(text, "cpu")                                       # no cache: always compiled
    assert len(calls) == 4


def test_python_numbers_take_the_traced_dtype_on_iree():
    # TrainState.create leaves step=0 a Python int: jax.jit gives it a weak int32 type, the
    # IREE step refused it ("expected dtype int32, got int64"). A Python float batch
    # argument (a learning-rate scale) is float32 there too.
    import flax.linen as nn
    from flax.training import train_state

    dense = nn.Dense(4)
    x = jnp.ones((2, 8))
    params = dense.init(jax.random.key(0), x)["params"]

    def step(state, x, scale):
        loss, g = jax.value_and_grad(lambda p: scale * jnp.sum(state.apply_fn({"params": p}, x) ** 2))(state.params)
        return state.apply_gradients(grads=g), loss

    scheme = pockjax.UpdateScheme({"bias": "full"})
    out = {}
    for target in (None, "cpu"):
        st = train_state.TrainState.create(apply_fn=dense.apply, params=jax.tree.map(jnp.copy, params),
                                           tx=optax.sgd(0.1))
        assert type(st.step) is int
        f = pockjax.compile(step, scheme=scheme, target=target)
        for _ in range(2):
            st, loss = f(st, x, 0.5)
        out[target] = (int(np.asarray(st.step)), float(np.asarray(loss)), np.asarray(st.params["bias"]))
    assert out["cpu"][0] == out[None][0] == 2
    assert out["cpu"][1] == pytest.approx(out[None][1], rel=1e-5)
    np.testing.assert_allclose(out["cpu"][2], out[None][2], atol=1e-6)


def test_a_scan_reading_a_shared_weight_compiles_on_iree():
    # The scan's body reads a bias from outside the loop, and its result meets another
    # branch of the model in the loss. IREE 3.13 failed on the backward ("circular
    # dependency: input operation uses partition output"), for plain jax.jit's program too;
    # compile_flat retries with every scan unrolled.
    tx = optax.adam(1e-2)
    k = jax.random.split(jax.random.key(4), 4)
    params = {"w1": jax.random.normal(k[0], (16, 32)) * 0.3, "w2": jax.random.normal(k[1], (32, 8)) * 0.3,
              "b": jnp.zeros(8)}
    x, y, xs = jax.random.normal(k[2], (4, 16)), jax.random.normal(k[3], (4, 8)), jnp.full((2, 8), 0.1)

    def step(p, s, x, y, xs):
        def loss(p):
            c, _ = jax.lax.scan(lambda c, v: (jnp.tanh(c + p["b"] + v), None), jnp.zeros((4, 8)), xs)
            return jnp.mean((x @ p["w1"] @ p["w2"] + c - y) ** 2)
        loss_value, g = jax.value_and_grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss_value

    scheme = pockjax.UpdateScheme({"w2": "full", "b": "full"})
    xla = pockjax.compile(step, scheme=scheme)
    iree = pockjax.compile(step, scheme=scheme, target="cpu")
    px, sx = jax.tree.map(jnp.copy, params), pockjax.init_opt_state(tx, params, scheme)
    pi, si = jax.tree.map(jnp.copy, params), pockjax.init_opt_state(tx, params, scheme)
    for _ in range(3):
        px, sx, lx = xla(px, sx, x, y, xs)
        pi, si, li = iree(pi, si, x, y, xs)
        assert float(np.asarray(li)) == pytest.approx(float(lx), rel=1e-5)
    for a, b in zip(jax.tree.leaves(pi), jax.tree.leaves(px)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    module = iree.lower(params, pockjax.init_opt_state(tx, params, scheme), x, y, xs).compile().executable.exe
    assert "unroll-scans" in module.metadata.target["workarounds"]


def test_a_python_number_that_would_change_value_is_refused():
    # the compiled step traces a new signature for a float where an int was traced (as jax.jit
    # does); called with the module's own signature, the float is refused, not truncated
    from pockjax.backends.iree.executable import _python_scalar_as
    from pockjax.runtime.metadata import InputError, TensorSpec

    count = TensorSpec(name="state.step", shape=(), dtype="int32", role="state")
    assert _python_scalar_as(count, 3).dtype == np.int32
    assert _python_scalar_as(TensorSpec(name="lr", shape=(), dtype="float32", role="input"), 1).dtype == np.float32
    with pytest.raises(InputError, match="'state.step' was traced as int32, but the call passes the Python float 1.7"):
        _python_scalar_as(count, 1.7)
    with pytest.raises(InputError, match="Python complex"):
        _python_scalar_as(TensorSpec(name="lr", shape=(), dtype="float32", role="input"), 1j)


def test_apply_if_finite_adam_runs_on_iree_like_jax_jit():
    # its skipped update returns the state and the count unchanged from a cond: IREE compiled the
    # step, and every call failed at run time ("ref is null; ... hal.buffer_view.create"), finite
    # inputs too; the cond-as-select workaround computes both branches and selects
    tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
    params = {"w": jnp.linspace(-1, 1, 24).reshape(6, 4), "b": jnp.zeros(4)}

    def make(frozen_b):
        def step(p, s, x, y):
            def loss(q):
                b = jax.lax.stop_gradient(q["b"]) if frozen_b else q["b"]
                return jnp.mean((x @ q["w"] + b - y) ** 2)
            value, g = jax.value_and_grad(loss)(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, value
        return step

    x, y = jnp.ones((5, 6)), jnp.zeros((5, 4))
    iree = pockjax.compile(make(False), scheme=pockjax.UpdateScheme({"w": "full"}), target="cpu")
    ref = jax.jit(make(True))
    p, s, q, t = params, tx.init(params), jax.tree.map(jnp.copy, params), tx.init(params)
    for batch in (x, x.at[0, 0].set(jnp.nan), x):  # the second step is skipped
        p, s, _ = iree(p, s, batch, y)
        q, t, _ = ref(q, t, batch, y)
        q = {**q, "b": params["b"]}
        for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((q, t))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert int(np.asarray(s.total_notfinite)) == 1


def test_state_read_back_from_an_iree_step_is_read_only():
    # its host copy was writable and cached: an edit showed in later reads, but the next step
    # read the device buffer as it was (0.2 where jax.jit from the edited values gives -0.4)
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((2, 3))}

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda q: jnp.sum(x @ q["w"]))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    new, _, _ = pockjax.compile(step, target="cpu")(params, tx.init(params), jnp.ones((4, 2)))
    host = np.asarray(new["w"])
    assert not host.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        host[:] = 0.0
    mine = np.array(new["w"])  # a copy to edit
    mine[:] = 0.0
    assert mine.flags.writeable and float(np.asarray(new["w"])[0, 0]) == pytest.approx(0.6)

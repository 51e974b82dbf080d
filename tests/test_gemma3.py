"""Gemma 3: parity with transformers' Gemma3ForCausalLM (small random models and the real 270M),
GGUF loading as llama.cpp converts it, the SentencePiece tokenizer against llama.cpp, and finetune."""

import json
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx


from pockjax.io.gguf import Typed, write_gguf
from pockjax.models import llama
from pockjax.models.llama.export import ExportError, gguf_tokenizer_metadata, save_gguf
from pockjax.models.llama.spm import SentencePieceBPE
from pockjax.models.llama.tokenizer import GEMMA_CHAT_TEMPLATE

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
IDS = [[2, 5, 9, 22, 7, 3, 64, 1, 100, 31, 17], [2, 8, 8, 40, 41, 42, 7, 99, 12, 0, 5]]
# both kinds of layer, a sliding one last (the rows path of answer_loss), a window below the length
LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]


def _hf_gemma3(layers=LAYER_TYPES, query_pre_attn_scalar=24, seed=0, linear_rope=None):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    extra = {} if linear_rope is None else {"rope_parameters": {  # Gemma 3 4B-27B: the full layers' positions / 8
        "full_attention": {"rope_type": "linear", "factor": linear_rope, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layers),
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # head_dim != 64 / 4
                              sliding_window=3, query_pre_attn_scalar=query_pre_attn_scalar,
                              layer_types=list(layers), max_position_embeddings=64, **extra)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norm weights are zeros at init: make them matter
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.1))
    return model


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A random 4-layer Gemma3ForCausalLM saved by transformers, and its logits on IDS."""
    model = _hf_gemma3()
    with torch.no_grad():
        ref = model(torch.tensor(IDS)).logits.numpy()
    d = str(tmp_path_factory.mktemp("gemma3"))
    model.save_pretrained(d)
    return d, ref


@pytest.mark.parametrize("scan_layers", [False, True])
def test_small_gemma3_matches_transformers(small, scan_layers):
    d, ref = small
    model = llama.load_hf_checkpoint(d, scan_layers=scan_layers)
    cfg = model.config
    assert cfg.arch == "gemma3" and cfg.layer_types == tuple(LAYER_TYPES) and cfg.sliding_window == 3
    assert cfg.head_dim_ == 32 and cfg.query_pre_attn_scalar == 24 and cfg.rope_local_theta == 10000.0
    ours = np.asarray(model(jnp.array(IDS)))
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    # the loss's path: the last (sliding) block on a window of rows only
    rows = jnp.array([[3, 7, 10]] * 2)
    np.testing.assert_allclose(np.asarray(model.logits_from_hidden(model.hidden_states(jnp.array(IDS), rows=rows))),
                               ref[:, [3, 7, 10]], atol=1e-4)


def test_small_gemma3_decodes_with_a_kv_cache(small):
    d, ref = small
    model = llama.load_hf_checkpoint(d)
    toks = jnp.array(IDS)
    cache = llama.init_cache(model.config, 2, 16)
    valid = jnp.arange(16)[None].repeat(2, 0) < toks.shape[1]
    pos = jnp.arange(toks.shape[1])[None].repeat(2, 0)
    step = nnx.jit(lambda m, t, p, c, i: m.decode(t, p, c, i, valid))
    logits, cache = step(model, toks[:, :6], pos[:, :6], cache, 0)
    steps = [logits]
    for i in range(6, toks.shape[1]):  # one token at a time: the window slides over the cache
        logits, cache = step(model, toks[:, i:i + 1], pos[:, i:i + 1], cache, jnp.int32(i))
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), ref, atol=1e-4)


def test_gemma3_saves_as_a_transformers_checkpoint(small, tmp_path):
    from transformers import Gemma3ForCausalLM

    d, ref = small
    out = str(tmp_path / "hf")
    llama.save_hf_checkpoint(llama.load_hf_checkpoint(d), out)
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "gemma3_text"
    with torch.no_grad():
        theirs = Gemma3ForCausalLM.from_pretrained(out).eval()(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, ref, atol=1e-4)


def _gguf_from_hf(model, path, **extra_meta):
    """A GGUF file of a transformers Gemma 3, written the way llama.cpp's convert_hf_to_gguf.py
    (Gemma3Model) does: every norm weight + 1, Q/K rows as they are, llama.cpp's tensor names."""
    c = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    meta = {"general.architecture": "gemma3",
            "gemma3.context_length": Typed("u32", c.max_position_embeddings),
            "gemma3.embedding_length": Typed("u32", c.hidden_size),
            "gemma3.block_count": Typed("u32", c.num_hidden_layers),
            "gemma3.feed_forward_length": Typed("u32", c.intermediate_size),
            "gemma3.attention.head_count": Typed("u32", c.num_attention_heads),
            "gemma3.attention.layer_norm_rms_epsilon": Typed("f32", c.rms_norm_eps),
            "gemma3.attention.key_length": Typed("u32", c.head_dim),
            "gemma3.attention.value_length": Typed("u32", c.head_dim),
            "gemma3.rope.freq_base": Typed("f32", c.rope_parameters["full_attention"]["rope_theta"]),
            "gemma3.attention.sliding_window": Typed("u32", c.sliding_window),
            "gemma3.attention.head_count_kv": Typed("u32", c.num_key_value_heads), **extra_meta}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = []
    for k, w in sd.items():
        if k == "lm_head.weight":
            continue  # tied
        if "norm" in k:
            w = w + np.float32(1)
        if k == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif k == "model.norm.weight":
            name = "output_norm.weight"
        else:
            i, rest = k[len("model.layers."):].split(".", 1)
            name = f"blk.{i}.{names[rest.rsplit('.', 1)[0]]}.weight"
        tensors.append((name, "F32", w.shape, np.ascontiguousarray(w)))
    write_gguf(path, meta, tensors)


@pytest.fixture(scope="module")
def six_layers():
    """llama.cpp's Gemma 3 layout: 6 layers, the 6th full attention; scores scaled by 1/sqrt(head_dim)."""
    model = _hf_gemma3(layers=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=32, seed=1)
    with torch.no_grad():
        return model, model(torch.tensor(IDS)).logits.numpy()


def test_gguf_as_llama_cpp_converts_it_matches_transformers(six_layers, tmp_path):
    model, ref = six_layers
    path = str(tmp_path / "g.gguf")
    _gguf_from_hf(model, path)
    ours = llama.load_gguf(path)
    cfg = ours.config
    assert cfg.arch == "gemma3" and cfg.is_sliding(0) and not cfg.is_sliding(5)
    assert cfg.rope_local_theta == 10000.0 and cfg.query_pre_attn_scalar == 32
    np.testing.assert_allclose(np.asarray(ours(jnp.array(IDS))), ref, atol=1e-4)


def test_linear_rope_scaling_of_the_full_layers_matches_transformers(tmp_path):
    model = _hf_gemma3(layers=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=32, seed=2,
                       linear_rope=8.0)
    with torch.no_grad():
        ref = model(torch.tensor(IDS)).logits.numpy()
    d = str(tmp_path / "hf")
    model.save_pretrained(d)
    for scan in (False, True):
        ours = llama.load_hf_checkpoint(d, scan_layers=scan)
        assert ours.config.rope_scaling == ("linear", 8.0)
        np.testing.assert_allclose(np.asarray(ours(jnp.array(IDS))), ref, atol=1e-4)
    plain = llama.load_hf_checkpoint(d, rope_scaling=None)  # the scaling matters here
    assert np.abs(np.asarray(plain(jnp.array(IDS))) - ref).max() > 1e-2
    # decoding one token at a time with a KV cache scales the same positions
    cache = llama.init_cache(ours.config, 2, 16)
    valid = jnp.arange(16)[None].repeat(2, 0) < len(IDS[0])
    logits, cache = ours.decode(jnp.array(IDS)[:, :10], jnp.arange(10)[None].repeat(2, 0), cache, 0, valid)
    last, _ = ours.decode(jnp.array(IDS)[:, 10:], jnp.full((2, 1), 10), cache, jnp.int32(10), valid)
    np.testing.assert_allclose(np.asarray(last)[:, -1], ref[:, -1], atol=1e-4)
    # written back: a Hugging Face directory transformers reads, and GGUF as llama.cpp reads it
    out = str(tmp_path / "out")
    llama.save_hf_checkpoint(ours, out)
    full = json.load(open(os.path.join(out, "config.json")))["rope_parameters"]["full_attention"]
    assert full["rope_type"] == "linear" and full["factor"] == 8.0
    from transformers import Gemma3ForCausalLM

    with torch.no_grad():
        again = Gemma3ForCausalLM.from_pretrained(out).eval()(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(again, ref, atol=1e-4)
    path = str(tmp_path / "g.gguf")
    save_gguf(ours, llama.Tokenizer(SentencePieceBPE.for_tests(), bos_id=None, eos_id=1), path, quant="f32")
    back = llama.load_gguf(path)
    assert back.config == ours.config.replace(scan_layers=False)
    np.testing.assert_allclose(np.asarray(back(jnp.array(IDS))), ref, atol=1e-4)


def test_unsupported_gemma_files_name_their_key(six_layers, tmp_path):
    model, _ = six_layers
    path = str(tmp_path / "capped.gguf")
    _gguf_from_hf(model, path, **{"gemma3.final_logit_softcapping": Typed("f32", 30.0)})
    with pytest.raises(llama.UnsupportedModelError, match="gemma3.final_logit_softcapping"):
        llama.load_gguf(path)
    path = str(tmp_path / "g2.gguf")
    write_gguf(path, {"general.architecture": "gemma2"}, [])
    with pytest.raises(llama.UnsupportedModelError, match="GGUF architecture 'gemma2' is not supported"):
        llama.load_gguf(path)
    d = str(tmp_path / "hf")
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, f)
    with pytest.raises(llama.UnsupportedModelError, match="final_logit_softcapping=30.0"):
        llama.read_hf_checkpoint(d)


@pytest.mark.parametrize("quant, tol", [("f32", 1e-6), ("f16", 5e-3)])
def test_gemma3_exports_to_gguf_and_reads_back(six_layers, tmp_path, quant, tol):
    model, _ = six_layers
    src = str(tmp_path / "src.gguf")
    _gguf_from_hf(model, src)
    ours = llama.load_gguf(src)
    tok = llama.Tokenizer(SentencePieceBPE.for_tests(), bos_id=None, eos_id=1, chat_template=GEMMA_CHAT_TEMPLATE)
    path = str(tmp_path / f"out.{quant}.gguf")
    save_gguf(ours, tok, path, quant=quant)
    back = llama.load_gguf(path)
    assert back.config == ours.config
    a, b = np.asarray(ours(jnp.array(IDS))), np.asarray(back(jnp.array(IDS)))
    assert np.abs(a - b).max() <= tol * np.abs(a).max(), (quant, np.abs(a - b).max())
    back_tok = llama.load_tokenizer(path)
    assert back_tok.vocab_size == ours.config.vocab  # padded with unused tokens, one per embedding row
    for text in ["ab ab", "ba ab\n\nb", "é ab", "<eos>ab"]:
        assert back_tok.encode(text) == tok.encode(text)
    assert back_tok.chat_template == GEMMA_CHAT_TEMPLATE and back_tok.eos_id == 1


def test_gemma3_gguf_export_refuses_what_llama_cpp_would_run_differently(six_layers, tmp_path):
    tok = llama.Tokenizer(SentencePieceBPE.for_tests(), bos_id=None, eos_id=1)
    model = nnx.eval_shape(lambda: llama.Llama(llama.LlamaConfig.tiny_gemma3(), rngs=nnx.Rngs(0)))
    with pytest.raises(ExportError, match="not llama.cpp's fixed pattern.*query_pre_attn_scalar 24.0.*safetensors"):
        save_gguf(model, tok, str(tmp_path / "m.gguf"))
    src = str(tmp_path / "src.gguf")
    _gguf_from_hf(six_layers[0], src)
    cfg = llama.load_gguf(src).config.replace(rope_local_theta=20000.0)
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ExportError, match="RoPE base 20000.0 is not llama.cpp's 10000.0"):
        save_gguf(model, tok, str(tmp_path / "m.gguf"))
    assert not os.path.exists(str(tmp_path / "m.gguf"))


# -- the SentencePiece tokenizer -------------------------------------------------------------


def test_sentencepiece_merges_by_score_and_falls_back_to_bytes():
    spm = SentencePieceBPE.for_tests()
    assert spm.encode("ab ab").ids == [9, 10]            # ab, then ▁ab (score -5) over nothing else
    assert spm.encode("ba").ids == [11]
    assert spm.encode("é").ids == [2, 3]                 # no piece: the UTF-8 bytes
    assert spm.encode("a\n\nb<eos>").ids == [4, 8, 5, 1]  # user-defined and control tokens cut out first
    prefixed = SentencePieceBPE(spm.tokens, spm.scores, spm.types, add_space_prefix=True, unk_id=0)
    assert prefixed.encode("ab").ids == [10]             # LLaMA-2: " ab"
    assert prefixed.decode(prefixed.encode("ab ab").ids) == "ab ab"


def test_spm_tokenizer_saves_as_an_equivalent_tokenizer_json(tmp_path):
    spm = SentencePieceBPE.for_tests()
    tok = llama.Tokenizer(spm, bos_id=None, eos_id=1, chat_template=GEMMA_CHAT_TEMPLATE)
    tok.save(str(tmp_path))
    back = llama.load_tokenizer(str(tmp_path))
    for text in ["ab ab", "ba ab\n\nb", "é ab", "<eos>ab"]:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert back.render_chat([{"role": "user", "content": "a"}]) == "<start_of_turn>user\na<end_of_turn>\n" \
        "<start_of_turn>model\n"


def test_spm_vocabulary_file_guards(tmp_path):
    spm = SentencePieceBPE.for_tests()
    d = str(tmp_path / "tok")
    llama.Tokenizer(spm, bos_id=None, eos_id=1).save(d)
    spm_file = os.path.join(d, "sentencepiece_vocab.json")
    assert type(llama.load_tokenizer(d).backend) is SentencePieceBPE
    # tokenizer.json alone is a SentencePiece model known by merges only: loads, but GGUF needs the scores
    os.rename(spm_file, spm_file + ".away")
    merges_only = llama.load_tokenizer(d)
    assert merges_only.encode("ab ab") == [9, 10]
    with pytest.raises(ExportError, match="known only by its merges"):
        gguf_tokenizer_metadata(merges_only)
    # a vocabulary file that is not tokenizer.json's is refused, not used
    with open(spm_file + ".away") as f:
        spec = json.load(f)
    spec["tokens"][9], spec["tokens"][10] = spec["tokens"][10], spec["tokens"][9]
    with open(spm_file, "w") as f:
        json.dump(spec, f)
    with pytest.raises(llama.TokenizerFileError, match="not those of tokenizer.json"):
        llama.load_tokenizer(d)
    spec["scores"] = spec["scores"][:-1]
    with open(spm_file, "w") as f:
        json.dump(spec, f)
    with pytest.raises(llama.TokenizerFileError, match="scores must be a list of 12 numbers"):
        llama.load_tokenizer(d)
    # saving another kind of tokenizer into the directory removes the old vocabulary file
    llama.Tokenizer.byte_level_for_tests().save(d)
    assert not os.path.exists(spm_file) and llama.load_tokenizer(d).encode("ok") == [111, 107]


def test_gguf_spm_scores_that_are_not_finite_are_refused_on_loading(tmp_path):
    """A NaN or infinite score would scramble the merge order, and the tokenizer
    could not be saved (its vocabulary file is JSON, which has no NaN): refused
    when the GGUF is read, in one line naming the file, not at the end of a run."""
    from pockjax.io.gguf import open_gguf
    from pockjax.models.llama.tokenizer import tokenizer_from_gguf

    meta = {"general.architecture": "llama",
            **gguf_tokenizer_metadata(llama.Tokenizer(SentencePieceBPE.for_tests(), bos_id=None, eos_id=1))}
    scores = list(SentencePieceBPE.for_tests().scores)
    write_gguf(tmp_path / "ok.gguf", meta, [])
    tok = tokenizer_from_gguf(open_gguf(tmp_path / "ok.gguf"))
    tok.save(str(tmp_path / "saved"))
    assert llama.load_tokenizer(str(tmp_path / "saved")).encode("ab ab") == tok.encode("ab ab")
    for bad in (float("-inf"), float("nan")):
        path = tmp_path / f"bad-{bad}.gguf"
        write_gguf(path, {**meta, "tokenizer.ggml.scores": Typed("f32", scores[:-1] + [bad])}, [])
        with pytest.raises(llama.TokenizerFileError) as e:
            tokenizer_from_gguf(open_gguf(path))
        assert str(e.value) == (f"{path}: tokenizer.ggml.scores must be a list of 12 numbers, one per token,"
                                f" none NaN or infinite")


def _gemma_gguf():
    try:
        return llama.pretrained_path("gemma3-270m")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gemma_tokenizer():
    return llama.load_tokenizer(_gemma_gguf())


def _fixture_cases():
    with open(os.path.join(FIXTURES, "gemma3_tokens.json"), encoding="utf-8") as f:
        return json.load(f)["cases"]


def test_gemma3_tokenizer_matches_llama_cpp_fixture(gemma_tokenizer):
    cases = _fixture_cases()
    assert len(cases) >= 20
    for text, ids in cases:
        assert gemma_tokenizer.encode(text, add_bos=False) == ids, text
        if "\u2581" not in text:  # a literal ▁ decodes as a space, as in llama.cpp
            assert gemma_tokenizer.decode(ids) == text
    assert gemma_tokenizer.encode("Hi")[0] == gemma_tokenizer.bos_id == 2


@pytest.mark.llamacpp
def test_gemma3_tokenizer_matches_llama_cpp(gemma_tokenizer):
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=_gemma_gguf(), vocab_only=True, verbose=False)
    for text, _ in _fixture_cases():
        assert gemma_tokenizer.encode(text, add_bos=False) == ref.tokenize(text.encode(), add_bos=False,
                                                                            special=True), text


def test_gemma3_tokenizer_writes_back_the_shipped_gguf_metadata(gemma_tokenizer, tmp_path):
    from pockjax.io.gguf import open_gguf

    src = open_gguf(_gemma_gguf()).metadata
    tok = gemma_tokenizer
    tok.save(str(tmp_path))  # as a finetune run saves it
    for t in (tok, llama.load_tokenizer(str(tmp_path))):
        meta = gguf_tokenizer_metadata(t, len(src["tokenizer.ggml.tokens"]))
        unwrap = lambda v: v.value if hasattr(v, "kind") else v  # noqa: E731
        for key in ["model", "tokens", "scores", "token_type", "bos_token_id", "eos_token_id", "unknown_token_id",
                    "padding_token_id", "add_bos_token", "add_eos_token", "add_space_prefix"]:
            got, want = unwrap(meta[f"tokenizer.ggml.{key}"]), src[f"tokenizer.ggml.{key}"]
            if key == "scores":
                np.testing.assert_array_equal(np.float32(got), np.float32(want))
            else:
                assert got == want, key
        for text, ids in _fixture_cases()[:6]:
            assert t.encode(text, add_bos=False) == ids


def test_gemma3_chat_template_and_end_of_turn(gemma_tokenizer):
    from pockjax.data.batching import encode_example, encode_turns, end_of_turn_id
    from pockjax.data.tasks import Example

    tok = gemma_tokenizer
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == [2, 105, 2364, 107, 10979, 106, 107,
                                                                             105, 4368, 107]
    assert end_of_turn_id(tok) == 106
    ids, n_prompt = encode_example(tok, Example("Hi", "Hello"))
    assert tok.decode(ids[n_prompt:]) == "Hello<end_of_turn>"
    # an earlier reply of a conversation is trained too: found in Gemma's rendering (which trims it)
    ids, n_prompt, spans = encode_turns(tok, Example("And?", "b", context=(("user", "Hi"), ("assistant", " Yo\n"))))
    assert [tok.decode(ids[s:e]) for s, e in spans] == ["Yo<end_of_turn>"] and tok.decode(ids[n_prompt:]) == "b<end_of_turn>"


# -- the real Gemma 3 270M ---------------------------------------------------------------------

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def gemma270m():
    start = time.perf_counter()
    model, tok = llama.load_pretrained(_gemma_gguf())
    return model, tok, time.perf_counter() - start


def _transformers_from(model):
    """transformers' Gemma3ForCausalLM holding pockjax's (dequantized) weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from pockjax.models.llama.hf import _hf_names

    cfg = model.config
    config = Gemma3TextConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim_,
        sliding_window=cfg.sliding_window, query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        layer_types=list(cfg.layer_types), rms_norm_eps=cfg.rms_eps, max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}})
    hf = Gemma3ForCausalLM(config)
    hf.eval()
    flat = llama.flatten_params(llama.split(model)[1])
    inverse = {target: (leaf, t) for leaf, (target, t) in _hf_names(cfg).items()}
    state = {}
    for k, v in flat.items():
        v = np.asarray(v, np.float32)
        v = v - np.float32(1) if k.endswith("norm.scale") else v  # HF stores w of (1 + w)
        if k == "embed.embedding":
            state["model.embed_tokens.weight"] = v
        elif k == "norm.scale":
            state["model.norm.weight"] = v
        else:
            _, i, rest = k.split(".", 2)
            leaf, transpose = inverse[rest]
            state[f"model.layers.{i}.{leaf}"] = v.T if transpose else v
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()},
                                             strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


def test_gemma3_270m_matches_transformers_on_the_same_weights(gemma270m):
    model, tok, _ = gemma270m
    ids = tok.encode(PROMPT)
    ours = np.asarray(model(jnp.array([ids])))[0]
    with torch.no_grad():
        ref = _transformers_from(model)(torch.tensor([ids])).logits.numpy()[0]
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-3 * scale, (np.abs(ours - ref).max(), scale)
    assert tok.decode([int(ours[-1].argmax())]) == " Berlin"


@pytest.mark.llamacpp
def test_gemma3_270m_matches_llama_cpp(gemma270m):
    llama_cpp = pytest.importorskip("llama_cpp")
    model, tok, _ = gemma270m
    ref_model = llama_cpp.Llama(model_path=_gemma_gguf(), logits_all=True, verbose=False, n_ctx=64)
    ids = tok.encode(PROMPT)
    ref_model.eval(ids)
    ref = np.array(ref_model.scores[:len(ids)])
    ours = np.asarray(model(jnp.array([ids])))[0]
    # llama.cpp multiplies with quantized activations: close, not equal
    assert min(np.corrcoef(a, b)[0, 1] for a, b in zip(ours, ref)) > 0.995
    assert ours[-1].argmax() == ref[-1].argmax()


@pytest.mark.slow
def test_finetune_runs_on_gemma3_270m_from_the_gguf(tmp_path):
    from pockjax.train.finetune import FinetuneConfig, finetune

    out = str(tmp_path / "run")
    cfg = FinetuneConfig(model=_gemma_gguf(), task="uppercase", steps=3, batch_size=2, train_examples=16,
                         eval_examples=2, eval_max_new_tokens=4, save_every=3, show=0, progress=False,
                         blocks=2, out=out)
    start = time.perf_counter()
    result = finetune(cfg, log=lambda s: None)
    print(f"finetune on Gemma 3 270M: {time.perf_counter() - start:.1f} s, losses {result.metrics['losses']}")
    losses = result.metrics["losses"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    tuned = llama.load_hf_checkpoint(out)
    assert tuned.config.arch == "gemma3" and tuned.config.layer_types == llama.LlamaConfig.gemma3_270m().layer_types
    assert llama.load_tokenizer(out).encode("Hi") == [2, 10979]
    # the tuned run, exported for llama.cpp (tests/test_llamacpp.py runs such a file in llama.cpp itself)
    from pockjax.models.llama.export import export_model

    gguf = export_model(out, str(tmp_path / "tuned.gguf"), quant="q8_0")
    back, back_tok = llama.load_pretrained(gguf)
    ids = back_tok.encode(PROMPT)
    assert ids == llama.load_tokenizer(out).encode(PROMPT)
    a, b = np.asarray(tuned(jnp.array([ids])))[0], np.asarray(back(jnp.array([ids])))[0]
    assert min(np.corrcoef(x, y)[0, 1] for x, y in zip(a, b)) > 0.999 and a[-1].argmax() == b[-1].argmax()


def test_assembled_file_is_checked_rebuilt_when_corrupt_and_bad_pieces_refused(tmp_path):
    """The cached join of the pieces is reused only while its SHA-256 holds; wrong pieces raise."""
    import hashlib

    from pockjax.errors import GGUFError
    from pockjax.models.llama.pretrained import _VERIFIED, Chunked, assemble_chunks

    pieces = []
    for name, data in (("p0", b"GGUF" + bytes(100)), ("p1", b"\x01" * 50)):
        (tmp_path / name).write_bytes(data)
        pieces.append(str(tmp_path / name))
    whole = b"GGUF" + bytes(100) + b"\x01" * 50
    entry = Chunked("m.gguf", (), hashlib.sha256(whole).hexdigest(), len(whole), "reinstall")
    cache = tmp_path / "cache"
    out = assemble_chunks(entry, pieces, cache)
    assert open(out, "rb").read() == whole
    # a corrupted cache file of the right size is found out (a new process: nothing verified yet) and rebuilt
    _VERIFIED.discard(out)
    with open(out, "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    assert open(assemble_chunks(entry, pieces, cache), "rb").read() == whole
    # a wrong piece: refused, naming the pieces and the fix, and no file is left at the cache path
    (tmp_path / "p1").write_bytes(b"\x02" * 50)
    _VERIFIED.discard(out)
    os.remove(out)
    with pytest.raises(GGUFError, match="SHA-256.*reinstall"):
        assemble_chunks(entry, pieces, cache)
    assert not os.path.exists(out)

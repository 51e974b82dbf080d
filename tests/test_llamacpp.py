"""The exported GGUF in llama.cpp itself (``make test-llamacpp`` builds llama-cpp-python; CI's
``make test`` leaves this marker out to stay under 30 minutes). Without llama-cpp-python it fails."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pockjax.models import llama
from pockjax.models.llama.export import save_gguf

pytestmark = pytest.mark.llamacpp
IDS = [1, 5, 9, 22, 7, 3, 64, 2, 100, 31]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # one embedding row per token of the test tokenizer (llama.cpp needs a row for each)
    model = llama.Llama(llama.LlamaConfig.tiny(vocab=272), rngs=nnx.Rngs(0))
    return model, llama.Tokenizer.byte_level_for_tests(), tmp_path_factory.mktemp("llamacpp")


@pytest.mark.parametrize("q, tol", [("f32", 1e-3), ("f16", 1e-3), ("q8_0", 2e-2), ("q4_0", 5e-2)])
def test_llama_cpp_computes_the_logits_pockjax_reads(tiny, q, tol):
    import llama_cpp

    model, tok, d = tiny
    path = os.path.join(d, f"m.{q}.gguf")
    save_gguf(model, tok, path, quant=q)
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(IDS)
    theirs = np.array(llm.scores[:len(IDS)])
    ours = np.asarray(llama.load_gguf(path)(jnp.array([IDS])))[0]
    scale = np.abs(ours).max()
    # llama.cpp multiplies Q8_0/Q4_0 weights with activations it quantizes to 8 bits itself
    assert np.abs(theirs - ours).max() <= tol * scale, (q, np.abs(theirs - ours).max(), scale)
    # and its greedy choice at each position is pockjax's wherever pockjax's is clear
    clear = np.sort(ours, -1)[:, -1] - np.sort(ours, -1)[:, -2] > 4 * tol * scale
    assert (theirs.argmax(-1)[clear] == ours.argmax(-1)[clear]).all()


def test_llama_cpp_reads_the_tokenizer_and_chat_template(tiny):
    import llama_cpp

    model, tok, d = tiny
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    path = os.path.join(d, "tok.gguf")
    save_gguf(model, tok, path, quant="f32")
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, verbose=False, n_threads=2)
    text = "Hello wörld 123!"
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text, add_bos=False)
    assert llm.metadata["tokenizer.chat_template"] == tok.chat_template
    assert llm.token_eos() == tok.eos_id


@pytest.mark.parametrize("q, min_corr", [("f16", 0.99999), ("q8_0", 0.999)])
def test_llama_cpp_runs_the_exported_gemma3_270m(tmp_path, q, min_corr):
    import llama_cpp

    from pockjax.models.llama.export import export_model

    prompt = "The capital of France is Paris. The capital of Germany is"
    path = export_model(llama.pretrained_path("gemma3-270m"), str(tmp_path / f"gemma.{q}.gguf"), quant=q)
    model, tok = llama.load_pretrained(path)
    ids = tok.encode(prompt)
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    assert llm.tokenize(prompt.encode(), add_bos=True, special=True) == ids
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    ours = np.asarray(model(jnp.array([ids])))[0]
    assert min(np.corrcoef(a, b)[0, 1] for a, b in zip(ours, theirs)) >= min_corr
    assert (theirs.argmax(-1) == ours.argmax(-1))[-1]
    llm.reset()
    text = llm.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    assert text.startswith(" Berlin"), text


def test_llama_cpp_scales_gemma3_full_layers_like_pockjax(tmp_path):
    """Gemma 3 4B-27B's linear RoPE scaling of the full-attention layers, exported and run in llama.cpp."""
    import sys

    import llama_cpp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_gemma3 import IDS as GEMMA_IDS, _hf_gemma3

    from pockjax.models.llama.spm import SentencePieceBPE

    hf = _hf_gemma3(layers=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=32, seed=2,
                    linear_rope=8.0)
    d = str(tmp_path / "hf")
    hf.save_pretrained(d)
    tok = llama.Tokenizer(SentencePieceBPE.for_tests(), bos_id=None, eos_id=1)
    ids = GEMMA_IDS[0]
    logits = {}
    for name, model in (("scaled", llama.load_hf_checkpoint(d)), ("plain", llama.load_hf_checkpoint(d, rope_scaling=None))):
        path = str(tmp_path / f"{name}.gguf")
        save_gguf(model, tok, path, quant="f32")
        llm = llama_cpp.Llama(model_path=path, n_ctx=32, logits_all=True, verbose=False, n_threads=2)
        llm.eval(ids)
        logits[name] = (np.asarray(model(jnp.array([ids])))[0], np.array(llm.scores[:len(ids)]))
        llm.close()
    ours, theirs = logits["scaled"]
    scale = np.abs(ours).max()
    assert np.abs(theirs - ours).max() <= 3e-3 * scale
    # and the scaling is what llama.cpp applied: far from the unscaled model's logits
    assert np.abs(theirs - logits["plain"][0]).max() > 5 * np.abs(theirs - ours).max()

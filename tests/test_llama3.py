"""Llama 3.x: RoPE scaling ``llama3`` from Hugging Face configs and GGUF ``rope_freqs``, parity with transformers."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pockjax.models import llama
from pockjax.models.llama.export import save_gguf

IDS = [list(range(1, 200))]  # past the scaled context (64), where the long wavelengths differ


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        ref = model(torch.tensor(IDS)).logits.numpy()
    d = str(tmp_path_factory.mktemp("llama3"))
    model.save_pretrained(d)
    return d, ref


def test_rope_scaling_matches_transformers(llama3):
    d, ref = llama3
    model = llama.load_hf_checkpoint(d)
    assert model.config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64.0)
    np.testing.assert_allclose(np.asarray(model(jnp.array(IDS))), ref, atol=1e-5)
    # the scaling matters at these positions: without it the logits differ
    plain = llama.load_hf_checkpoint(d, rope_scaling=None)
    assert np.abs(np.asarray(plain(jnp.array(IDS))) - ref).max() > 1e-3


def test_rope_scaling_survives_hf_and_gguf_export(llama3, tmp_path):
    from transformers import LlamaForCausalLM

    d, ref = llama3
    model = llama.load_hf_checkpoint(d)
    out = str(tmp_path / "hf")
    llama.save_hf_checkpoint(model, out)
    assert json.load(open(os.path.join(out, "config.json")))["rope_scaling"]["rope_type"] == "llama3"
    with torch.no_grad():
        theirs = LlamaForCausalLM.from_pretrained(out).eval()(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, ref, atol=1e-5)
    path = str(tmp_path / "m.gguf")
    save_gguf(model, llama.Tokenizer.byte_level_for_tests(), path, quant="f32")
    back = llama.load_gguf(path)  # llama.cpp's form: a rope_freqs tensor of per-frequency divisors
    assert back.config.rope_scaling[0] == "factors"
    np.testing.assert_allclose(np.asarray(back(jnp.array(IDS))), ref, atol=1e-5)
    with pytest.raises(llama.CheckpointError, match="per-frequency factors"):
        llama.save_hf_checkpoint(back, str(tmp_path / "hf2"))


def test_unsupported_rope_scaling_is_named(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, f)
    with pytest.raises(llama.UnsupportedModelError, match="RoPE scaling 'yarn' is not supported"):
        llama.read_hf_checkpoint(str(tmp_path))


def test_linear_rope_scaling_matches_transformers_and_round_trips(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"rope_type": "linear", "factor": 4.0})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        ref = model(torch.tensor(IDS)).logits.numpy()
    d = str(tmp_path / "hf")
    model.save_pretrained(d)
    ours = llama.load_hf_checkpoint(d)
    assert ours.config.rope_scaling == ("linear", 4.0)
    np.testing.assert_allclose(np.asarray(ours(jnp.array(IDS))), ref, atol=1e-4)
    assert np.abs(np.asarray(llama.load_hf_checkpoint(d, rope_scaling=None)(jnp.array(IDS))) - ref).max() > 1e-3
    out = str(tmp_path / "out")
    llama.save_hf_checkpoint(ours, out)
    assert json.load(open(os.path.join(out, "config.json")))["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    path = str(tmp_path / "m.gguf")
    save_gguf(ours, llama.Tokenizer.byte_level_for_tests(), path, quant="f32")
    back = llama.load_gguf(path)
    assert back.config.rope_scaling == ("linear", 4.0)
    np.testing.assert_allclose(np.asarray(back(jnp.array(IDS))), ref, atol=1e-4)
    with pytest.raises(ValueError, match="all positive"):
        ours.config.replace(rope_scaling=("linear", 0.0))


_HF_BASE = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32}


def test_config_keys_are_read_as_transformers_reads_them():
    from pockjax.models.llama.hf import hf_config

    # no rms_norm_eps: transformers' 1e-6 (pockjax took 1e-5: logits off by 0.38 on small embeddings)
    assert hf_config(_HF_BASE).rms_eps == 1e-6 and hf_config({**_HF_BASE, "model_type": "qwen2"}).rms_eps == 1e-6
    # an older rope_scaling beside rope_parameters: transformers lets it win, pockjax read the other
    with pytest.raises(llama.CheckpointError, match="rope_parameters .* and rope_scaling .* disagree"):
        hf_config({**_HF_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                   "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    same = hf_config({**_HF_BASE, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                      "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert same.rope_scaling == ("linear", 4.0)
    # Gemma 3's nested rope_parameters without their bases: the top-level ones (they were 1e6 and 1e4)
    gemma = {**_HF_BASE, "model_type": "gemma3_text", "head_dim": 8, "rope_theta": 500.0, "rope_local_base_freq": 50.0,
             "rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}}
    cfg = hf_config(gemma)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (500.0, 50.0)


def test_a_tied_config_with_another_lm_head_is_refused(tmp_path):
    # the file's lm_head was dropped without a word and the embedding tied (transformers 5 keeps it)
    from flax import nnx

    from pockjax.io.safetensors import read_safetensors, write_safetensors

    cfg = llama.LlamaConfig.tiny(vocab=64).replace(tie_embeddings=True)
    llama.save_hf_checkpoint(llama.Llama(cfg, rngs=nnx.Rngs(0)), str(tmp_path))
    weights = dict(read_safetensors(tmp_path / "model.safetensors"))
    embed = np.asarray(weights["model.embed_tokens.weight"])
    write_safetensors(str(tmp_path / "model.safetensors"), {**weights, "lm_head.weight": embed})
    llama.read_hf_checkpoint(str(tmp_path))  # the same values: tied as the config says
    write_safetensors(str(tmp_path / "model.safetensors"), {**weights, "lm_head.weight": embed * 2})
    with pytest.raises(llama.CheckpointError, match="'lm_head.weight' differs from model.embed_tokens.weight, but"
                                                    " the config says tie_word_embeddings: true"):
        llama.read_hf_checkpoint(str(tmp_path))

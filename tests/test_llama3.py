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

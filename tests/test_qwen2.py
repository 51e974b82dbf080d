"""Qwen2 (LLaMA with Q/K/V biases): parity with transformers, GGUF and HF export, finetune on it."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pockjax.models import llama
from pockjax.models.llama.export import save_gguf
from pockjax.models.llama.hf import hf_config
from pockjax.train.finetune import FinetuneConfig, finetune

IDS = [[1, 5, 9, 22, 7, 3, 64, 2, 100, 31]]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A small random Qwen2ForCausalLM (nonzero biases) saved by transformers, with pockjax's test tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
        ref = model(torch.tensor(IDS)).logits.numpy()
    d = str(tmp_path_factory.mktemp("qwen2"))
    model.save_pretrained(d)
    llama.Tokenizer.byte_level_for_tests().save(d)
    return d, ref


def test_loads_with_transformers_logits(qwen):
    d, ref = qwen
    model = llama.load_hf_checkpoint(d)
    assert model.config.arch == "qwen2" and model.config.qkv_bias
    np.testing.assert_allclose(np.asarray(model(jnp.array(IDS))), ref, atol=1e-5)


def test_exports_to_transformers_and_gguf(qwen, tmp_path):
    from transformers import Qwen2ForCausalLM

    d, ref = qwen
    model, tok = llama.load_pretrained(d)
    out = str(tmp_path / "hf")
    llama.save_hf_checkpoint(model, out)
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "qwen2"
    with torch.no_grad():
        theirs = Qwen2ForCausalLM.from_pretrained(out).eval()(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, ref, atol=1e-5)
    path = str(tmp_path / "q.gguf")
    save_gguf(model, tok, path, quant="f32")
    back = llama.load_gguf(path)
    assert back.config.arch == "qwen2" and back.config.qkv_bias
    np.testing.assert_allclose(np.asarray(back(jnp.array(IDS))), ref, atol=1e-5)


def test_an_unsupported_architecture_names_its_key(tmp_path):
    d = str(tmp_path)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, f)
    with pytest.raises(llama.UnsupportedModelError, match="model_type 'mistral' is not supported"):
        llama.read_hf_checkpoint(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "use_sliding_window": True}, f)
    with pytest.raises(llama.UnsupportedModelError, match="use_sliding_window"):
        llama.read_hf_checkpoint(d)
    # once loaded without a word: a GELU LLaMA trained as SiLU (and exported with hidden_act
    # "silu"), a sliding window ignored
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16}
    for extra, message in (({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
                           ({"sliding_window": 64}, r"sliding-window attention \(sliding_window=64\)")):
        with pytest.raises(llama.UnsupportedModelError, match=message):
            hf_config({**base, **extra}, source="config.json")
    assert hf_config({**base, "hidden_act": "silu", "sliding_window": None}).n_layers == 1
    # Qwen2 writes a window it does not use
    assert hf_config({**base, "model_type": "qwen2", "sliding_window": 4096,
                            "use_sliding_window": False}).arch == "qwen2"


def test_finetune_runs_on_a_qwen2_directory_with_lora(qwen, tmp_path):
    d, _ = qwen
    out = str(tmp_path / "run")
    cfg = FinetuneConfig(model=d, task="uppercase", scheme="lora", steps=3, batch_size=2, train_examples=8,
                         eval_examples=2, eval_max_new_tokens=4, save_every=3, show=0, progress=False,
                         lr=1e-2, out=out)
    result = finetune(cfg, log=lambda s: None)
    assert len(result.metrics["losses"]) == 3
    tuned = llama.load_hf_checkpoint(out)  # the merged model, still a Qwen2 with its biases
    assert tuned.config.arch == "qwen2"
    before = llama.flatten_params(llama.split(llama.load_hf_checkpoint(d))[1])
    after = llama.flatten_params(llama.split(tuned)[1])
    changed = sorted(k for k in before if not np.array_equal(np.asarray(before[k]), np.asarray(after[k])))
    assert changed == sorted(f"layers.{i}.attn.w{x}.kernel" for i in range(2) for x in "qkvo")

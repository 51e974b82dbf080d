"""finetune --dtype / --quantize: frozen weights held quantized or in bf16, trained in fp32."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pockjax import quant
from pockjax.cli import main as cli_main
from pockjax.models import llama
from pockjax.models.llama.mixed import LlamaWeights, load_for_training
from pockjax.train import FinetuneError, finetune
from pockjax.transforms.dequantize import quantized_jit
from tests.test_finetune import TINY, cfg  # the tiny runs' model config and FinetuneConfig

def _save(model, path):
    llama.save_hf_checkpoint(model, path)
    llama.Tokenizer.byte_level_for_tests().save(path)
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny HF model, and the same model with every matrix but block 1's replaced by its Q8_0 value."""
    root = tmp_path_factory.mktemp("prec")
    model = llama.Llama(TINY, rngs=nnx.Rngs(0))
    plain = _save(model, root / "plain")
    graphdef, params = llama.split(model)
    flat = llama.flatten_params(params)
    snapped = {k: (np.asarray(quant.dequantize(quant.quantize(np.asarray(v), "q8_0",
                                                               transposed=k.endswith("kernel"))))
                   if v.ndim == 2 and not k.startswith("layers.1") else v) for k, v in flat.items()}
    return plain, _save(llama.merge(graphdef, llama.unflatten_params(snapped)), root / "snapped")


def test_int8_run_equals_the_fp32_run_on_the_same_values(dirs, tmp_path):
    _, snapped = dirs
    ref = finetune(cfg(model=snapped, out=str(tmp_path / "fp32")), log=lambda s: None)
    got = finetune(cfg(model=snapped, quantize="int8", out=str(tmp_path / "int8")), log=lambda s: None)
    np.testing.assert_allclose(got.metrics["losses"], ref.metrics["losses"], rtol=1e-4)
    assert isinstance(got.model, LlamaWeights)
    frozen = got.model.params["layers"][0]["mlp"]["w2"]["kernel"]
    assert isinstance(frozen, quant.QTensor) and frozen.qtype == "q8_0"
    # the trained block is float32 and was trained
    trained = got.model.params["layers"][1]["mlp"]["w1"]["kernel"]
    assert trained.dtype == jnp.float32
    # the output directory is a float checkpoint with the trained values
    reloaded, _ = llama.load_pretrained(str(tmp_path / "int8"))
    np.testing.assert_allclose(np.asarray(reloaded.layers[1].mlp.w1.kernel[...]), np.asarray(trained), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(reloaded.layers[0].mlp.w2.kernel[...]),
                               np.asarray(quant.dequantize(frozen)), rtol=1e-6)
    run = json.load(open(os.path.join(tmp_path / "int8", "run.json")))
    assert run["config"]["quantize"] == "int8"


@pytest.fixture(scope="module")
def plain_losses(dirs):
    """The fp32 run's losses, the reference of each precision below (it writes nothing)."""
    return np.array(finetune(cfg(model=dirs[0]), log=lambda s: None).metrics["losses"])


@pytest.mark.parametrize("quantize,dtype", [("int4", "fp32"), ("none", "bf16"), ("int4", "bf16")])
def test_quantized_and_bf16_runs_train(dirs, plain_losses, tmp_path, quantize, dtype):
    plain, _ = dirs
    got = finetune(cfg(model=plain, quantize=quantize, dtype=dtype, out=str(tmp_path / "o")), log=lambda s: None)
    losses, ref_losses = np.array(got.metrics["losses"]), plain_losses
    assert np.all(np.isfinite(losses))
    assert np.abs(losses - ref_losses).max() < (0.05 if quantize == "int4" else 0.02) * ref_losses.max()
    leaves = llama.flatten_params(got.model.params)
    kinds = {type(v).__name__ for k, v in leaves.items() if k.startswith("layers.0.") and k.endswith("kernel")}
    assert kinds == {"QTensor"}
    if dtype == "bf16" and quantize == "none":
        assert leaves["layers.0.attn.wq.kernel"].qtype == "bf16"
        assert leaves["layers.0.attn_norm.scale"].dtype == jnp.bfloat16
    assert got.metrics["accuracy_after"] is not None


def test_resume_keeps_the_quantization_and_refuses_another(dirs, tmp_path):
    plain, _ = dirs
    whole = finetune(cfg(model=plain, quantize="int4", steps=4, out=str(tmp_path / "w")), log=lambda s: None)
    out = str(tmp_path / "r")
    finetune(cfg(model=plain, quantize="int4", steps=2, out=out), log=lambda s: None)
    held = json.load(open(os.path.join(out, "run.json")))["held_formats"]
    assert held["layers.0.mlp.w1.kernel"] == "q4_1" and "layers.1.mlp.w1.kernel" not in held
    result = finetune(cfg(model=plain, quantize="int4", steps=4, out=out, resume=True), log=lambda s: None)
    assert len(result.metrics["losses"]) == 4 and isinstance(result.model, LlamaWeights)
    # requantized from the saved checkpoint into the same formats: it continues as the whole run did
    np.testing.assert_allclose(result.metrics["losses"], whole.metrics["losses"], rtol=1e-5)
    kinds = {k: v.qtype for k, v in llama.flatten_params(result.model.params).items() if quant.is_qtensor(v)}
    assert kinds == held
    with pytest.raises(FinetuneError, match="quantize"):
        finetune(cfg(model=plain, quantize="int8", steps=6, out=out, resume=True), log=lambda s: None)


def test_bad_precision_options_are_refused(dirs, tmp_path, capsys):
    plain, _ = dirs
    with pytest.raises(FinetuneError, match="--quantize must be none, int8 or int4"):
        finetune(cfg(model=plain, quantize="int3"), log=lambda s: None)
    with pytest.raises(FinetuneError, match="--dtype must be fp32 or bf16"):
        finetune(cfg(model=plain, dtype="fp16"), log=lambda s: None)
    with pytest.raises(FinetuneError, match="--mesh trains fp32 weights"):
        finetune(cfg(model=plain, quantize="int4", mesh="data=1"), log=lambda s: None)
    assert cli_main(["finetune", "--model", "mobilenetv2", "--quantize", "int8"]) == 2
    assert "classifiers train in float32" in capsys.readouterr().err


def test_precision_flags_that_would_change_nothing_are_refused(dirs, tmp_path):
    plain, _ = dirs
    with pytest.raises(FinetuneError, match="--quantize int8 holds the frozen matrices block-quantized, but the"
                                            " scheme full freezes none"):
        finetune(cfg(model=plain, scheme="full", quantize="int8", out=str(tmp_path / "f")), log=lambda s: None)
    for kw in (dict(quantize="int4"), dict(dtype="bf16")):  # a model passed in is not loaded by finetune
        with pytest.raises(FinetuneError, match="choose how finetune loads config.model, and a model passed in is already loaded"):
            finetune(cfg(**kw), model=llama.Llama(TINY, rngs=nnx.Rngs(0)),
                     tokenizer=llama.Tokenizer.byte_level_for_tests(), log=lambda s: None)
    assert not os.path.exists(tmp_path / "f")


@pytest.mark.parametrize("kw", [dict(quantize="int4"), dict(dtype="bf16")])
def test_lora_over_held_frozen_weights_saves(dirs, tmp_path, kw):
    """LoRA on int4 / bf16-held bases: the checkpoint (with the adapters' float bases) is written."""
    plain, _ = dirs
    out = str(tmp_path / "lora")
    result = finetune(cfg(model=plain, scheme="lora", lr=1e-2, steps=2, out=out, **kw), log=lambda s: None)
    assert all(np.isfinite(result.metrics["losses"]))
    from pockjax.io.safetensors import read_safetensors

    saved = read_safetensors(os.path.join(out, "state", "adapters.safetensors"))
    assert saved and all(np.asarray(v).dtype == np.float32 for v in saved.values())
    llama.load_pretrained(out)  # the merged model loads


def test_cli_int4_bf16_run(dirs, tmp_path, capsys):
    plain, _ = dirs
    out = str(tmp_path / "cli")
    rc = cli_main(["finetune", "--model", plain, "--task", "uppercase", "--steps", "2", "--batch-size", "2",
                   "--eval-examples", "1", "--blocks", "1", "--quantize", "int4", "--dtype", "bf16",
                   "--out", out, "--no-progress"])
    assert rc == 0 and "summary" in capsys.readouterr().out
    cfgs = json.load(open(os.path.join(out, "run.json")))["config"]
    assert (cfgs["quantize"], cfgs["dtype"]) == ("int4", "bf16")


def test_gguf_blocks_are_kept_bit_for_bit_and_generation_takes_them(tmp_path):
    import gguf

    from tests.test_llama_gguf import _write_tiny_gguf

    model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(3))
    path = _write_tiny_gguf(tmp_path / "q4.gguf", model, qtype="Q4_0")
    weights, _ = load_for_training(str(path), lambda c: (lambda p: True), quantize="int4", tokenizer=False)
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: np.asarray(t.data) for t in reader.tensors}
    v = weights.params["layers"][0]["attn"]["wv"]["kernel"]
    assert v.qtype == "q4_0" and (quant.to_gguf_blocks(v).reshape(-1) == raw["blk.0.attn_v.weight"].reshape(-1)).all()
    float_model = llama.load_gguf(str(path))
    tokens = jnp.array([[7, 3, 99, 12]])
    want = float_model(tokens)
    got = quantized_jit(lambda p, t: llama.apply(weights.graphdef, p, t))(weights.params, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    out = llama.generate(weights, [[7, 3, 99]], max_new_tokens=3)
    assert out == llama.generate(float_model, [[7, 3, 99]], max_new_tokens=3)


@pytest.mark.slow
def test_smollm2_int8_logits_within_1e_2_of_fp32():
    model, _ = llama.load_pretrained("smollm2-135m", max_seq_len=512)
    weights, _ = load_for_training("smollm2-135m", lambda c: (lambda p: True), quantize="int8",
                                   max_seq_len=512, tokenizer=False)
    kinds = [x.qtype for x in jax.tree.leaves(weights.params, is_leaf=quant.is_qtensor) if quant.is_qtensor(x)]
    assert kinds.count("q4_1") == 30 * 7 and kinds.count("q8_0") == 1  # the file's blocks, kept
    tokens = jnp.array([[1, 504, 3458, 282, 253, 1345, 30, 2]])
    want = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
    got = np.asarray(quantized_jit(lambda p, t: llama.apply(weights.graphdef, p, t))(weights.params, tokens))
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-2
    # every matrix quantized to Q8_0 from its float value (as from a float checkpoint)
    flat = llama.flatten_params(llama.split(model)[1])
    q8 = llama.unflatten_params({k: quant.quantize(np.asarray(v), "q8_0", transposed=k.endswith("kernel"))
                                 if v.ndim == 2 else v for k, v in flat.items()})
    got8 = np.asarray(quantized_jit(lambda p, t: llama.apply(weights.graphdef, p, t))(q8, tokens))
    assert np.linalg.norm(got8 - want) / np.linalg.norm(want) <= 2e-2  # measured 1.2%
    assert (got8.argmax(-1) == want.argmax(-1)).mean() >= 0.75

"""pockjax export-model: GGUF for llama.cpp and Hugging Face safetensors, checked by independent readers."""

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax import quant
from pockjax.io.gguf import open_gguf
from pockjax.models import llama
from pockjax.models.llama.export import ExportError, export_model, gguf_tokenizer_metadata, save_gguf
from pockjax.models.llama.tokenizer import tokenizer_from_gguf
from pockjax.train.steps import answer_train_step

TOKENS = jnp.array([[1, 5, 9, 22, 7, 3, 64, 2]])


@pytest.fixture(scope="module")
def tiny():
    cfg = llama.LlamaConfig.tiny(vocab=272)  # rows for the test tokenizer's 259 tokens, padded in GGUF
    return llama.Llama(cfg, rngs=nnx.Rngs(0)), llama.Tokenizer.byte_level_for_tests()


def _with_weights(model, fn):
    """``model`` with every matrix replaced by what a file holds for it: ``fn`` of its GGUF layout.

    GGUF stores a kernel ``(in, out)`` transposed, and the embedding ``(vocab, dim)`` as it is.
    """
    graphdef, params = llama.split(model)

    def held(path, x):
        if x.ndim != 2:
            return x
        return fn(x) if "embed" in pockjax.paths.keypath_to_parts(path) else fn(x.T).T

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(held, params))


@pytest.mark.parametrize("q, ggml, fn", [
    ("f32", "F32", lambda w: w),
    ("f16", "F16", lambda w: w.astype(jnp.float16).astype(jnp.float32)),
    ("q8_0", "Q8_0", lambda w: quant.dequantize(quant.quantize(np.asarray(w), "q8_0"))),
    ("q4_0", "Q4_0", lambda w: quant.dequantize(quant.quantize(np.asarray(w), "q4_0"))),
])
def test_gguf_round_trip_and_what_llama_cpp_reads(tiny, tmp_path, q, ggml, fn):
    model, tok = tiny
    path = str(tmp_path / f"m.{q}.gguf")
    save_gguf(model, tok, path, quant=q)
    # pockjax reads back the model the file holds: the weights in that type, exactly
    expected = np.asarray(_with_weights(model, fn)(TOKENS))
    np.testing.assert_allclose(np.asarray(llama.load_gguf(path)(TOKENS)), expected, rtol=1e-5, atol=1e-5)
    # gguf (llama.cpp's own Python reader) sees the types and metadata llama.cpp checks
    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == ggml and types["token_embd.weight"] == ggml
    assert types["blk.0.attn_norm.weight"] == "F32" and types["output_norm.weight"] == "F32"
    assert len(r.tensors) == 2 + (0 if model.config.tie_embeddings else 1) + 9 * model.config.n_layers
    for key in ("llama.block_count", "llama.context_length", "llama.attention.head_count", "general.file_type"):
        assert r.fields[key].types == [gguf.GGUFValueType.UINT32], key
    assert r.fields["llama.rope.freq_base"].types == [gguf.GGUFValueType.FLOAT32]
    assert r.fields["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    # the dequantized blocks equal gguf's reference dequantization of the same bytes
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_down.weight")
    ours = llama.gguf.dequantize(np.asarray(t.data), ggml, tuple(int(d) for d in t.shape[::-1]))
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.shape))
    back = tokenizer_from_gguf(open_gguf(path))
    text = "Hello wörld 123, <|im_start|>!"
    assert back.encode(text) == tok.encode(text) and back.eos_id == tok.eos_id


def test_smollm2_tokenizer_metadata_equals_the_shipped_gguf():
    """The tokenizer fields pockjax writes are the ones llama.cpp's converter wrote for SmolLM2."""
    path = llama.pretrained_path("smollm2-135m")
    reader = open_gguf(path)
    meta = gguf_tokenizer_metadata(tokenizer_from_gguf(reader))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        mine = meta[key].value if hasattr(meta[key], "value") else meta[key]
        assert mine == reader.get(key), key
    shipped = reader.get("tokenizer.ggml.token_type")
    mine = meta["tokenizer.ggml.token_type"].value
    # the shipped file marks its special tokens control (3) and every other token normal (1)
    assert [i for i, t in enumerate(mine) if t != 1] == [i for i, t in enumerate(shipped) if t != 1]


@pytest.mark.parametrize("q", ["f32", "f16"])
def test_safetensors_directory_loads_in_transformers(tiny, tmp_path, q):
    import torch
    from transformers import LlamaForCausalLM

    model, tok = tiny
    src = str(tmp_path / "src.gguf")
    save_gguf(model, tok, src, quant="f32")
    out = export_model(src, str(tmp_path / "hf"), format="safetensors", quant=q)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(np.asarray(TOKENS))).logits.numpy()
    fn = (lambda w: w) if q == "f32" else (lambda w: w.astype(jnp.float16).astype(jnp.float32))
    np.testing.assert_allclose(theirs, np.asarray(_with_weights(model, fn)(TOKENS)), atol=1e-4)
    assert llama.load_tokenizer(out).encode("abc 12") == tok.encode("abc 12")


def test_mixed_lora_and_channels_scheme_trains_merges_and_exports(tiny, tmp_path):
    model, tok = tiny
    cfg = model.config
    graphdef, params = llama.split(model)
    scheme = pockjax.UpdateScheme({"layers.*.attn.w[qkvo].kernel": pockjax.lora(4, alpha=8),
                                   f"layers.{cfg.n_layers - 1}.mlp.w[13].kernel": pockjax.channels(0.5),
                                   "**.*norm*.scale": "full"})
    p = pockjax.add_adapters(jax.tree.map(jnp.copy, params), scheme)  # the step donates what it trains
    tx = optax.adam(2e-2)
    step = pockjax.compile(answer_train_step(graphdef, tx, window=2), scheme=scheme)
    state = pockjax.init_opt_state(tx, p, scheme)
    batch = {"tokens": TOKENS.repeat(2, 0), "targets": jnp.roll(TOKENS, -1, 1).repeat(2, 0),
             "loss_mask": jnp.zeros((2, 8)).at[:, 4:6].set(1), "loss_start": jnp.full((2,), 4)}
    for _ in range(4):
        p, state, loss = step(p, state, batch)
    adapted = np.asarray(nnx.merge(graphdef, p)(TOKENS))
    assert pockjax.leaf_paths(scheme.merge(p)) == pockjax.leaf_paths(params)  # the model's own tree again
    merged = nnx.merge(graphdef, scheme.merge(p))
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), adapted, atol=1e-4)
    path = str(tmp_path / "tuned.gguf")
    save_gguf(merged, tok, path, quant="f32")
    np.testing.assert_allclose(np.asarray(llama.load_gguf(path)(TOKENS)), adapted, atol=1e-4)
    assert not np.allclose(adapted, np.asarray(model(TOKENS)), atol=1e-3)  # it did train


def test_a_tokenizer_longer_than_the_embedding_is_refused(tmp_path):
    model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))  # 128 rows, 259 tokens
    with pytest.raises(ExportError, match="259 tokens but the model's embedding only 128 rows"):
        save_gguf(model, llama.Tokenizer.byte_level_for_tests(), str(tmp_path / "m.gguf"))
    assert not os.path.exists(tmp_path / "m.gguf")


def test_export_model_cli_refuses_what_a_format_cannot_hold(tmp_path, capsys):
    import pockjax.cli

    with pytest.raises(ExportError, match="--quant q8_0 needs --format gguf"):
        export_model("unused", str(tmp_path / "x"), format="safetensors", quant="q8_0")
    with pytest.raises(ExportError, match="unknown export format 'onnx'"):
        export_model("unused", str(tmp_path / "x"), format="onnx")
    code = pockjax.cli.main(["export-model", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o.gguf")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_export_model_refuses_an_output_path_it_cannot_write_before_loading(tiny, tmp_path, capsys, monkeypatch):
    """A directory for the GGUF file, a file for the safetensors directory, a
    path under a file and an empty path are one-line errors (status 2) naming
    ``--out``, found before the model loads; a GGUF file in a missing directory
    is written there."""
    import pockjax.cli

    model, tok = tiny
    src = str(tmp_path / "src.gguf")
    save_gguf(model, tok, src, quant="f32")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(llama, "load_pretrained", lambda source: pytest.fail("loaded the model first"))
    for out, fmt, says in [(tmp_path / "adir", "gguf", "is a directory, but GGUF is one file"),
                           (tmp_path / "afile", "safetensors", "is an existing file, but safetensors writes a"),
                           (tmp_path / "afile" / "m.gguf", "gguf", "which is a file, not a directory"),
                           ("", "gguf", "--out) is empty")]:
        code = pockjax.cli.main(["export-model", "--model", src, "--format", fmt, "--quant", "f32",
                                 "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and says in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path / "adir")) == [] and (tmp_path / "afile").read_text() == "x"
    monkeypatch.undo()
    out = export_model(src, str(tmp_path / "new" / "sub" / "m.gguf"), quant="f32")
    assert llama.load_tokenizer(out).encode("abc 12") == tok.encode("abc 12")


def test_safetensors_export_replaces_its_directory_whole_and_never_one_with_other_files(tiny, tmp_path, monkeypatch):
    """A safetensors export is built beside ``--out`` and renamed into place: an
    export that fails midway leaves the earlier one whole (no new weights beside
    an old tokenizer), and a directory holding other files is refused, not replaced."""
    from pockjax.models.llama import export as export_mod
    from pockjax.models.llama import tokenizer as tokenizer_mod

    model, tok = tiny
    src = str(tmp_path / "src.gguf")
    save_gguf(model, tok, src, quant="f32")
    out = tmp_path / "hf"
    export_model(src, str(out), format="safetensors", quant="f32")
    # a SentencePiece model's earlier export also holds its vocabulary file: still an export, replaced
    (out / tokenizer_mod.SPM_VOCAB_FILE).write_text("{}")
    export_model(src, str(out), format="safetensors", quant="f32")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert sorted(before) == sorted(set(export_mod.HF_EXPORT_FILES) - {tokenizer_mod.SPM_VOCAB_FILE})

    def broken_save(self, path):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer_mod.Tokenizer, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):  # after model.safetensors is written, before the tokenizer
        export_model(src, str(out), format="safetensors", quant="f16")
    monkeypatch.undo()
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["hf", "src.gguf"]  # no temporary left beside it

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.npz").write_bytes(b"keep")
    with pytest.raises(ExportError, match=r"holds files a safetensors export does not write \(checkpoint.npz\)"):
        export_model(src, str(tmp_path / "run"), format="safetensors", quant="f32")
    assert os.listdir(tmp_path / "run") == ["checkpoint.npz"]

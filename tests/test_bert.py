"""BERT encoder (pockjax.models.bert): parity with transformers on all-MiniLM-L6-v2,
the tokenizer, loading errors, the named schemes and a jitted train step."""

import json
import os
import zipfile

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax.io.safetensors import write_safetensors
from pockjax.models import bert
from pockjax.models.bert.pretrained import _hf_name
from pockjax.paths import leaf_paths
from pockjax.schemes import get_scheme, scheme_names


TEXTS = ["Hello world, this is a test.", "short",
         "A much longer sentence with unusual tokens: naïve café, 42 émojis 🙂 and CamelCase!",
         "", "The quick brown fox jumps over the lazy dog " * 3]
MAX_LEN = 24
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "1_Pooling/config.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The packaged model's files, extracted to a private directory (for transformers)."""
    d = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(bert.pretrained_path("all-minilm-l6-v2")) as z:
        for name in FILES:
            os.makedirs(d / os.path.dirname(name), exist_ok=True)
            (d / name).write_bytes(z.read(name))
    return d


@pytest.fixture(scope="module")
def loaded():
    return bert.load_pretrained("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def batch(loaded):
    _, tok = loaded
    return tok.encode_batch(TEXTS, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def ours(loaded, batch):
    model, _ = loaded
    ids, mask = batch
    return np.asarray(nnx.jit(lambda m, i, a: m(i, a))(model, ids, mask))


@pytest.fixture(scope="module")
def reference(model_dir, batch):
    """transformers' BertModel on the same files: last hidden states."""
    import torch
    import transformers

    hf = transformers.BertModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = batch
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.last_hidden_state.numpy()


def test_tokenizer_matches_transformers(model_dir, loaded, batch):
    import transformers

    _, tok = loaded
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    ref = hf(TEXTS, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="np")
    ids, mask = batch
    assert ids.dtype == mask.dtype == np.int32
    assert ids[:, 0].tolist() == [tok.cls_id] * len(TEXTS)
    np.testing.assert_array_equal(ids, ref["input_ids"])
    np.testing.assert_array_equal(mask, ref["attention_mask"])
    fixed = hf(TEXTS, padding="max_length", truncation=True, max_length=40, return_tensors="np")
    ids40, mask40 = tok.encode_batch(TEXTS, max_len=40, pad_to_max=True)
    np.testing.assert_array_equal(ids40, fixed["input_ids"])
    np.testing.assert_array_equal(mask40, fixed["attention_mask"])
    assert tok.encode(TEXTS[2]) == hf(TEXTS[2])["input_ids"]  # no truncation
    assert tok.decode(tok.encode("Hello, World!")) == "hello, world!"


def test_hidden_states_match_transformers(ours, reference, batch):
    _, mask = batch
    assert ours.shape == reference.shape == (len(TEXTS), MAX_LEN, 384)
    real = mask.astype(bool)
    diff = np.abs(ours - reference)
    assert diff[real].max() <= 1e-4, diff[real].max()  # measured 3e-6
    # padded slots are computed too (their queries see the real keys); their
    # states are never used, and differ more (measured 7e-5)
    assert diff.max() <= 5e-4, diff.max()


def test_mean_pooled_embeddings_match(loaded, ours, reference, batch):
    ids, mask = batch
    m = mask[:, :, None].astype(np.float32)
    ref = (reference * m).sum(1) / np.clip(m.sum(1), 1e-9, None)  # sentence-transformers
    got = np.asarray(bert.mean_pool(jnp.asarray(ours), mask))
    np.testing.assert_allclose(got, ref, atol=1e-5)  # measured 1.5e-6
    model, _ = loaded
    unit = np.asarray(bert.sentence_embedding(model, ids, mask))
    np.testing.assert_allclose(unit, ref / np.linalg.norm(ref, axis=-1, keepdims=True), atol=1e-5)


def test_padding_does_not_change_real_tokens(loaded, batch, ours):
    model, tok = loaded
    ids, mask = tok.encode_batch([TEXTS[1]], max_len=MAX_LEN)
    alone = np.asarray(model(ids, mask))
    n = int(mask.sum())
    np.testing.assert_allclose(alone[0, :n], ours[1, :n], atol=1e-5)


def test_directory_and_zip_give_the_same_model(model_dir, loaded):
    model, tok = loaded
    m2, tok2 = bert.load_pretrained(str(model_dir))
    z = bert.pretrained_path("minilm")
    assert z.endswith("model.zip") and zipfile.is_zipfile(z)
    a = bert.flatten_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    b = bert.flatten_params(nnx.to_pure_dict(nnx.state(m2, nnx.Param)))
    assert a.keys() == b.keys() == bert.expected_shapes(model.config).keys()
    for k in ("embeddings.word.embedding", "layers.5.mlp.down.kernel", "layers.0.attn.q.bias"):
        np.testing.assert_array_equal(a[k], b[k])
    assert model.config == m2.config == bert.BertConfig.minilm_l6()
    assert tok2.encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_unknown_name_lists_known_models():
    with pytest.raises(bert.UnknownModelError, match=r"'nope'.*known: \['all-minilm-l6-v2'\]"):
        bert.load_pretrained("nope")
    with pytest.raises(bert.FileMissingError, match="does not exist"):
        bert.load_pretrained("/no/such/model.zip")


@pytest.fixture(scope="module")
def tiny():
    """A tiny classifier, its encoder tensors under Hugging Face names, and the
    encoder's hidden states on a small batch (taken before any test trains it)."""
    cfg = bert.BertConfig.tiny()
    clf = bert.BertClassifier(cfg, 2, rngs=nnx.Rngs(0))
    flat = bert.flatten_params(nnx.to_pure_dict(nnx.state(clf, nnx.Param)))
    tensors = {_hf_name(k): np.asarray(v).T if k.endswith(".kernel") else np.asarray(v)
               for k, v in flat.items() if not k.startswith("head.")}
    tensors["embeddings.position_ids"] = np.arange(cfg.max_position, dtype=np.int64)[None]
    ids, mask = np.array([[1, 3, 4, 2], [1, 4, 2, 0]]), np.array([[1, 1, 1, 1], [1, 1, 1, 0]])
    return clf, tensors, (ids, mask), np.asarray(clf.hidden_states(ids, mask))


def _tiny_checkpoint(path, tiny, *, drop=(), extra=None, hf_config=None):
    """A tiny BERT directory in Hugging Face layout."""
    clf, tensors, _, _ = tiny
    cfg = clf.config
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    tensors.update(extra or {})
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    conf = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": cfg.vocab,
            "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "intermediate_size": cfg.intermediate,
            "max_position_embeddings": cfg.max_position, "hidden_act": "gelu",
            "layer_norm_eps": cfg.layer_norm_eps, **(hf_config or {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write(bert.tokenizer._TINY_JSON)


def test_tiny_directory_roundtrip_and_errors(tmp_path, tiny):
    _, _, (ids, mask), hidden = tiny
    _tiny_checkpoint(tmp_path / "ok", tiny)
    model, tok = bert.load_pretrained(str(tmp_path / "ok"))
    assert tok.encode_batch(["hello world", "world"])[0].tolist() == ids.tolist()
    np.testing.assert_allclose(model(ids, mask), hidden, atol=1e-6)

    _tiny_checkpoint(tmp_path / "gpt", tiny, hf_config={"model_type": "gpt2"})
    with pytest.raises(bert.UnsupportedModelError, match=r"config.json: model_type 'gpt2'"):
        bert.load_pretrained(str(tmp_path / "gpt"))
    _tiny_checkpoint(tmp_path / "mlm", tiny, hf_config={"architectures": ["BertForMaskedLM"]})
    with pytest.raises(bert.UnsupportedModelError, match="'BertForMaskedLM' is not supported"):
        bert.load_pretrained(str(tmp_path / "mlm"))
    _tiny_checkpoint(tmp_path / "rel", tiny, hf_config={"position_embedding_type": "relative_key"})
    with pytest.raises(bert.UnsupportedModelError, match="relative_key"):
        bert.load_pretrained(str(tmp_path / "rel"))
    _tiny_checkpoint(tmp_path / "drop", tiny, drop=["encoder.layer.1.output.dense.weight"])
    with pytest.raises(bert.CheckpointError, match=r"model.safetensors lacks tensors for"
                                                   r" \['layers.1.mlp.down.kernel'\]"):
        bert.load_pretrained(str(tmp_path / "drop"))
    _tiny_checkpoint(tmp_path / "mlmhead", tiny,
                     extra={"cls.predictions.bias": np.zeros(100, np.float32)})
    with pytest.raises(bert.UnsupportedModelError, match="'cls.predictions.bias' is unexpected"):
        bert.load_pretrained(str(tmp_path / "mlmhead"))
    _tiny_checkpoint(tmp_path / "deep", tiny, hf_config={"num_hidden_layers": 3})
    with pytest.raises(bert.CheckpointError, match=r"lacks tensors for \['layers.2"):
        bert.load_pretrained(str(tmp_path / "deep"))
    _tiny_checkpoint(tmp_path / "wide", tiny, hf_config={"intermediate_size": 48})
    with pytest.raises(bert.CheckpointError, match=r"layers.0.mlp.up.kernel has shape \(32, 64\)"):
        bert.load_pretrained(str(tmp_path / "wide"))
    os.remove(tmp_path / "ok" / "tokenizer.json")
    with pytest.raises(bert.FileMissingError, match="tokenizer.json not found"):
        bert.load_pretrained(str(tmp_path / "ok"))
    (tmp_path / "ok" / "config.json").write_text("[1]")
    with pytest.raises(bert.CheckpointError, match="config.json: expected a JSON object"):
        bert.load_pretrained(str(tmp_path / "ok"))
    st = tmp_path / "drop" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    with pytest.raises(bert.SafetensorsError, match="model.safetensors"):
        bert.load_pretrained(str(tmp_path / "drop"))
    # a zip holding the files under one folder loads too; a corrupt member is named
    zp = tmp_path / "m.zip"
    with zipfile.ZipFile(zp, "w") as z:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            z.write(tmp_path / "mlmhead" / name, f"tiny/{name}")
    with pytest.raises(bert.UnsupportedModelError, match=r"m.zip:tiny/model.safetensors: tensor"):
        bert.load_pretrained(str(zp))


def test_classifier_from_pretrained_encoder(loaded, batch, ours):
    model, _ = loaded
    flat = bert.flatten_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    clf = bert.build_model(model.config, flat, num_classes=3, rngs=nnx.Rngs(7))
    again = bert.build_model(model.config, flat, num_classes=3, rngs=nnx.Rngs(7))
    np.testing.assert_array_equal(clf.head.kernel[...], again.head.kernel[...])  # seeded
    assert clf.config.num_classes == 3 and model.config.num_classes is None
    ids, mask = batch
    logits = np.asarray(nnx.jit(lambda m, i, a: m(i, a))(clf, ids, mask))
    pooled = bert.mean_pool(jnp.asarray(ours), mask)
    np.testing.assert_allclose(logits, pooled @ clf.head.kernel[...] + clf.head.bias[...],
                               atol=1e-5)


def _trained(scheme, model):
    params = nnx.state(model, nnx.Param)
    paths = leaf_paths(params)
    rules = scheme.resolve_tree(params)
    return {p for p, r in zip(paths, rules) if not isinstance(r, pockjax.scheme.Frozen)}


def test_named_schemes_select_the_expected_tensors():
    assert scheme_names("bert") == ("full", "norm-only", "paper", "channels", "bias-only",
                                    "last-blocks", "head-only")
    cfg = bert.BertConfig.tiny(layers=6)
    clf = nnx.eval_shape(lambda: bert.BertClassifier(cfg, 2, rngs=nnx.Rngs(0)))
    enc = nnx.eval_shape(lambda: bert.BertModel(cfg, rngs=nnx.Rngs(0)))
    head = {"head.kernel", "head.bias"}
    paper = {f"layers.{i}.{t}.{leaf}" for i in (3, 4, 5)
             for t in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up")
             for leaf in ("kernel", "bias")}
    assert _trained(get_scheme("paper", clf.config), clf) == paper | head
    assert _trained(get_scheme("paper", cfg), enc) == paper
    assert _trained(get_scheme("paper", clf.config, blocks=1), clf) == {
        p for p in paper if p.startswith("layers.5.")} | head
    ch = get_scheme("channels", clf.config, fraction=0.25)
    assert _trained(ch, clf) == paper | head
    sel = dict(zip(leaf_paths(nnx.state(clf, nnx.Param)),
                   ch.resolve_tree(nnx.state(clf, nnx.Param))))
    assert sel["layers.4.mlp.up.kernel"].count == 16 and sel["layers.4.attn.q.bias"].count == 8
    norms = {f"layers.{i}.{n}.{leaf}" for i in range(6) for n in ("attn_norm", "mlp_norm")
             for leaf in ("scale", "bias")} | {"embeddings.norm.scale", "embeddings.norm.bias"}
    assert _trained(get_scheme("norm-only", cfg), enc) == norms
    biases = {p for p in leaf_paths(nnx.state(clf, nnx.Param)) if p.endswith(".bias")}
    assert _trained(get_scheme("bias-only", clf.config), clf) == biases | norms | head
    assert _trained(get_scheme("last-blocks", clf.config), clf) == {
        p for p in leaf_paths(nnx.state(clf, nnx.Param))
        if p.split(".")[:2] in (["layers", "3"], ["layers", "4"], ["layers", "5"])} | head
    assert _trained(get_scheme("head-only", clf.config), clf) == head
    with pytest.raises(pockjax.SchemeError, match="needs a classifier"):
        get_scheme("head-only", cfg)
    assert get_scheme("paper", bert.BertConfig.minilm_l6()).name == "paper (last 3 of 6 layers)"


def test_tiny_classifier_trains_under_jit(tiny):
    """A jitted sparse train step (paper scheme) with dropout: only the scheme's tensors move."""
    model = tiny[0]
    cfg = model.config
    scheme = get_scheme("paper", model.config)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=scheme.nnx_wrt())
    ids = jnp.array([[1, 7, 9, 2, 0, 0], [1, 5, 2, 0, 0, 0], [1, 4, 4, 4, 8, 2]])
    mask = (ids != cfg.pad_id).astype(jnp.int32)
    labels = jnp.array([0, 1, 1])
    before = {k: np.asarray(v) for k, v in bert.flatten_params(
        nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}

    @pockjax.compile(scheme=scheme)  # pockjax's sparse step (dropout keys are model state)
    def step(model, opt, ids, mask, labels):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(ids, mask), labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, scheme.nnx_wrt()))(model)
        opt.update(model, grads)
        return loss

    model.train()
    losses = [float(step(model, opt, ids, mask, labels)) for _ in range(8)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    after = bert.flatten_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    changed = {k for k in before if not np.array_equal(before[k], np.asarray(after[k]))}
    assert changed == {k for k in before if k.startswith("head.") or (
        k.split(".")[1] == "1" and k.split(".")[2] in ("attn", "mlp")
        and not k.startswith("layers.1.mlp.down"))}
    # dropout drew fresh keys every step (train mode); eval mode is deterministic
    # (the BertModel docstring shows two train-mode calls differ)
    counts = [int(v[...]) for p, v in nnx.iter_graph(model)
              if isinstance(v, nnx.RngCount)]
    assert len(counts) == 2 * 3 + 2 and all(c == 8 for c in counts)
    model.eval()
    fwd = nnx.jit(lambda m, i, a: m(i, a))
    np.testing.assert_array_equal(fwd(model, ids, mask), fwd(model, ids, mask))


def test_config_from_hf_validates():
    with pytest.raises(bert.CheckpointError, match="cfg.json: missing hidden_size"):
        bert.BertConfig.from_hf({"model_type": "bert", "vocab_size": 10,
                                 "num_hidden_layers": 1, "num_attention_heads": 1,
                                 "intermediate_size": 4}, "cfg.json")
    with pytest.raises(bert.CheckpointError, match="must be divisible"):
        bert.BertConfig.from_hf({"model_type": "bert", "vocab_size": 10, "hidden_size": 10,
                                 "num_hidden_layers": 1, "num_attention_heads": 3,
                                 "intermediate_size": 4})
    with pytest.raises(bert.UnsupportedModelError, match="hidden_act 'relu'"):
        bert.BertConfig.from_hf({"model_type": "bert", "hidden_act": "relu"})

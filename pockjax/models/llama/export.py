"""Writing a (fine-tuned) LLaMA for the runtimes people use: GGUF for llama.cpp, Hugging Face safetensors.

:func:`save_gguf` is the inverse of :func:`pockjax.models.llama.read_gguf`:
llama.cpp's tensor names, its row order of the Q and K projections
(:func:`permute_qk`), its metadata keys, the byte-level BPE or SentencePiece
tokenizer (``tokenizer.ggml.*``), in ``F32``, ``F16``, ``Q8_0`` or ``Q4_0``, for
the ``llama``, ``qwen2`` and ``gemma3`` architectures.
:func:`export_model` writes either format from a model pockjax loads (a
``pockjax finetune`` output directory, a GGUF file, a Hugging Face directory).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from pockjax.errors import PockjaxError
from pockjax.io.atomic import atomic_directory, file_above
from pockjax.io.gguf import Typed, write_gguf
from pockjax.models.llama.config import LlamaConfig, rope_freq_factors
from pockjax.models.llama.gguf import GEMMA3_GLOBAL_EVERY, GEMMA3_LOCAL_ROPE_BASE, GEMMA3_TENSORS, gemma3_fixed_fields
from pockjax.models.llama.tokenizer import SPM_VOCAB_FILE

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


def _pad_vocab(tokens: list, types: list, vocab: int | None, unused: int) -> None:
    """Pads ``tokens`` and ``types`` in place to ``vocab`` with unused ``[PAD<i>]`` tokens."""
    n = len(tokens)
    if vocab is not None and vocab < n:
        raise ExportError(f"the tokenizer has {n} tokens but the model's embedding only {vocab} rows:"
                          " llama.cpp needs a row for every token")
    if vocab is not None and vocab > n:
        tokens += [f"[PAD{i}]" for i in range(n, vocab)]
        types += [unused] * (vocab - n)


def _special_ids_metadata(tokenizer: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, tid in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                     ("padding_token_id", tokenizer.pad_id)):
        if tid is not None:
            meta[f"tokenizer.ggml.{key}"] = Typed("u32", int(tid))
    meta["tokenizer.ggml.add_bos_token"] = bool(tokenizer.add_bos)
    if tokenizer.chat_template:
        meta["tokenizer.chat_template"] = tokenizer.chat_template
    return meta


def _spm_tokenizer_metadata(tokenizer: Any, vocab: int | None) -> dict[str, Any]:
    """llama.cpp's ``llama`` (SentencePiece) tokenizer metadata: pieces, scores, types, as it reads them."""
    from pockjax.models.llama.spm import _UNUSED

    b = tokenizer.backend
    tokens, types, scores = list(b.tokens), list(b.types), list(b.scores)
    _pad_vocab(tokens, types, vocab, _UNUSED)
    scores += [0.0] * (len(tokens) - len(scores))
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": Typed("f32", scores),
        "tokenizer.ggml.token_type": Typed("i32", types),
        "tokenizer.ggml.add_space_prefix": bool(b.add_space_prefix),
        "tokenizer.ggml.add_eos_token": False,
    }
    if b.unk_id is not None:
        meta["tokenizer.ggml.unknown_token_id"] = Typed("u32", int(b.unk_id))
    meta.update(_special_ids_metadata(tokenizer))
    return meta


def gguf_tokenizer_metadata(tokenizer: Any, vocab: int | None = None) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of a :class:`~pockjax.models.llama.Tokenizer`.

    A byte-level BPE tokenizer is written as llama.cpp's ``gpt2`` model (its
    merges and pre-tokenizer name), a SentencePiece-BPE one
    (:class:`~pockjax.models.llama.spm.SentencePieceBPE`, e.g. Gemma 3's, also
    after a ``pockjax finetune`` saved it) as its ``llama`` model (pieces,
    scores and types). With ``vocab`` (the model's embedding rows), a shorter
    vocabulary is padded with unused ``[PAD<i>]`` tokens, as llama.cpp's
    converter does, since llama.cpp requires one token per row.

    Raises:
      ExportError: a tokenizer llama.cpp cannot describe (a ``tokenizer.json``
        that is not BPE, a pre-tokenizer it has no name for, or a
        SentencePiece model known only by its merges).

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> meta = gguf_tokenizer_metadata(Tokenizer.byte_level_for_tests())
      >>> meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"], len(meta["tokenizer.ggml.tokens"])
      ('gpt2', 'gpt-2', 259)
    """
    from pockjax.models.llama.spm import SentencePieceBPE
    from pockjax.models.llama.tokenizer import _CONTROL, _NORMAL, _UNUSED, _USER_DEFINED, _pre_tokenizer

    if isinstance(tokenizer.backend, SentencePieceBPE):
        return _spm_tokenizer_metadata(tokenizer, vocab)
    spec = json.loads(tokenizer.backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ExportError(f"GGUF export writes byte-level BPE ('gpt2') and SentencePiece ('llama') tokenizers;"
                          f" this one is {model.get('type')!r}")
    if model.get("byte_fallback"):
        raise ExportError("GGUF export: this tokenizer.json is a SentencePiece model known only by its merges;"
                          " llama.cpp needs the pieces' scores, which a tokenizer saved by pockjax keeps in"
                          " sentencepiece_vocab.json beside it (load the model from its GGUF file, or from a"
                          " directory pockjax saved)")
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
    _pad_vocab(tokens, types, vocab, _UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": Typed("i32", types),
        "tokenizer.ggml.merges": merges,
    }
    meta.update(_special_ids_metadata(tokenizer))
    return meta


def _float_params(model: Any) -> dict[str, np.ndarray]:
    """The model's parameters as float32 numpy arrays by dotted path (quantized ones dequantized)."""
    from pockjax import quant
    from pockjax.models.llama.mixed import LlamaWeights
    from pockjax.models.llama.model import flatten_params, split
    from pockjax.models.llama.weights import unstack_layers

    params = model.params if isinstance(model, LlamaWeights) else split(model)[1]
    flat = {}
    for path, v in flatten_params(params).items():
        v = quant.dequantize_host(v, np.float32) if quant.is_qtensor(v) else v
        flat[path] = np.asarray(v, np.float32)
    return unstack_layers(flat, model.config.n_layers) if model.config.scan_layers else flat


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
        a ``gemma3`` model that llama.cpp would run differently (a layer
        pattern, local RoPE base or query scale other than llama.cpp's).

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
    if cfg.arch not in ("llama", "qwen2", "gemma3"):
        raise ExportError(f"GGUF export of {cfg.arch} models is not supported (pockjax writes llama, qwen2"
                          f" and gemma3 GGUF files); export it with --format safetensors, a Hugging Face"
                          f" directory that llama.cpp's convert_hf_to_gguf.py converts")
    if cfg.arch == "gemma3":
        _check_gemma3_for_llama_cpp(cfg)
    a = cfg.arch  # the metadata keys' prefix: llama.*, qwen2.* or gemma3.*
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
    if a == "gemma3":
        meta[f"{a}.attention.sliding_window"] = Typed("u32", cfg.sliding_window)
    # llama.cpp's Q/K row order for 'llama' files; Qwen2 files keep Hugging Face's
    q_rows = (lambda w: permute_qk(w, cfg.n_heads)) if a == "llama" else (lambda w: w)
    k_rows = (lambda w: permute_qk(w, cfg.n_kv_heads)) if a == "llama" else (lambda w: w)
    meta.update(gguf_tokenizer_metadata(tokenizer, cfg.vocab))
    flat = _float_params(model)
    vector = lambda n, w: (n, "F32", w.shape, np.ascontiguousarray(w, np.float32))  # noqa: E731
    tensors = [_matrix("token_embd.weight", flat["embed.embedding"], qtype),
               vector("output_norm.weight", flat["norm.scale"])]
    if cfg.rope_scaling is not None and cfg.rope_scaling[0] == "linear":  # as llama.cpp reads it
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = Typed("f32", float(cfg.rope_scaling[1]))
    elif cfg.rope_scaling is not None:  # Llama 3's RoPE scaling, as llama.cpp reads it
        tensors.append(vector("rope_freqs.weight", rope_freq_factors(cfg)))
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
        if a == "gemma3":  # the extra norms, each stored as 1 + w by llama.cpp and pockjax alike
            tensors += [vector(f"blk.{i}.{name}.weight", at(path)) for name, path in GEMMA3_TENSORS.items()]
        if cfg.qkv_bias:
            tensors += [vector(f"blk.{i}.attn_q.bias", q_rows(at("attn.wq.bias"))),
                        vector(f"blk.{i}.attn_k.bias", k_rows(at("attn.wk.bias"))),
                        vector(f"blk.{i}.attn_v.bias", at("attn.wv.bias"))]
    write_gguf(path, meta, tensors)


def _check_gemma3_for_llama_cpp(cfg: LlamaConfig) -> None:
    """Refuses a Gemma 3 config that llama.cpp would run differently from pockjax.

    A ``gemma3`` GGUF file holds no layer pattern, local RoPE base or query
    scale: llama.cpp fixes them for the architecture (as
    :func:`~pockjax.models.llama.gguf.read_gguf` does when it reads one), so a
    config that differs would load and run, wrongly.
    """
    pattern, scalar = gemma3_fixed_fields(cfg)
    problems = []
    if tuple(cfg.layer_types or ()) != pattern:
        problems.append(f"its layer types {list(cfg.layer_types or ())} are not llama.cpp's fixed pattern"
                        f" (every {GEMMA3_GLOBAL_EVERY}th layer full attention, the others sliding)")
    if float(cfg.rope_local_theta) != GEMMA3_LOCAL_ROPE_BASE:
        problems.append(f"its sliding layers' RoPE base {cfg.rope_local_theta} is not llama.cpp's"
                        f" {GEMMA3_LOCAL_ROPE_BASE}")
    if float(cfg.query_pre_attn_scalar) != scalar:
        problems.append(f"its query_pre_attn_scalar {cfg.query_pre_attn_scalar} is not the {scalar:g} llama.cpp"
                        f" uses for this shape")
    if cfg.rope_scaling is not None and cfg.rope_scaling[0] != "linear":
        problems.append(f"it uses {cfg.rope_scaling[0]} RoPE scaling (llama.cpp scales Gemma 3's linearly)")
    if problems:
        raise ExportError("this Gemma 3 model cannot be written as GGUF: llama.cpp would run it differently, since "
                          + "; ".join(problems) + ". Export it with --format safetensors instead")


#: The files a ``--format safetensors`` export writes (its directory holds these only).
HF_EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", SPM_VOCAB_FILE)


def _check_output(out: str, format: str) -> None:
    """Refuses an output path that ``format`` cannot be written to, naming it and the fix."""
    if not out:
        raise ExportError("the output path (--out) is empty: give the .gguf file, or the safetensors directory")
    if format == "gguf" and (os.path.isdir(out) or out.endswith(("/", os.sep))):
        raise ExportError(f"--out {out!r} is a directory, but GGUF is one file: give a file path such as"
                          f" {os.path.join(out, 'model.gguf')!r}")
    if format == "safetensors" and os.path.lexists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out!r} is an existing file, but safetensors writes a directory (config.json,"
                          " model.safetensors, tokenizer.json): give a directory path, or remove the file")
    if format == "safetensors" and os.path.isdir(out):
        # the export replaces the directory as a whole: never one that holds anything else
        others = sorted(set(os.listdir(out)) - set(HF_EXPORT_FILES))
        if others:
            raise ExportError(f"--out {out!r} holds files a safetensors export does not write ({', '.join(others[:4])}"
                              f"{', ...' if len(others) > 4 else ''}), and the export replaces the directory as a"
                              " whole: give a new directory, or one that holds only an earlier export")
    above = file_above(out)
    if above is not None:
        raise ExportError(f"--out {out!r} lies under {above!r}, which is a file, not a directory")


def export_model(source: str, out: str, *, format: str = "gguf", quant: str = "f16") -> str:
    """Writes the model at ``source`` as a GGUF file or a Hugging Face directory; returns ``out``.

    Args:
      source: what :func:`~pockjax.models.llama.load_pretrained` loads: a
        ``pockjax finetune`` output directory (its merged weights), a
        Hugging Face LLaMA directory, a ``.gguf`` file, or a model name.
      out: the ``.gguf`` file, or the directory (:data:`HF_EXPORT_FILES`)
        for ``safetensors``. Either is written whole or not at all: the
        directory is built beside ``out`` and renamed into place, so it may
        exist only empty or holding an earlier export.
      format: ``gguf`` or ``safetensors``.
      quant: ``f32``, ``f16``, ``q8_0``, ``q4_0`` (GGUF); ``f32`` or ``f16`` (safetensors).

    Raises:
      ExportError: an ``out`` that cannot be written (checked before the
        model loads), an unknown format, a quantization the format cannot hold,
        or a model or tokenizer the GGUF format cannot describe (see :func:`save_gguf`).
    """
    from pockjax.models.llama import load_pretrained, save_hf_checkpoint

    if format not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {format!r}; use one of {', '.join(EXPORT_FORMATS)}")
    if format == "safetensors" and quant not in ("f32", "f16"):
        raise ExportError(f"safetensors holds float tensors: --quant {quant} needs --format gguf"
                          " (safetensors takes f32 or f16)")
    if format == "gguf" and quant not in GGUF_QUANTS:
        raise ExportError(f"unknown GGUF quantization {quant!r}; use one of {', '.join(GGUF_QUANTS)}")
    _check_output(os.fspath(out), format)  # before the model loads
    model, tokenizer = load_pretrained(source)
    if format == "gguf":
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)  # as safetensors makes its directory
        save_gguf(model, tokenizer, out, quant=quant, name=os.path.basename(os.path.normpath(source)))
    else:
        # built beside ``out`` and renamed into place: an interrupted export leaves the earlier one
        # whole, never new weights beside an old tokenizer
        with atomic_directory(out) as tmp:
            save_hf_checkpoint(model, tmp, dtype=np.float16 if quant == "f16" else np.float32)
            tokenizer.save(tmp)
    return out

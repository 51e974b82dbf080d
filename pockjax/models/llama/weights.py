"""Building a :class:`Llama` from flat parameters read from any checkpoint format.

Shared by the GGUF and Hugging Face loaders; it knows the parameter names and
shapes a config implies and checks the arrays against them.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pockjax.errors import ModelFileError, some
from pockjax.models.llama.config import LlamaConfig, is_positive_number

__all__ = ["build_model", "check_params", "config_from_fields", "expected_shapes", "unstack_layers"]


def config_from_fields(source: str | os.PathLike, error: type[ModelFileError],
                       **fields: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` from values read from a file, checked first.

    Counts must be positive integers and the combination must be a valid
    config; otherwise ``error`` names ``source`` and the field.

    Example:
      >>> config_from_fields("m.gguf", ModelFileError, vocab=10, dim=8, n_layers=1,
      ...                    n_heads=0, n_kv_heads=1, hidden_dim=16)
      Traceback (most recent call last):
      ...
      pockjax.errors.ModelFileError: m.gguf: n_heads must be a positive integer, got 0
    """
    for name in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
                 "max_seq_len", "head_dim"):
        value = fields.get(name)
        if value is None and name in ("max_seq_len", "head_dim"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise error(f"{os.fspath(source)}: {name} must be a positive integer, got {value!r}")
    for name in ("rope_theta", "rms_eps"):
        value = fields.get(name)
        if value is None:
            continue
        if not is_positive_number(value):
            raise error(f"{os.fspath(source)}: {name} must be a positive number, got {value!r}")
        fields[name] = float(value)
    fields = {k: v for k, v in fields.items() if v is not None or k == "head_dim"}
    try:
        return LlamaConfig(**fields)
    except (TypeError, ValueError) as e:
        raise error(f"{os.fspath(source)}: inconsistent model config ({e})") from None


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
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
        if cfg.arch == "gemma3":
            shapes.update({p + "attn.q_norm.scale": (hd,), p + "attn.k_norm.scale": (hd,),
                           p + "post_attn_norm.scale": (cfg.dim,), p + "post_mlp_norm.scale": (cfg.dim,)})
        if cfg.qkv_bias:
            shapes.update({p + "attn.wq.bias": (cfg.n_heads * hd,), p + "attn.wk.bias": (cfg.n_kv_heads * hd,),
                           p + "attn.wv.bias": (cfg.n_kv_heads * hd,)})
    return shapes


def unstack_layers(flat: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Flat params of a ``scan_layers`` model (``layers.<name>`` stacked on axis 0) per layer: ``layers.<i>.<name>``.

    Example:
      >>> import numpy as np
      >>> sorted(unstack_layers({"layers.w": np.zeros((2, 3)), "norm.scale": np.ones(3)}, 2))
      ['layers.0.w', 'layers.1.w', 'norm.scale']
    """
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if k.startswith("layers."):
            for i in range(n_layers):
                out[f"layers.{i}.{k[len('layers.'):]}"] = v[i]
        else:
            out[k] = v
    return out


def check_params(source: str | os.PathLike, cfg: LlamaConfig, params: dict[str, Any],
                 error: type[ModelFileError]) -> None:
    """Checks that ``params`` has exactly the tensors and shapes ``cfg`` implies.

    Raises:
      error: naming ``source`` and the first missing, unexpected or misshapen tensor.
    """
    source = os.fspath(source)
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise error(f"{source} lacks tensors for {some(missing, 5)}")
    extra = sorted(set(params) - set(expected))
    if extra:
        raise error(f"{source} has tensors the config does not use: {some(extra, 5)}")
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape:
            raise error(f"{source}: {name} has shape {tuple(params[name].shape)}, the config"
                        f" implies {shape}")


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
            if (len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit()
                    and int(parts[1]) < config.n_layers):
                stacked.setdefault(".".join(["layers"] + parts[2:]), [None] * config.n_layers)[
                    int(parts[1])] = value
            else:
                rest[name] = value
        for k, layers in stacked.items():
            absent = [i for i, v in enumerate(layers) if v is None]
            if absent:
                raise ModelFileError(f"parameters do not match the config: layers {absent[:5]}"
                                     f" lack {k[len('layers.'):]}")
            if len({tuple(np.shape(v)) for v in layers}) > 1:
                raise ModelFileError(f"parameters do not match the config: {k} differs in"
                                     f" shape between layers")
        flat = {**rest, **{k: np.stack(v) for k, v in stacked.items()}}
    abstract = nnx.eval_shape(
        lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
    graphdef, state = nnx.split(abstract)
    expected = flatten_params(nnx.to_pure_dict(state))
    extra = sorted(set(flat) - set(expected))
    missing = sorted(set(expected) - set(flat))
    if extra or missing:
        raise ModelFileError(f"parameters do not match the config: missing {some(missing, 5) or 'none'},"
                             f" unexpected {some(extra, 5) or 'none'}")
    arrays = {}
    for name, spec in expected.items():
        value = flat[name]
        if tuple(value.shape) != tuple(spec.shape):
            raise ModelFileError(f"{name}: shape {tuple(value.shape)}, expected"
                                 f" {tuple(spec.shape)}")
        arrays[name] = jnp.asarray(value, dtype=spec.dtype)
    return nnx.merge(graphdef, unflatten_params(arrays))

"""A LLaMA whose frozen weights are held quantized or in bfloat16: :class:`LlamaWeights`.

:func:`load_for_training` reads a GGUF file or a Hugging Face directory one
tensor at a time into the parameters a train step receives, given which
tensors the scheme freezes:

* a frozen float matrix with ``quantize="int8"`` becomes a Q8_0
  :class:`~pockjax.quant.QTensor`, with ``"int4"`` a Q4_1 one; a GGUF tensor
  already block-quantized (Q8_0, Q4_0, Q4_1) keeps its blocks as they are in
  the file, bit for bit: requantizing them would only add error. A matrix whose blocked axis is not a
  multiple of 32 stays a float array.
* with ``dtype`` bfloat16, every other frozen matrix is a ``bf16``
  QTensor (held in bfloat16, widened right before each product) and every
  other frozen tensor (norm scales) a bfloat16 array;
* trained tensors (fully or by channels) are float32: the master copies.

No float copy of the whole model is ever made. :class:`LlamaWeights` is what
``pockjax finetune`` trains, evaluates (:func:`~pockjax.models.llama.generate`
accepts it) and saves (:func:`~pockjax.models.llama.save_hf_checkpoint`,
which dequantizes one tensor at a time).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pockjax import quant
from pockjax.errors import InputError, ModelFileError
from pockjax.models.llama.config import LlamaConfig

__all__ = ["DTYPES", "LlamaWeights", "QUANTIZE", "abstract_model", "graphdef_for", "hold_frozen",
           "load_for_training", "tensor_formats"]

#: ``--dtype`` choices: the dtype frozen float tensors are held in.
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}

#: ``--quantize`` choices -> the GGUF formats kept as they are, and the format a float tensor gets.
#: A file's quantized blocks are never requantized: they are what the float
#: model is (its dequantized values), and requantizing them only adds error
#: (Q4_1 blocks requantized to Q8_0 moved SmolLM2's logits by 1.2%, relative
#: Frobenius norm; kept, by 2e-6). Under int4 a file's Q8_0 tensor stays Q8_0.
QUANTIZE = {"none": ((), None), "int8": (("q8_0", "q4_0", "q4_1"), "q8_0"),
            "int4": (("q4_0", "q4_1", "q8_0"), "q4_1")}


@dataclasses.dataclass
class LlamaWeights:
    """A LLaMA as its graph definition and a parameter dict that may hold QTensors and mixed dtypes.

    Attributes:
      config: The model's :class:`LlamaConfig`.
      graphdef: The NNX graph definition (``llama.split(model)[0]``).
      params: Nested dict of arrays and :class:`~pockjax.quant.QTensor` s.
    """

    config: LlamaConfig
    graphdef: Any
    params: dict

    def replace(self, params: dict) -> "LlamaWeights":
        return dataclasses.replace(self, params=params)

    @property
    def nbytes(self) -> int:
        return quant.tree_nbytes(self.params)


@functools.lru_cache(maxsize=16)
def abstract_model(config: LlamaConfig) -> tuple[Any, dict]:
    """``(graphdef, params)`` of a :class:`Llama` of ``config``, params as ``ShapeDtypeStruct`` s.

    Nothing is allocated; cached per config (generation asks for the same
    config at every call).

    Example:
        >>> graphdef, params = abstract_model(LlamaConfig.tiny())
        >>> params["layers"][0]["mlp"]["w1"]["kernel"].shape
        (64, 96)
    """
    from flax import nnx

    from pockjax.models.llama.model import Llama

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    return graphdef, nnx.to_pure_dict(state)


def graphdef_for(config: LlamaConfig):
    """The NNX graph definition of a :class:`Llama` of ``config`` (nothing allocated)."""
    return abstract_model(config)[0]


def tensor_formats(config: LlamaConfig, frozen: Callable[[str], bool], *, quantize: str = "none",
                   dtype: Any = jnp.float32, held: dict | None = None) -> Callable[[str, tuple, str | None], Any]:
    """``fmt(path, shape, file_type) -> format`` for the loaders: a QTensor format, or a dtype.

    ``held`` (path -> format) overrides the choice for those paths: a resumed
    run requantizes its saved float checkpoint into the formats it started with.

    Example:
        >>> fmt = tensor_formats(LlamaConfig.tiny(), lambda p: not p.startswith("layers.1"),
        ...                      quantize="int4", dtype=jnp.bfloat16)
        >>> fmt("layers.0.attn.wq.kernel", (64, 64), "Q4_0"), fmt("layers.0.attn.wq.kernel", (64, 64), "F32")
        ('q4_0', 'q4_1')
        >>> fmt("norm.scale", (64,), "F32").__name__, fmt("layers.1.mlp.w1.kernel", (64, 96), "Q4_0").__name__
        ('bfloat16', 'float32')
        >>> tensor_formats(LlamaConfig.tiny(), lambda p: True, dtype=jnp.bfloat16)("embed.embedding", (128, 64), "F32")
        'bf16'
    """
    if quantize not in QUANTIZE:
        raise InputError(f"unknown quantize {quantize!r}; choose one of {sorted(QUANTIZE)}")
    kept, default = QUANTIZE[quantize]

    def fmt(path: str, shape: tuple, file_type: str | None):
        if not frozen(path):
            return jnp.float32
        if held and path in held:  # a resumed run: the formats it trained with
            return held[path]
        blocked = shape[0] if path.endswith("kernel") else shape[-1]
        if default is not None and len(shape) == 2 and blocked % quant.BLOCK == 0:
            ftype = (file_type or "").lower()
            return ftype if ftype in kept else default
        if len(shape) == 2 and np.dtype(dtype) == np.dtype(jnp.bfloat16):
            return "bf16"  # widened per product inside the step, like a quantized matrix
        return dtype

    return fmt


def hold_frozen(params: dict, config: LlamaConfig, frozen: Callable[[str], bool], *, quantize: str = "none",
                dtype: Any = jnp.float32) -> dict:
    """An in-memory float ``params`` dict with its frozen tensors held as :func:`tensor_formats` says.

    Example:
        >>> from flax import nnx
        >>> from pockjax.models.llama.model import Llama, split
        >>> params = split(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))[1]
        >>> held = hold_frozen(params, LlamaConfig.tiny(), lambda p: p.startswith("layers.0"), quantize="int8")
        >>> held["layers"][0]["mlp"]["w1"]["kernel"].qtype, held["layers"][1]["mlp"]["w1"]["kernel"].dtype
        ('q8_0', dtype('float32'))
    """
    from pockjax.paths import flatten_params, unflatten_params

    fmt = tensor_formats(config, frozen, quantize=quantize, dtype=dtype)
    return unflatten_params({path: _as_param(_held(path, w, fmt(path, tuple(w.shape), None)))
                             for path, w in flatten_params(params).items()})


def _held(path: str, w, want):
    """A float tensor in the format ``want`` (a QTensor format or a dtype), on the host."""
    if isinstance(want, str):
        return quant.quantize(np.asarray(w, np.float32), want, transposed=path.endswith("kernel"))
    return np.asarray(w).astype(want)


def _as_param(value):
    if quant.is_qtensor(value):
        return jax.tree.map(jnp.asarray, value)
    return jnp.asarray(value)


def load_for_training(name: str | os.PathLike, frozen_paths: Callable[[LlamaConfig], Callable[[str], bool]], *,
                      quantize: str = "none", dtype: Any = jnp.float32, tokenizer: bool = True,
                      held: dict | None = None, **config_overrides):
    """Loads a model for training with frozen tensors held quantized or in ``dtype``.

    Args:
      name: As for :func:`~pockjax.models.llama.load_pretrained`.
      frozen_paths: ``frozen_paths(config) -> is_frozen(path)``, called once
        the config is read (the scheme depends on the model's depth).
      quantize: ``"none"``, ``"int8"`` or ``"int4"``.
      dtype: The dtype of frozen float tensors (``jnp.bfloat16`` or float32).
      tokenizer: Also load the tokenizer (else None is returned for it).
      held: Path -> QTensor format to use for those tensors (see :func:`tensor_formats`).

    Returns:
      ``(LlamaWeights, tokenizer)``.

    Example (not run: loads 135M parameters)::

      weights, tok = load_for_training("smollm2-135m", lambda cfg: lambda p: "layers.29" not in p,
                                       quantize="int4", dtype=jnp.bfloat16)
    """
    from pockjax.io.gguf import open_gguf
    from pockjax.models.llama.gguf import read_gguf
    from pockjax.models.llama.hf import read_hf_checkpoint
    from pockjax.models.llama.pretrained import pretrained_path
    from pockjax.models.llama.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir
    from pockjax.models.llama.weights import check_params
    from pockjax.paths import unflatten_params

    name = os.fspath(name)
    if os.path.isdir(name):
        cfg, flat = read_hf_checkpoint(name, **config_overrides)
        fmt = tensor_formats(cfg, frozen_paths(cfg), quantize=quantize, dtype=dtype, held=held)
        params = {}
        for path in list(flat):
            w = flat.pop(path)
            params[path] = _held(path, w, fmt(path, tuple(w.shape), None))
        tok = tokenizer_from_hf_dir(name) if tokenizer else None
    else:
        reader = open_gguf(pretrained_path(name))
        holder: dict = {}

        def spec(config):
            holder["fmt"] = tensor_formats(config, frozen_paths(config), quantize=quantize, dtype=dtype, held=held)
            return holder["fmt"]

        cfg, params = read_gguf(reader, formats=spec, **config_overrides)
        tok = tokenizer_from_gguf(reader) if tokenizer else None
    check_params(name, cfg, params, ModelFileError)
    # one tensor at a time to the device, each host copy dropped as it goes
    arrays = {}
    for k in list(params):
        arrays[k] = _as_param(params.pop(k))
    params = unflatten_params(arrays)
    return LlamaWeights(cfg, graphdef_for(cfg), params), tok

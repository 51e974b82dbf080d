"""The Flax LLaMA fine-tuning step from abstract shapes: what ``pockjax plan`` and
``pockjax memory`` analyse.

The model is :class:`pockjax.models.llama.Llama` built with ``nnx.eval_shape``
from a :class:`~pockjax.models.llama.LlamaConfig` (``LlamaConfig.llama2_7b()``,
``.smollm2_135m()``, ``.tiny()``): every parameter is a ``jax.ShapeDtypeStruct``,
nothing is allocated, so a LLaMA-2-7B step is planned on a laptop. The step is
the one ``pockjax finetune`` trains (``value_and_grad`` of the next-token loss,
an ``optax`` update); the scheme comes from :mod:`pockjax.schemes`, and the
optimizer state exists for what the scheme trains only
(:func:`pockjax.init_opt_state`).

Example:
  >>> from pockjax.models.llama import LlamaConfig
  >>> r = plan_llama(LlamaConfig.tiny(), "paper", seq=16)
  >>> r.scheme.name, r.trainable, r.total
  ('paper (last 2 blocks)', 49152, 78144)
  >>> r.inplace.peak_bytes <= r.program.peak_bytes
  True
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["DTYPES", "MODELS", "PRECISIONS", "QUANTIZE", "LlamaPlan", "LlamaStep", "PrecisionPlan",
           "abstract_llama_step", "check_precision", "fit_table", "held_format", "model_config", "plan_llama",
           "plan_precision", "plan_precisions", "precision_name", "train_step"]

#: ``--model`` names of ``pockjax plan``/``pockjax memory`` and their configs.
MODELS: dict[str, Callable[..., Any]] = {}


def _models() -> dict[str, Callable[..., Any]]:
    if not MODELS:
        from pockjax.models.llama import LlamaConfig

        MODELS.update({"llama2-7b": LlamaConfig.llama2_7b, "smollm2-135m": LlamaConfig.smollm2_135m,
                       "tiny": LlamaConfig.tiny})
    return MODELS


def model_config(model: str, **overrides: Any):
    """The :class:`~pockjax.models.llama.LlamaConfig` of a ``--model`` name.

    Example:
      >>> model_config("llama2-7b").n_layers, model_config("smollm2-135m", n_layers=2).n_layers
      (32, 2)
    """
    models = _models()
    if model not in models:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(models)}")
    return models[model](**overrides)


def train_step(graphdef: Any, tx: Any) -> Callable:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: the ordinary, full
    fine-tuning step of a Flax LLaMA (``batch`` holds ``tokens``, ``targets``, ``loss_mask``)."""
    import optax

    from pockjax.models import llama

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = llama.apply(graphdef, p, batch["tokens"])
            return llama.next_token_loss(logits, batch["targets"], batch["loss_mask"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@dataclasses.dataclass
class LlamaStep:
    """A train step and its abstract arguments.

    Attributes:
      step: ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
      args: ``(params, opt_state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees.
      scheme: the :class:`~pockjax.UpdateScheme`.
      config: the model's :class:`~pockjax.models.llama.LlamaConfig`.
      tx: the optax optimizer.
      graphdef: the model's graph definition (for :func:`pockjax.models.llama.merge`).
    """

    step: Callable
    args: tuple
    scheme: Any
    config: Any
    tx: Any
    graphdef: Any


def abstract_llama_step(config: Any, scheme: Any = "full", *, dtype: Any = jnp.float32, batch: int = 1,
                        seq: int = 512, optimizer: Any = None, blocks: int | None = None) -> LlamaStep:
    """The fine-tuning step of a Flax LLaMA with abstract arguments (nothing allocated).

    Args:
      config: a :class:`~pockjax.models.llama.LlamaConfig`.
      scheme: a name of :mod:`pockjax.schemes` (``full``, ``paper``, ...), a scheme
        file, or an :class:`~pockjax.UpdateScheme`: the optimizer state is then a
        :class:`~pockjax.SparseOptState` for what it trains. ``None``: plain
        ``tx.init`` state for every parameter, a step for ``jax.jit`` as it is.
      dtype: the parameters' dtype (and so the optimizer moments', optax's default).
      batch, seq: token batch shape.
      optimizer: an optax optimizer; default ``optax.adamw(1e-4)``.
      blocks: ``--blocks`` of block-wise schemes (default: the registry's).

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> w = abstract_llama_step(LlamaConfig.tiny(), "paper", batch=1, seq=8)
      >>> w.args[2]["tokens"].shape, w.scheme.name
      ((1, 8), 'paper (last 2 blocks)')
    """
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import llama
    from pockjax.schemes import resolve_scheme

    if isinstance(scheme, str):
        scheme = resolve_scheme(scheme, config, blocks=blocks)
    tx = optimizer if optimizer is not None else optax.adamw(1e-4)
    if seq > config.max_seq_len:
        config = config.replace(max_seq_len=seq)
    model = nnx.eval_shape(lambda: llama.Llama(config, rngs=nnx.Rngs(0), param_dtype=dtype))
    graphdef, params = llama.split(model)
    if scheme is not None and scheme.has_lora:  # the adapters pockjax finetune adds, as shapes
        from pockjax.adapters import add_adapters

        params = jax.eval_shape(lambda p: add_adapters(p, scheme), params)
    if scheme is None:
        opt_state = jax.eval_shape(tx.init, params)
    else:
        opt_state = jax.eval_shape(lambda p: pockjax.init_opt_state(tx, p, scheme), params)
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    b = {"tokens": tok, "targets": tok, "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    return LlamaStep(train_step(graphdef, tx), (params, opt_state, b), scheme, config, tx, graphdef)


@dataclasses.dataclass
class LlamaPlan:
    """What :func:`plan_llama` found.

    Attributes:
      scheme: the :class:`~pockjax.UpdateScheme` planned.
      trainable, total: trained and all parameters (``scheme.describe(params)``,
        the figures ``pockjax finetune`` prints).
      program: the liveness report of the step after the default passes
        (``sparse_grad``, ``dce``, ...), in the order JAX emits.
      inplace: the same after ``inplace_update`` (each update right after its gradient).
      graph: the step after the default passes (built for analysis: the passes
        skip their ``check_jaxpr``, as :func:`pockjax.default_passes` says).
      seconds: ``{"trace", "passes", "inplace_update", "analyze"}`` (``trace`` is None
        when the step's trace was reused from the plan before).
    """

    scheme: Any
    trainable: int
    total: int
    program: Any
    inplace: Any
    graph: Any
    seconds: dict[str, float]


_LAST_TRACE: list = []  # [(key, traced)]: the last default-optimizer step traced


def _trace_once(w: Any, args: tuple, optimizer: Any, dtype: Any) -> Any:
    """``pockjax.trace_step(w.step, args)``, reused while the step is the same.

    With the default optimizer the traced step depends only on the model's
    config and the arguments' shapes, not on the scheme (the passes that read
    the scheme come after, and build new graphs): ``plan --scheme both`` and the
    per-precision plans trace it once. Returns ``(traced, reused)``.
    """
    import pockjax

    if optimizer is not None:  # any optax object: its code is not known from a key
        return pockjax.trace_step(w.step, args), False
    leaves, tree = jax.tree.flatten(args)
    key = (repr(w.config), str(jnp.dtype(dtype)), tree, tuple((x.shape, str(x.dtype)) for x in leaves),
           jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
    if _LAST_TRACE and _LAST_TRACE[0][0] == key:
        return _LAST_TRACE[0][1], True
    traced = pockjax.trace_step(w.step, args)
    _LAST_TRACE[:] = [(key, traced)]
    return traced, False


def _traced(config: Any, scheme: Any, *, dtype: Any, batch: int, seq: int, optimizer: Any,
            blocks: int | None) -> tuple:
    """``(step, scheme, desc, graph, inplace_graph, seconds)``: the step traced and rewritten."""
    import pockjax
    from pockjax.optim.state import SparseOptState
    from pockjax.transforms.inplace_update import inplace_update

    w = abstract_llama_step(config, scheme, dtype=dtype, batch=batch, seq=seq, optimizer=optimizer,
                            blocks=blocks)
    scheme = w.scheme if w.scheme is not None else pockjax.UpdateScheme.full()
    desc = scheme.describe(w.args[0])
    params, opt_state, batch_ = w.args
    sparse_state = isinstance(opt_state, SparseOptState)
    t0 = time.perf_counter()
    # traced against the full optimizer state, as pockjax.compile does; sparse_grad
    # then drops the state of what the scheme freezes
    args = (params, opt_state.full_abstract() if sparse_state else opt_state, batch_)
    traced, reused = _trace_once(w, args, optimizer, dtype)
    t1 = time.perf_counter()
    # only analysed, never compiled: the passes skip their check_jaxpr (3 s of a 7B plan)
    passes = pockjax.default_passes(w.scheme, sparse_state, check=False)
    graph = passes(traced)
    t2 = time.perf_counter()
    inplace_graph = inplace_update()(graph)
    t3 = time.perf_counter()
    seconds = {"trace": None if reused else t1 - t0, "passes": t2 - t1, "inplace_update": t3 - t2}
    return w, scheme, desc, graph, inplace_graph, seconds


def plan_llama(config: Any, scheme: Any = "full", *, dtype: Any = jnp.float32, batch: int = 1,
               seq: int = 512, optimizer: Any = None, blocks: int | None = None, donate: bool = True,
               **analyze_kwargs: Any) -> LlamaPlan:
    """Plans one fine-tuning step of a Flax LLaMA from shapes, with and without the
    in-place update order.

    The step is traced (:func:`pockjax.trace_step`), rewritten by the default
    passes of ``pockjax.compile`` for the scheme, and analysed with parameters
    and optimizer state donated, as ``pockjax.compile`` does (frozen parameters
    are outputs too, so they live to the end). Every tensor is held in ``dtype``;
    :func:`plan_precision` plans a precision policy (frozen weights in bf16 or
    block-quantized, trained ones and AdamW moments in fp32).

    Args:
      config, scheme, dtype, batch, seq, optimizer, blocks: as :func:`abstract_llama_step`
        (``scheme=None`` plans full fine-tuning with plain optax state).
      donate: parameters and optimizer state donated (``False``: the caller keeps them,
        so the new values are written beside the old).
      **analyze_kwargs: passed to :func:`pockjax.memory.analyze` (``schedule``, ``fusion``).

    Example (not run: about a minute on 2 cores)::

      r = plan_llama(LlamaConfig.llama2_7b(), "paper", dtype=jnp.bfloat16)
      print(r.inplace.summary())
    """
    from pockjax.memory.liveness import analyze

    _, scheme, desc, graph, inplace_graph, seconds = _traced(
        config, scheme, dtype=dtype, batch=batch, seq=seq, optimizer=optimizer, blocks=blocks)
    donated = {"param", "opt_state"} if donate else False
    t0 = time.perf_counter()
    program = analyze(graph, donate=donated, **analyze_kwargs)
    inplace = analyze(inplace_graph, donate=donated, **analyze_kwargs)
    seconds["analyze"] = time.perf_counter() - t0
    return LlamaPlan(scheme, desc.trainable, desc.total, program, inplace, graph, seconds)


# -- precision policies: frozen weights in bf16 or block-quantized -----------------------

#: ``dtype=`` of :func:`plan_precision` (``--dtype`` of ``pockjax plan``).
DTYPES = ("fp32", "bf16")
#: ``quantize=`` of :func:`plan_precision` and the :mod:`pockjax.quant` format of each.
QUANTIZE = {"none": None, "int8": "q8_0", "int4": "q4_1"}
#: The precision combinations ``pockjax plan --fits`` compares, ``(dtype, quantize)``.
PRECISIONS = (("fp32", "none"), ("bf16", "none"), ("bf16", "int8"), ("bf16", "int4"))

_ITEMSIZE = {"fp32": 4, "bf16": 2}


def check_precision(dtype: str, quantize: str) -> tuple[str, str]:
    """``(dtype, quantize)`` normalised (``"f32"`` is ``"fp32"``; a format name such as
    ``"q4_1"`` is its ``quantize`` name); raises :class:`pockjax.errors.PockjaxError`
    naming the choices for anything else.

    Example:
      >>> check_precision("f32", "q8_0")
      ('fp32', 'int8')
      >>> check_precision("fp16", "none")
      Traceback (most recent call last):
        ...
      pockjax.errors.PockjaxError: dtype must be one of fp32, bf16; got 'fp16'
    """
    from pockjax.errors import PockjaxError

    d = {"f32": "fp32", "float32": "fp32", "bfloat16": "bf16"}.get(str(dtype), str(dtype))
    if d not in DTYPES:
        raise PockjaxError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    q = "none" if quantize is None else str(quantize)
    q = {fmt: name for name, fmt in QUANTIZE.items() if fmt}.get(q, q)
    if q not in QUANTIZE:
        raise PockjaxError(f"quantize must be one of {', '.join(QUANTIZE)}; got {quantize!r}")
    return d, q


def precision_name(dtype: str, quantize: str) -> str:
    """``"fp32"``, ``"bf16"``, ``"bf16+int4"``, ...: a combination's label."""
    return dtype if quantize == "none" else f"{dtype}+{quantize}"


def _blocked_axis(path: str) -> int:
    # an embedding (vocab, dim) is stored as rows of blocks along dim; a kernel
    # (in, out) as GGUF's (out, in) rows, blocks along `in` (quant.quantize(transposed=True))
    return -1 if path.rsplit(".", 1)[-1] == "embedding" else -2


def held_format(path: str, shape: tuple[int, ...], trained: bool, dtype: str, quantize: str) -> str:
    """The format a parameter is held in under a precision policy: ``"fp32"``,
    ``"bf16"`` or a :mod:`pockjax.quant` format (``"q8_0"``, ``"q4_1"``).

    Trained tensors (fully or by channels) are fp32 master copies; frozen matrices
    (two or more axes, the blocked axis a multiple of 32) are block-quantized when
    ``quantize`` says so; every other frozen tensor is held in ``dtype``.

    Example:
      >>> held_format("layers.0.mlp.w1.kernel", (4096, 11008), False, "bf16", "int4")
      'q4_1'
      >>> held_format("layers.0.mlp_norm.scale", (4096,), False, "bf16", "int4")
      'bf16'
      >>> held_format("layers.31.mlp.w1.kernel", (4096, 11008), True, "bf16", "int4")
      'fp32'
    """
    from pockjax.quant import BLOCK

    if trained:
        return "fp32"
    fmt = QUANTIZE[quantize]
    if fmt and len(shape) >= 2 and shape[_blocked_axis(path)] % BLOCK == 0:
        return fmt
    return dtype


def _format_bytes_per_value(fmt: str) -> float:
    from pockjax.quant import BYTES_PER_VALUE

    return _ITEMSIZE[fmt] if fmt in _ITEMSIZE else BYTES_PER_VALUE[fmt]


@dataclasses.dataclass
class PrecisionPlan:
    """What :func:`plan_precision` found for one precision combination.

    Attributes:
      dtype, quantize: the combination (``"bf16"``, ``"int4"``); :attr:`name` is its label.
      scheme, trainable, total: as :class:`LlamaPlan`.
      held: ``{parameter path: format}`` (``"fp32"``, ``"bf16"``, ``"q8_0"``, ``"q4_1"``).
      frozen_bytes: bytes of the frozen parameters per format held in.
      trained_bytes: bytes of the trained parameters (fp32 master copies).
      optimizer_bytes: bytes of the optimizer state (fp32 moments of what is trained).
      dequant_bytes: the largest quantized matrix dequantized to the compute dtype:
        a quantized matrix is dequantized right before each use, so one such copy
        is allowed for on top of the peak (0 without quantization).
      program, inplace: liveness reports (program order; after ``inplace_update``),
        the parameters counted at the bytes they are held in.
      seconds: ``{"trace", "passes", "inplace_update", "analyze"}`` (the trace is
        shared by every combination planned together; None when reused from the plan before).
    """

    dtype: str
    quantize: str
    scheme: Any
    trainable: int
    total: int
    held: dict[str, str]
    frozen_bytes: dict[str, int]
    trained_bytes: int
    optimizer_bytes: int
    dequant_bytes: int
    program: Any
    inplace: Any
    seconds: dict[str, float]

    @property
    def name(self) -> str:
        return precision_name(self.dtype, self.quantize)

    @property
    def weight_bytes(self) -> int:
        """All parameters as held: frozen (every format) and trained."""
        return sum(self.frozen_bytes.values()) + self.trained_bytes

    @property
    def peak_bytes(self) -> int:
        """The peak with ``inplace_update`` plus :attr:`dequant_bytes`."""
        return self.inplace.peak_bytes + self.dequant_bytes

    def fits(self, budget_bytes: float) -> bool:
        return self.peak_bytes <= budget_bytes


def plan_precisions(config: Any, scheme: Any = "full", precisions: Any = PRECISIONS, *, batch: int = 1,
                    seq: int = 512, optimizer: Any = None, blocks: int | None = None, donate: bool = True,
                    **analyze_kwargs: Any) -> list[PrecisionPlan]:
    """:func:`plan_precision` for several ``(dtype, quantize)`` combinations, tracing the step once.

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> plans = plan_precisions(LlamaConfig.tiny(), "paper", seq=16)
      >>> [p.name for p in plans]
      ['fp32', 'bf16', 'bf16+int8', 'bf16+int4']
      >>> [p.weight_bytes for p in plans] == sorted((p.weight_bytes for p in plans), reverse=True)
      True
    """
    from pockjax.memory.liveness import analyze

    combos = [check_precision(d, q) for d, q in precisions]
    # traced in float32: the frozen parameters are then counted at the bytes they are
    # held in (bf16, or codes and scales), the trained ones and the moments stay fp32
    w, scheme, desc, graph, inplace_graph, seconds = _traced(
        config, scheme, dtype=jnp.float32, batch=batch, seq=seq, optimizer=optimizer, blocks=blocks)
    rows = {r.path: r for r in desc.rows}
    opt_bytes = sum(b for b, role in zip(_aval_sizes(graph), graph.in_roles) if role == "opt_state")
    donated = {"param", "opt_state"} if donate else False
    out, analysed = [], {}
    for dtype, quantize in combos:
        t0 = time.perf_counter()
        held, frozen, trained, sizes = {}, {}, 0, {}
        for path, r in rows.items():
            fmt = held_format(path, r.shape, r.trainable > 0, dtype, quantize)
            held[path] = fmt
            n = math.prod(r.shape)
            nbytes = int(round(n * _format_bytes_per_value(fmt)))
            sizes[path] = nbytes
            if r.trainable > 0:
                trained += nbytes
            else:
                frozen[fmt] = frozen.get(fmt, 0) + nbytes
        dequant = max((math.prod(rows[p].shape) * _ITEMSIZE[dtype] for p, f in held.items()
                       if f not in _ITEMSIZE), default=0)
        key = tuple(sorted(sizes.items()))
        if key not in analysed:  # precisions that hold every tensor alike (full: all trained) share one
            analysed[key] = [analyze(g, donate=donated, in_bytes=[sizes[p] if role == "param" else None
                                                                  for p, role in zip(g.in_paths, g.in_roles)],
                                     **analyze_kwargs) for g in (graph, inplace_graph)]
        reports = analysed[key]
        secs = dict(seconds, analyze=time.perf_counter() - t0)
        out.append(PrecisionPlan(dtype, quantize, scheme, desc.trainable, desc.total, held, frozen, trained,
                                 opt_bytes, dequant, reports[0], reports[1], secs))
    return out


def _aval_sizes(graph: Any) -> list[int]:
    from pockjax.memory.liveness import aval_bytes

    return [aval_bytes(v.aval) for v in graph.closed_jaxpr.jaxpr.invars]


def plan_precision(config: Any, scheme: Any = "full", *, dtype: str = "fp32", quantize: str = "none",
                   batch: int = 1, seq: int = 512, optimizer: Any = None, blocks: int | None = None,
                   donate: bool = True, **analyze_kwargs: Any) -> PrecisionPlan:
    """Plans one fine-tuning step of a Flax LLaMA under a precision policy, from shapes.

    The policy (what :mod:`pockjax.quant` and ``bf16`` mean in pockjax): the tensors
    the scheme trains, fully or by channels, are fp32 master copies and their AdamW
    moments fp32; the frozen matrices (attention and MLP kernels, embedding, LM head:
    two or more axes, the blocked axis a multiple of 32) are held block-quantized with
    ``quantize="int8"`` (``q8_0``, 34 bytes per 32 values) or ``"int4"`` (``q4_1``,
    20 bytes per 32 values); the other frozen tensors (norm scales, and the matrices
    without ``quantize``) are held in ``dtype``.

    The step is traced in float32 (as :func:`plan_llama` with ``dtype=jnp.float32``)
    and analysed with each parameter input counted at the bytes it is held in
    (``analyze(in_bytes=...)``), so the weights, optimizer state and gradients are
    exact for the policy. The activations are counted at fp32: under ``bf16`` the
    matmul inputs would be stored in bf16, so for ``bf16`` the activation figures
    are an upper bound. A quantized matrix is dequantized right before each use;
    one dequantized copy of the largest (:attr:`PrecisionPlan.dequant_bytes`, in
    ``dtype``) is added to the peak.

    Args:
      config, scheme, batch, seq, optimizer, blocks, donate: as :func:`plan_llama`.
      dtype: ``"fp32"`` or ``"bf16"``: the frozen float tensors' dtype.
      quantize: ``"none"``, ``"int8"`` (``q8_0``) or ``"int4"`` (``q4_1``).
      **analyze_kwargs: passed to :func:`pockjax.memory.analyze`.

    Raises:
      pockjax.errors.PockjaxError: an unknown ``dtype`` or ``quantize``.

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> p = plan_precision(LlamaConfig.tiny(), "paper", dtype="bf16", quantize="int4", seq=16)
      >>> p.name, sorted(p.frozen_bytes), p.held["lm_head.kernel"], p.held["layers.1.mlp.w1.kernel"]
      ('bf16+int4', ['bf16', 'q4_1'], 'q4_1', 'fp32')
      >>> p.trained_bytes == 4 * p.trainable
      True
      >>> p.peak_bytes < plan_precision(LlamaConfig.tiny(), "paper", seq=16).peak_bytes
      True
    """
    return plan_precisions(config, scheme, [(dtype, quantize)], batch=batch, seq=seq, optimizer=optimizer,
                           blocks=blocks, donate=donate, **analyze_kwargs)[0]


def fit_table(plans: Any, budgets_gb: Any = (8, 16, 24)) -> str:
    """A markdown table of :class:`PrecisionPlan` s: the weights split frozen/trained,
    the optimizer state, the peak, and whether it fits each device (GiB).

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> plans = plan_precisions(LlamaConfig.tiny(), "paper", [("fp32", "none"), ("bf16", "int4")], seq=16)
      >>> print(fit_table(plans, [0.0009]).splitlines()[0])
      | scheme | precision | frozen weights | trained weights (fp32) | optimizer state (fp32) | peak | 0.0009 GiB |
    """
    from pockjax.memory.liveness import format_bytes

    budgets = [float(b) for b in budgets_gb]
    lines = ["| scheme | precision | frozen weights | trained weights (fp32) | optimizer state (fp32) | peak |"
             + "".join(f" {b:g} GiB |" for b in budgets),
             "|---|---|---|---:|---:|---:|" + "---|" * len(budgets)]
    for p in plans:
        frozen = ", ".join(f"{fmt} {format_bytes(b)}" for fmt, b in sorted(p.frozen_bytes.items(),
                                                                          key=lambda kv: -kv[1]) if b) or "none"
        fits = "".join(f" {'yes' if p.fits(b * 2**30) else 'no'} |" for b in budgets)
        lines.append(f"| {p.scheme.name} | {p.name} | {frozen} | {format_bytes(p.trained_bytes)} |"
                     f" {format_bytes(p.optimizer_bytes)} | {format_bytes(p.peak_bytes)} |{fits}")
    return "\n".join(lines)

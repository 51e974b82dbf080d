"""The benchmark's rows: one training method each, run in a fresh process.

========================  =========  ==================================================
row                       framework  what it trains and how
========================  =========  ==================================================
torch-full                PyTorch    transformers ``LlamaForCausalLM``, every
                                     parameter, ``torch.optim.AdamW``
torch-lora                PyTorch    PEFT LoRA (rank 8, alpha 16) on q/k/v/o
torch-sparse              PyTorch    the ``paper`` scheme's tensors via
                                     ``requires_grad`` (the rest frozen)
jax-full                  JAX        ``jax.jit`` of ``value_and_grad`` + ``optax.adamw``,
                                     Optax's integer-label cross-entropy
jax-frozen                JAX        the same, differentiating only the ``paper``
                                     scheme's tensors; frozen ones plain inputs
pockjax-full              pockjax    ``pockjax.compile`` of the fine-tuning step of
                                     ``pockjax finetune``, every parameter
pockjax-full-seqloss      pockjax    the same with the loss on every position's
                                     full-vocabulary logits (like ``jax-full``)
pockjax-paper             pockjax    the ``paper`` sparse scheme
pockjax-norm-only         pockjax    RMSNorm scales only
pockjax-channels          pockjax    ``paper`` tensors, half their output channels
pockjax-paper-iree        pockjax    ``paper``, compiled by IREE for ``cpu``
pockjax-lora              pockjax    :func:`pockjax.lora` rank 8 (alpha 16) on q/k/v/o,
                                     as ``torch-lora``
pockjax-paper-lora        pockjax    ``paper`` on its last blocks + LoRA on the
                                     attention of the other blocks
torch-full-bf16           PyTorch    ``torch-full`` under ``torch.autocast``
                                     (bfloat16 products, float32 weights)
torch-lora-bf16           PyTorch    ``torch-lora`` under ``torch.autocast``
pockjax-paper-bf16        pockjax    ``paper``, frozen tensors held in bfloat16, as
                                     ``pockjax finetune --dtype bf16``: bfloat16
                                     products on a GPU, float32 ones on a CPU
pockjax-paper-int8        pockjax    ``paper``, frozen matrices held as int8 blocks
                                     (Q8_0), as ``--quantize int8``
pockjax-paper-int4        pockjax    ``paper``, frozen matrices held as packed 4-bit
                                     blocks (Q4_1), as ``--quantize int4``
pockjax-paper-int8-bf16   pockjax    ``paper``, frozen matrices as int8 blocks and
                                     the other frozen tensors in bfloat16, as
                                     ``--quantize int8 --dtype bf16`` (bfloat16
                                     products on a GPU)
========================  =========  ==================================================

Every row but the last six: fp32, the same batches, next-token cross-entropy over the answer
tokens (mean over the loss mask), AdamW (betas 0.9/0.999, eps 1e-8, no weight
decay). pockjax's step computes logits only on the answer window
(:func:`pockjax.models.llama.answer_loss`), as ``pockjax finetune`` does; the
PyTorch and plain-JAX rows compute them at every position, as their usual
training code does (``pockjax-full-seqloss`` shows what the window is worth).

On ``device="gpu"`` the same rows (less the IREE one, :data:`CPU_ONLY_ROWS`)
run on an NVIDIA GPU: PyTorch on ``cuda``, JAX on its CUDA backend, float32
matmuls without TF32 in both (``torch.backends.cuda.matmul.allow_tf32`` off,
``JAX_DEFAULT_MATMUL_PRECISION=highest``); each row also reports its process's
peak GPU memory (``torch.cuda.max_memory_allocated``, JAX's
``peak_bytes_in_use``).

A row is a function ``row(job) -> dict``; :mod:`benchmarks.harness.worker` runs it
in its own interpreter so that memory and threads are its own.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import numpy as np

from benchmarks.harness.common import (BenchConfig, WarmMark, proc_peak_rss, row_lr,
                                  timed_steps, trim_heap)

__all__ = ["ROWS", "DEFAULT_ROWS", "QUALITY_ROWS", "PRECISION_ROWS", "CPU_ONLY_ROWS", "Row", "default_rows", "run_row"]


class Row:
    """A benchmark row: ``framework`` (torch / jax / pockjax), ``kind`` and options."""

    def __init__(self, name: str, framework: str, kind: str, description: str, **options: Any):
        self.name, self.framework, self.kind = name, framework, kind
        self.description, self.options = description, options

    def __repr__(self) -> str:
        return f"Row({self.name!r})"


ROWS = {r.name: r for r in [
    Row("torch-full", "torch", "full", "PyTorch + transformers, full fine-tuning"),
    Row("torch-lora", "torch", "lora", "PyTorch + PEFT LoRA rank 8 on q/k/v/o"),
    Row("torch-sparse", "torch", "sparse", "PyTorch, paper scheme via requires_grad"),
    Row("jax-full", "jax", "full", "plain JAX (jit + optax), full fine-tuning"),
    Row("jax-frozen", "jax", "frozen", "plain JAX, paper scheme, frozen params as inputs"),
    Row("pockjax-full", "pockjax", "full", "pockjax, full fine-tuning"),
    Row("pockjax-full-seqloss", "pockjax", "full", "pockjax, full, loss on every position",
        seqloss=True),
    Row("pockjax-paper", "pockjax", "paper", "pockjax, paper sparse scheme"),
    Row("pockjax-norm-only", "pockjax", "norm-only", "pockjax, RMSNorm scales only"),
    Row("pockjax-channels", "pockjax", "channels", "pockjax, paper tensors, half the channels"),
    Row("pockjax-paper-iree", "pockjax", "paper", "pockjax, paper scheme, IREE cpu", target="cpu"),
    Row("pockjax-lora", "pockjax", "lora", "pockjax, LoRA rank 8 on q/k/v/o (as torch-lora)"),
    Row("pockjax-paper-lora", "pockjax", "paper-lora", "pockjax, paper scheme + LoRA on the other blocks"),
    Row("torch-full-bf16", "torch", "full", "PyTorch full fine-tuning, bf16 autocast", precision="bf16"),
    Row("torch-lora-bf16", "torch", "lora", "PyTorch + PEFT LoRA rank 8, bf16 autocast", precision="bf16"),
    Row("pockjax-paper-bf16", "pockjax", "paper", "pockjax, paper scheme, frozen in bf16 (--dtype bf16)",
        precision="bf16"),
    Row("pockjax-paper-int8", "pockjax", "paper", "pockjax, paper scheme, frozen int8 (--quantize int8)",
        precision="int8"),
    Row("pockjax-paper-int4", "pockjax", "paper", "pockjax, paper scheme, frozen int4 (--quantize int4)",
        precision="int4"),
    Row("pockjax-paper-int8-bf16", "pockjax", "paper",
        "pockjax, paper scheme, frozen int8, bf16 products on a GPU (--quantize int8 --dtype bf16)",
        precision="int8-bf16"),
]}

#: Rows that train in another precision than float32 (``--rows`` only: not in
#: a default run; ``benchmarks/precision.py`` measures their quality).
PRECISION_ROWS = tuple(n for n, r in ROWS.items() if r.options.get("precision"))
#: Rows of a default speed run.
DEFAULT_ROWS = tuple(n for n in ROWS if n not in PRECISION_ROWS)
#: Rows of a default quality run (the two variants that compute the same
#: update as another row are left out).
QUALITY_ROWS = tuple(n for n in DEFAULT_ROWS if n not in ("pockjax-full-seqloss", "pockjax-paper-iree"))
#: Rows that run on the host CPU whatever the device (IREE's ``cpu`` target).
CPU_ONLY_ROWS = tuple(n for n, r in ROWS.items() if r.options.get("target") == "cpu")


def default_rows(device: str = "cpu") -> tuple[str, ...]:
    """The rows of a default speed run on ``device`` (``cpu`` or ``gpu``).

    Example:
        >>> [r for r in default_rows("cpu") if r not in default_rows("gpu")]
        ['pockjax-paper-iree']
    """
    return DEFAULT_ROWS if device == "cpu" else tuple(r for r in DEFAULT_ROWS if r not in CPU_ONLY_ROWS)


# -- shared ------------------------------------------------------------------------------


def _load_batches(job: dict) -> list[dict]:
    with np.load(job["data"]) as z:
        arrays = {k: z[k] for k in z.files}
    n = arrays["tokens"].shape[0]
    return [{k: v[i] for k, v in arrays.items()} for i in range(n)]


def _finish(job: dict, times: list[float], losses: list[float], setup_s: float,
            train_peak: int, rss_before: int, extra: dict) -> dict:
    return {"row": job["row"], "phase": job["phase"], "step_times": times, "losses": losses,
            "setup_s": setup_s, "train_peak_rss": train_peak, "rss_before_train": rss_before,
            "process_peak_rss": extra.pop("process_peak_rss", 0), **extra}


# -- PyTorch -------------------------------------------------------------------------------


def _torch_model(job: dict):
    import torch
    from transformers import AutoModelForCausalLM

    if job.get("hf_dir"):
        return AutoModelForCausalLM.from_pretrained(job["hf_dir"], dtype=torch.float32)
    path = job["gguf"]
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32)


def torch_row(job: dict) -> dict:
    """Trains with PyTorch (``full``, ``lora`` or ``sparse``) and reports timings."""
    import torch

    cfg = BenchConfig.from_dict(job["config"])
    kind = job["kind"]
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    # Subnormal floats flushed to zero, as XLA's CPU runtime does in its compute
    # threads: subnormal arithmetic is many times slower on x86, and a slow-down
    # PyTorch's default would suffer from must not flatter the other rows.
    torch.set_flush_denormal(True)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    dev = torch.device("cuda" if cfg.device == "gpu" else "cpu")
    if cfg.device == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 as on the CPU (PyTorch's default)
        torch.backends.cudnn.allow_tf32 = False
    model = _torch_model(job).to(dev)
    model.config.use_cache = False
    lr = row_lr(kind, cfg)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0, bias="none",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        model = get_peft_model(model, lora)
    elif kind == "sparse":
        names = set(job["trainable"])
        found = set()
        for name, p in model.named_parameters():
            p.requires_grad_(name in names)
            found.add(name)
        if names - found:
            raise ValueError(f"the scheme names tensors the model lacks: {sorted(names - found)[:3]}")
    elif kind != "full":
        raise ValueError(f"unknown torch row kind {kind!r}")
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    batches = [{k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in b.items()}
               for b in _load_batches(job)]
    setup_s = time.perf_counter() - t0
    process_peak = proc_peak_rss()
    trim_heap()

    precision = ROWS[job["row"]].options.get("precision")
    if precision not in (None, "bf16"):
        raise ValueError(f"PyTorch rows run in float32 or bf16 autocast, not {precision!r}")

    def forward(tokens):
        if precision is None:
            return model(input_ids=tokens).logits
        with torch.autocast(dev.type, dtype=torch.bfloat16):  # bfloat16 products, float32 weights
            return model(input_ids=tokens).logits

    def step(i):
        b = batches[i % len(batches)]
        logits = forward(b["tokens"].long())
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                b["targets"].reshape(-1).long(), reduction="none")
        w = b["loss_mask"].reshape(-1).float()
        loss = (nll * w).sum() / w.sum().clamp(min=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    warm = WarmMark()

    n_warm, n_timed = _counts(job, cfg, len(batches))
    counted = {}

    def first_counted(i):
        # The first warm-up step of the speed phase also counts the step's matrix-product
        # FLOPs (forward and backward), as pockjax.count_flops(..., matmul_only=True) does
        # for the JAX rows; the counter slows that step, which is not timed.
        if i > 0 or n_warm == 0 or job["phase"] != "speed":
            return step(i)
        with _torch_flop_counter() as counter:
            loss = step(i)
        counted["flops"] = float(counter.get_total_flops())
        return loss

    times, losses = timed_steps(first_counted, n_warm, n_timed, on_warm=warm)
    extra = {"trainable_params": sum(p.numel() for p in trainable),
             "total_params": sum(p.numel() for p in model.parameters()),
             "process_peak_rss": max(process_peak, proc_peak_rss()),
             "step_flops": counted.get("flops"), **_torch_blas()}
    if cfg.device == "gpu":
        extra["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    train_peak = proc_peak_rss()
    if job.get("save"):
        if kind == "lora":
            model = model.merge_and_unload()
        _save_torch(model, job["save"])
    return _finish(job, times, losses, setup_s, train_peak, warm.rss_before_train(), extra)


def _torch_blas() -> dict:
    """Whether this PyTorch does its CPU matmuls with Intel MKL, and whether the
    vendor shim of :mod:`benchmarks.harness.mkl` is loaded in this process."""
    import torch

    from benchmarks.harness.mkl import SHIM_NAME

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            shim = SHIM_NAME in f.read()
    except OSError:
        shim = False
    return {"torch_mkl": bool(torch.backends.mkl.is_available()), "mkl_vendor_shim": shim}


def _torch_flop_counter():
    """PyTorch's FLOP counter, taught the fused attention kernels of the CPU and
    grouped-query attention.

    ``FlopCounterMode`` counts the CUDA attention kernels but not
    ``_scaled_dot_product_flash_attention_for_cpu`` (which ``transformers``
    models reach on the CPU); without its formulas a CPU step's attention
    products would count as zero. And PyTorch before 2.12 refuses to count a
    kernel given fewer key/value heads than query heads (a GQA model under
    bf16 autocast on CUDA). The formulas here are PyTorch's own, on key and
    value shapes widened to the query's heads, as the kernels broadcast them
    (the backward recomputes the scores, as the kernels do).
    """
    import torch
    from torch.utils import flop_counter

    def widened(q, k, v):
        return q, (*k[:1], q[1], *k[2:]), (*v[:1], q[1], *v[2:])

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(*widened(q, k, v))

    def backward(grad, q, k, v, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad, *widened(q, k, v))

    aten = torch.ops.aten
    kernels = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    mapping = {}
    for name in kernels:
        for op, formula in ((name, forward), (name + "_backward", backward)):
            if hasattr(aten, op):
                mapping[getattr(aten, op)] = formula
    return flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)


def _save_torch(model, path: str) -> None:
    """Writes ``config.json`` + ``model.safetensors`` (``save_pretrained`` refuses
    models loaded from GGUF; the tensors are plain fp32 after loading), each
    atomically and durably (:mod:`pockjax.io`)."""
    from pockjax.io.atomic import write_json
    from pockjax.io.safetensors import write_safetensors

    os.makedirs(path, exist_ok=True)
    # .numpy() refuses a dtype NumPy lacks (bfloat16) rather than converting it
    tensors = {k: v.detach().cpu().contiguous().numpy() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # shares the embedding's storage
    config.pop("quantization_config", None)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, metadata={"format": "pt"})
    write_json(os.path.join(path, "config.json"), config, indent=1, ensure_ascii=True, default=str)


def _counts(job: dict, cfg: BenchConfig, n_batches: int) -> tuple[int, int]:
    if job["phase"] == "quality":
        return 0, n_batches
    return cfg.warmup, cfg.steps


# -- JAX and pockjax -------------------------------------------------------------------------


def _jax_model(job: dict, cfg: BenchConfig):
    from pockjax.models import llama

    if job.get("hf_dir"):
        return llama.load_hf_checkpoint(job["hf_dir"])
    model, _ = llama.load_pretrained(job["gguf"])
    return model


def _scheme(name: str, config, cfg: BenchConfig):
    import pockjax
    from pockjax.train.schemes import llama_scheme

    adapters = ("layers.*.attn.w[qkvo].kernel", pockjax.lora(cfg.lora_rank, alpha=2 * cfg.lora_rank))
    if name == "lora":  # the torch-lora row's rank and targets
        return pockjax.UpdateScheme([adapters], name=f"lora (rank {cfg.lora_rank})")
    if name == "paper-lora":  # the paper scheme's rules match first, LoRA takes the other blocks' attention
        paper = llama_scheme("paper", config, blocks=cfg.blocks)
        return pockjax.UpdateScheme(list(paper.rules) + [adapters], name=f"{paper.name} + lora")
    return llama_scheme(name, config, blocks=cfg.blocks)


def jax_row(job: dict) -> dict:
    """Trains with plain JAX + Optax (``full`` or ``frozen``)."""
    import jax
    import jax.numpy as jnp
    import optax

    from pockjax.models import llama

    cfg = BenchConfig.from_dict(job["config"])
    t0 = time.perf_counter()
    model = _jax_model(job, cfg)
    config = model.config
    graphdef, params = llama.split(model)
    del model
    tx = optax.adamw(row_lr(job["kind"], cfg), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    flat = llama.flatten_params(params)
    frozen = None

    def loss_of(p, b):
        logits = llama.apply(graphdef, p, b["tokens"])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
        w = b["loss_mask"]
        return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)

    if job["kind"] == "full":
        def step(p, opt_state, b):
            loss, g = jax.value_and_grad(loss_of)(p, b)
            updates, opt_state = tx.update(g, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss

        trained, extra_args = params, ()
    elif job["kind"] == "frozen":
        scheme = _scheme("paper", config, cfg)
        names = {path for path, _ in scheme.rules}
        train = {k: v for k, v in flat.items() if k in names}
        frozen = {k: v for k, v in flat.items() if k not in names}

        def loss_split(tr, fr, b):
            return loss_of(llama.unflatten_params({**tr, **fr}), b)

        def step(tr, opt_state, b, fr):
            loss, g = jax.value_and_grad(loss_split)(tr, fr, b)
            updates, opt_state = tx.update(g, opt_state, tr)
            return optax.apply_updates(tr, updates), opt_state, loss

        trained, extra_args = train, (frozen,)  # frozen parameters: a plain extra input
    else:
        raise ValueError(f"unknown jax row kind {job['kind']!r}")

    jitted = jax.jit(step, donate_argnums=(0, 1))
    batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in _load_batches(job)]
    trainable_n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(trained))
    holder = {"p": trained, "o": tx.init(trained)}

    def run(i):
        holder["p"], holder["o"], loss = jitted(holder["p"], holder["o"], batches[i % len(batches)],
                                               *extra_args)
        return loss

    def step_flops():
        import pockjax

        return pockjax.count_flops(jax.make_jaxpr(step)(holder["p"], holder["o"], batches[0], *extra_args),
                                   matmul_only=True)
    del flat, params, trained

    def final_params():
        if frozen is None:
            return holder["p"]
        return llama.unflatten_params({**holder["p"], **frozen})

    return _jax_loop(job, cfg, run, t0, trainable_n, final_params, graphdef, step_flops=step_flops)


def _jax_loop(job, cfg, run, t0, trainable_n, final_params, graphdef, compile_s=None,
              step_flops: Callable[[], float] | None = None) -> dict:
    n_batches = int(np.load(job["data"])["tokens"].shape[0])
    setup_s = time.perf_counter() - t0
    process_peak = proc_peak_rss()
    trim_heap()
    warm = WarmMark()

    n_warm, n_timed = _counts(job, cfg, n_batches)
    times, losses = timed_steps(run, n_warm, n_timed, on_warm=warm)
    train_peak = proc_peak_rss()
    extra = {"trainable_params": int(trainable_n), "compile_s": compile_s,
             "process_peak_rss": max(process_peak, proc_peak_rss())}
    if step_flops is not None and job["phase"] == "speed":
        extra["step_flops"] = float(step_flops())  # after the timed steps: tracing is not setup
    if cfg.device == "gpu":
        import jax

        extra["device_peak_bytes"] = int((jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0))
    if job.get("save"):
        from pockjax.models import llama

        llama.save_hf_checkpoint(llama.merge(graphdef, final_params()), job["save"])
    return _finish(job, times, losses, setup_s, train_peak, warm.rss_before_train(), extra)


def pockjax_row(job: dict) -> dict:
    """Trains with ``pockjax.compile`` (a scheme, optionally an IREE target)."""
    import jax.numpy as jnp
    import optax

    import pockjax
    from pockjax.models import llama
    from pockjax.train.steps import ANSWER_STEP_XLA_OPTIONS, answer_train_step, lm_train_step

    cfg = BenchConfig.from_dict(job["config"])
    if cfg.device == "cpu":
        # First thing, before JAX starts its CPU client: each step reuses its working
        # memory instead of faulting it in again (as `pockjax finetune` runs).
        pockjax.keep_step_memory(quiet=True)
    row = ROWS[job["row"]]
    t0 = time.perf_counter()
    model = _jax_model(job, cfg)
    config = model.config
    scheme = _scheme(job["kind"], config, cfg)
    graphdef, params = llama.split(model)
    del model
    if scheme.has_lora:
        params = pockjax.add_adapters(params, scheme, seed=cfg.seed)
    params, compute = _held_precision(params, config, scheme, row.options.get("precision"))
    tx = optax.adamw(row_lr(job["kind"], cfg), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    window = int(job["window"])

    xla_options = None
    if row.options.get("seqloss"):
        seq_step = lm_train_step(graphdef, tx)

        def train_step(p, opt_state, b):
            return seq_step(p, opt_state, b["tokens"], b["targets"], b["loss_mask"])
    else:
        train_step = answer_train_step(graphdef, tx, window)
        if row.options.get("target") is None and cfg.device == "cpu":
            xla_options = ANSWER_STEP_XLA_OPTIONS  # as pockjax finetune compiles it

    f = pockjax.compile(train_step, scheme=scheme, target=row.options.get("target"),
                        xla_options=xla_options, precision=compute)
    opt_state = pockjax.init_opt_state(tx, params, scheme)
    batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in _load_batches(job)]
    tc = time.perf_counter()
    compiled = f.lower(params, opt_state, batches[0]).compile()
    compile_s = time.perf_counter() - tc
    flops = pockjax.count_flops(compiled.graph, matmul_only=True)  # the step after the passes
    holder = {"p": params, "o": opt_state}
    del params, opt_state

    def run(i):
        holder["p"], holder["o"], loss = f(holder["p"], holder["o"], batches[i % len(batches)])
        return loss

    trainable_n = scheme.describe(holder["p"]).trainable
    out = _jax_loop(job, cfg, run, t0, trainable_n, lambda: pockjax.adapters.merge(holder["p"]), graphdef, compile_s,
                    step_flops=lambda: flops)
    out["xla_options"] = dict(xla_options or {})
    out["weights_bytes"] = pockjax.quant.tree_nbytes(holder["p"])
    return out


#: A precision row's ``pockjax finetune`` flags: ``(--quantize, --dtype)``.
ROW_PRECISIONS = {"bf16": ("none", "bf16"), "int8": ("int8", "fp32"), "int4": ("int4", "fp32"),
                  "int8-bf16": ("int8", "bf16")}


def _held_precision(params: dict, config, scheme, precision: str | None):
    """``(params, compute)``: ``params`` with the scheme's frozen tensors held as
    ``pockjax finetune --quantize Q --dtype D`` holds them (:data:`ROW_PRECISIONS`),
    and the step's compute policy for :func:`pockjax.compile` (as that command's)."""
    if precision is None:
        return params, None
    if precision not in ROW_PRECISIONS:
        raise ValueError(f"unknown row precision {precision!r}: {', '.join(ROW_PRECISIONS)}")
    from pockjax.models.llama.mixed import DTYPES, hold_frozen
    from pockjax.paths import flatten_params
    from pockjax.train.finetune import _compute_precision

    quantize, dtype = ROW_PRECISIONS[precision]
    frozen = scheme.frozen_paths(flatten_params(params), lora_bases=True)
    return (hold_frozen(params, config, frozen.__contains__, quantize=quantize, dtype=DTYPES[dtype]),
            _compute_precision(dtype))


_RUNNERS: dict[str, Callable[[dict], dict]] = {"torch": torch_row, "jax": jax_row, "pockjax": pockjax_row}


def run_row(job: dict) -> dict:
    """Runs the row ``job["row"]`` of a job written by :mod:`benchmarks.harness.runner`."""
    if job["row"] not in ROWS:
        raise ValueError(f"unknown row {job['row']!r}; rows: {', '.join(ROWS)}")
    row = ROWS[job["row"]]
    job = {**job, "kind": row.kind}
    return _RUNNERS[row.framework](job)


def default_save_dir() -> str:
    return tempfile.mkdtemp(prefix="pockjax-bench-")

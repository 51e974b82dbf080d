"""Workloads of the memory benchmarks (importable, so picklable: they run in fresh
processes measured by ``_memory_rss.peak_rss``).

Every LLaMA step here is the Flax model's (:mod:`pockjax.models.llama`), built by
:func:`pockjax.memory.llama_plan.abstract_llama_step` with a scheme of
:mod:`pockjax.schemes` (the ones ``pockjax finetune`` trains); this module only
adds real arguments (pretrained weights for ``smollm2-135m``, random ones for
``tiny``) to run it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: ``--model`` names of the memory benchmarks.
MODELS = ("tiny", "smollm2-135m")


def baseline(n: int = 64) -> int:
    """Import JAX and run one tiny jitted op: the floor every JAX process pays."""
    import jax
    import jax.numpy as jnp

    return int(jax.jit(lambda x: x * 2)(jnp.ones(n)).sum())


def model_config(model: str, seq: int):
    """``tiny`` (a 4-block d128 LLaMA) or ``smollm2-135m``, with room for ``seq`` tokens."""
    from pockjax.models.llama import LlamaConfig

    if model == "tiny":
        return LlamaConfig(vocab=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, hidden_dim=344,
                           max_seq_len=max(seq, 64))
    if model in ("smollm2-135m", "smollm2"):
        return LlamaConfig.smollm2_135m(max_seq_len=max(seq, 512))
    raise ValueError(f"unknown model {model!r}; known: {MODELS}")


@dataclasses.dataclass
class Workload:
    """A train step, its arguments, its scheme (None: plain optax state), config, optimizer."""

    step: Any
    args: tuple
    scheme: Any
    config: Any
    tx: Any


def llama_workload(model: str = "tiny", scheme: str | None = "full", *, batch: int = 4, seq: int = 128,
                   lr: float = 1e-4, abstract: bool = True, seed: int = 0) -> Workload:
    """The AdamW fine-tuning step of the Flax LLaMA and its arguments.

    ``abstract=True``: ``jax.ShapeDtypeStruct`` arguments (nothing allocated). Otherwise
    real ones: the pretrained GGUF for ``smollm2-135m``, random weights for ``tiny``, random
    tokens; the optimizer state is built under ``jax.jit`` so that the state of frozen
    parameters is never allocated.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax
    from pockjax.memory.llama_plan import abstract_llama_step
    from pockjax.models import llama

    cfg = model_config(model, seq)
    w = abstract_llama_step(cfg, scheme, batch=batch, seq=seq, optimizer=optax.adamw(lr))
    if abstract:
        return Workload(w.step, w.args, w.scheme, cfg, w.tx)
    if model == "tiny":
        _, params = llama.split(llama.Llama(cfg, rngs=nnx.Rngs(seed)))
    else:
        m, _ = llama.load_pretrained("smollm2-135m", max_seq_len=cfg.max_seq_len)
        _, params = llama.split(m)
        del m
    if w.scheme is None:
        opt_state = jax.jit(w.tx.init)(params)
    else:
        opt_state = jax.jit(lambda p: pockjax.init_opt_state(w.tx, p, w.scheme))(params)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, cfg.vocab)
    b = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((batch, seq), jnp.float32)}
    return Workload(w.step, (params, opt_state, b), w.scheme, cfg, w.tx)


def train_llama_steps(kind: str = "smollm2-135m", scheme: str = "full", batch: int = 1, seq: int = 256,
                      steps: int = 2) -> dict:
    """Compile the step with ``pockjax.compile`` (parameters and optimizer state donated),
    load real arguments, run ``steps`` steps; XLA's figures of the executable."""
    import time

    import pockjax
    from pockjax.memory import memory_report

    w = llama_workload(kind, scheme, batch=batch, seq=seq, abstract=True)
    t0 = time.perf_counter()
    f = pockjax.compile(w.step, scheme=w.scheme)
    rep = memory_report(f.lower(*w.args).compile())
    t1 = time.perf_counter()
    params, opt_state, b = llama_workload(kind, scheme, batch=batch, seq=seq, abstract=False).args
    loss = None
    for _ in range(steps):
        params, opt_state, loss = f(params, opt_state, b)
        loss = float(loss)
    return {"loss": loss, "xla": rep.xla, "planner": rep.after.peak_bytes, "compile_s": t1 - t0,
            "run_s": time.perf_counter() - t1}

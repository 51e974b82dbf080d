"""Training processes measured by ``memory_rss_vs_torch.py`` (importable: run in fresh
interpreters by ``_memory_rss.peak_rss``)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.harness

from benchmarks.harness.common import proc_peak_rss as _hwm  # noqa: E402
from benchmarks.harness.common import proc_rss as _rss  # noqa: E402
from benchmarks.harness.common import reset_peak_rss as _reset_hwm  # noqa: E402
from benchmarks.harness.common import trim_heap as _trim  # noqa: E402


def jax_baseline() -> int:
    """Import JAX and run one tiny jitted op: the floor every JAX process pays."""
    import jax
    import jax.numpy as jnp

    return int(jax.jit(lambda x: x * 2)(jnp.ones(8)).sum())


def torch_baseline() -> int:
    """Import torch and transformers' LLaMA: the floor of the PyTorch process."""
    import torch
    from transformers import LlamaForCausalLM  # noqa: F401

    return int(torch.ones(8).sum())


def pockjax_train(scheme: str = "full", pipeline: str = "default", batch: int = 4, seq: int = 128,
                  steps: int = 3, remat_budget: float = 0.0, model: str = "smollm2-135m") -> dict:
    """Compile the Flax LLaMA AdamW step from shapes, load the weights, run ``steps`` steps.

    ``pipeline``: ``default`` (sparse_grad + dce), ``inplace`` (+ inplace_update),
    ``memory`` (+ inplace_update + reorder_for_memory(remat_budget)).
    """
    import dataclasses

    import jax
    import numpy as np
    from _memory_workloads import llama_workload

    import pockjax
    from pockjax.memory import memory_report
    from pockjax.models import llama
    from pockjax.optim.state import SparseOptState
    from pockjax.transforms.inplace_update import inplace_update
    from pockjax.transforms.reorder_for_memory import reorder_for_memory

    t0 = time.perf_counter()
    w = llama_workload(model, scheme, batch=batch, seq=seq, abstract=True)
    sparse_state = isinstance(w.args[1], SparseOptState)
    passes = pockjax.default_passes(w.scheme, sparse_state)
    if pipeline in ("inplace", "memory"):
        passes = pockjax.chain(passes, inplace_update())
    if pipeline == "memory":
        passes = pockjax.chain(passes, reorder_for_memory(remat_budget or None))
    f = pockjax.compile(w.step, scheme=w.scheme, passes=passes)
    cs = f.lower(*w.args).compile()
    rep = memory_report(cs)
    t1 = time.perf_counter()

    # real weights (the pretrained GGUF for smollm2-135m), optimizer state, a token batch
    real = llama_workload(model, scheme, batch=batch, seq=seq, abstract=False)
    params, opt_state, b = real.args
    del real
    t2 = time.perf_counter()
    setup_peak = _hwm()
    _trim()
    rss_before_train = _rss()
    _reset_hwm()
    losses = []
    for _ in range(steps):
        params, opt_state, loss = f(params, opt_state, b)
        losses.append(float(loss))
    jax.block_until_ready(params)
    t3 = time.perf_counter()
    assert len(f._cache) == 1, "the real arguments did not hit the step compiled from shapes"
    return {
        "losses": losses,
        "planner_before": rep.before.peak_bytes,
        "planner": rep.after.peak_bytes,
        "xla": rep.xla,
        "hlo": rep.hlo,
        "passes": list(cs.graph.pass_names),
        "meta": {r.name: dataclasses.asdict(r) for r in cs.graph.history
                 if r.name in ("inplace_update", "reorder_for_memory")},
        "compile_s": t1 - t0,
        "load_s": t2 - t1,
        "step_s": (t3 - t2) / steps,
        "finite": bool(np.all(np.isfinite(losses))),
        "setup_peak": setup_peak,
        "rss_before_train": rss_before_train,
        "train_peak": _hwm(),
    }


def torch_train(batch: int = 4, seq: int = 128, steps: int = 3, lr: float = 1e-4, threads: int = 2) -> dict:
    """transformers ``LlamaForCausalLM`` from the same GGUF, full fine-tuning with
    ``torch.optim.AdamW``, fp32, the same batch shape and next-token loss."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from pockjax.models.llama import pretrained_path

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    path = pretrained_path("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t1 = time.perf_counter()
    setup_peak = _hwm()
    _trim()
    rss_before_train = _rss()
    _reset_hwm()
    losses = []
    for _ in range(steps):
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        del logits, loss
    t2 = time.perf_counter()
    n_params = sum(p.numel() for p in model.parameters())
    return {"losses": losses, "load_s": t1 - t0, "step_s": (t2 - t1) / steps, "n_params": n_params,
            "torch": torch.__version__, "setup_peak": setup_peak, "rss_before_train": rss_before_train,
            "train_peak": _hwm()}

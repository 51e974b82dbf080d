"""Workloads run in fresh processes by memory benchmarks (importable, so picklable)."""

from __future__ import annotations


def baseline(n: int = 64) -> int:
    """Import JAX and run one tiny jitted op: the floor every JAX process pays."""
    import jax
    import jax.numpy as jnp

    return int(jax.jit(lambda x: x * 2)(jnp.ones(n)).sum())


def train_llama_steps(kind: str = "smollm2", sparse: bool = False, batch: int = 1, seq: int = 256,
                      steps: int = 2, donate: bool = True) -> dict:
    """Build a LLaMA-shaped model, compile its AdamW step and run ``steps`` steps."""
    import time

    import jax
    import jax.numpy as jnp
    import optax

    from pockjax.memory.llama_shapes import LlamaShape, _split, init_params, make_train_step, paper_trainable
    from pockjax.memory.planner import xla_memory

    cfg = LlamaShape.smollm2_135m() if kind == "smollm2" else LlamaShape(vocab=512, dim=128, n_layers=4, n_heads=4, hidden=344)
    opt = optax.adamw(1e-4)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab)
    b = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    if sparse:
        train, frozen = _split(params, paper_trainable)
        args = (train, frozen, opt.init(train), b)
        donate_argnums = (0, 2) if donate else ()
    else:
        args = (params, opt.init(params), b)
        donate_argnums = (0, 1) if donate else ()
    del params
    step = jax.jit(make_train_step(cfg, opt, paper_trainable if sparse else None), donate_argnums=donate_argnums)
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    t1 = time.perf_counter()
    loss = None
    for _ in range(steps):
        out = compiled(*args)
        if sparse:
            args = (out[0], args[1], out[1], args[3])
        else:
            args = (out[0], out[1], args[2])
        loss = float(out[-1])
    return {"loss": loss, "xla": xla_memory(compiled), "compile_s": t1 - t0, "run_s": time.perf_counter() - t1}

"""IREE (ahead of time) against XLA (in process): step time and module size.

Compiles the same LLaMA fine-tuning step, full and with the ``paper`` sparse
scheme, with ``pockjax.compile`` (XLA) and ``pockjax.compile(target=...)``
(IREE), runs both on this machine in the same process, and prints the median
step time of each, their ratio and the IREE module's size.

    python benchmarks/iree_vs_xla.py --model smollm2-135m --batch-size 2 --seq-len 64
    python benchmarks/iree_vs_xla.py --model tiny --steps 3      # seconds, used by the tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def build(model_name: str):
    from flax import nnx

    from pockjax.models import llama

    if model_name == "tiny":
        return llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    model, _ = llama.load_pretrained(model_name)
    return model


def time_steps(step, params, opt_state, batch, steps: int) -> list[float]:
    import numpy as np

    params, opt_state, loss = step(params, opt_state, *batch)  # warm-up
    np.asarray(loss)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *batch)
        np.asarray(loss)  # wait for the result
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--schemes", default="full,paper")
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optax

    import pockjax
    from pockjax.models import llama
    from pockjax.train.schemes import DEFAULT_BLOCKS, llama_scheme
    from pockjax.train.steps import lm_train_step

    model = build(args.model)
    graphdef, params = llama.split(model)
    tx = optax.adamw(1e-4)
    shape = (args.batch_size, args.seq_len)
    tokens = jax.random.randint(jax.random.key(0), shape, 0, model.config.vocab)
    batch = (tokens, tokens, jnp.ones(shape, jnp.float32))
    blocks = args.blocks or min(DEFAULT_BLOCKS, model.config.n_layers)
    rows = []
    for name in args.schemes.split(","):
        scheme = llama_scheme(name, model.config, blocks=blocks)
        result = {"scheme": name, "model": args.model, "batch": args.batch_size, "seq": args.seq_len}
        for backend in ("xla", args.target):
            step = pockjax.compile(
                lm_train_step(graphdef, tx), scheme=scheme, target=None if backend == "xla" else backend
            )
            p = jax.tree.map(jnp.copy, params)
            s = pockjax.init_opt_state(tx, p, scheme)
            t0 = time.perf_counter()
            compiled = step.lower(p, s, *batch)
            result[f"{backend}_compile_s"] = time.perf_counter() - t0
            result[f"{backend}_step_s"] = statistics.median(time_steps(step, p, s, batch, args.steps))
            if backend != "xla":
                result["module_bytes"] = compiled.executable.exe.compiled.size_bytes
        result["ratio"] = result[f"{args.target}_step_s"] / result["xla_step_s"]
        rows.append(result)
        print(
            f"{args.model} {name:6s} XLA {result['xla_step_s'] * 1e3:9.1f} ms  "
            f"IREE {args.target} {result[f'{args.target}_step_s'] * 1e3:9.1f} ms  "
            f"ratio {result['ratio']:.2f}x  module {result['module_bytes'] / 1024:.0f} KiB",
            flush=True,
        )
    if args.json:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.json)), delete=False) as f:
            json.dump(rows, f, indent=2)
        os.replace(f.name, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``pockjax export``: compile a LLaMA fine-tuning step for a device with IREE.

Example::

    pockjax export --model smollm2-135m --scheme paper --target arm64 --out out/step-arm64
    pockjax export --model tiny --scheme full --target cpu --out /tmp/step

The output directory holds ``module.vmfb``, ``module.json`` and the initial
weights; ``pockjax.runtime.load(dir)`` runs it without JAX.
"""

from __future__ import annotations

import argparse
import time


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="compile a sparse fine-tuning step ahead of time with IREE and write it to a directory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a .gguf / checkpoint path, or 'tiny'")
    p.add_argument("--scheme", default="paper", help="full, paper, norm-only, channels, or a scheme JSON file")
    p.add_argument("--blocks", type=int, default=None, help="last blocks the paper scheme trains")
    p.add_argument("--target", default="cpu", help="cpu, arm64, vulkan, cuda or dsp")
    p.add_argument("--cpu", default=None, help="IREE CPU name for llvm-cpu targets (e.g. cortex-a76)")
    p.add_argument("--arch", default=None, help="GPU architecture (e.g. sm_80)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import llama
    from pockjax.train.schemes import DEFAULT_BLOCKS, llama_scheme
    from pockjax.train.steps import lm_train_step

    if args.model == "tiny":
        model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    else:
        model, _ = llama.load_pretrained(args.model)
    if args.seq_len > model.config.max_seq_len:
        raise SystemExit(f"--seq-len {args.seq_len} is beyond the model's context of {model.config.max_seq_len}")
    graphdef, params = llama.split(model)
    scheme = llama_scheme(args.scheme, model.config, blocks=args.blocks or min(DEFAULT_BLOCKS, model.config.n_layers))
    tx = optax.adamw(args.lr)
    train_step = lm_train_step(graphdef, tx)

    options = {k: v for k, v in (("cpu", args.cpu), ("arch", args.arch)) if v}
    step = pockjax.compile(train_step, scheme=scheme, target=args.target, target_options=options)
    shape = (args.batch_size, args.seq_len)
    batch = (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.ones(shape, jnp.float32))
    opt_state = pockjax.init_opt_state(tx, params, scheme)
    t0 = time.perf_counter()
    path = step.export(args.out, params, opt_state, *batch)
    print(f"exported a {args.scheme} step for {args.target} to {path} in {time.perf_counter() - t0:.1f} s")
    return 0

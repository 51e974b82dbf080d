"""What the memory passes buy, per backend: peak memory and step time with and without them.

For each workload (a small LLaMA trained full and with the ``paper`` scheme, a
small CNN with BatchNorm trained full and sparse) and each backend (XLA in
process, IREE ``cpu``), every pipeline runs in a fresh process:

* ``default``: :func:`pockjax.default_passes` (what ``pockjax.compile`` runs),
* ``+inplace``: then :func:`pockjax.inplace_update`,
* ``+reorder``: then :func:`pockjax.reorder_for_memory` with a recomputation budget.

Each process compiles the step, runs one warm-up step, resets the process's
high-water mark (``/proc/self/clear_refs``), runs ``--steps`` timed steps and
reports the training-phase peak RSS (``VmHWM``), the median step time and, on
XLA, ``memory_analysis()``'s temporaries. Rounds alternate the pipelines so
that machine noise hits them alike; the table gives medians over rounds.

Usage: ``python benchmarks/memory_passes.py [--rounds 3] [--steps 10] [--backends xla,iree]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = ("llama-full", "llama-paper", "cnn-full", "cnn-sparse")
PIPELINES = ("default", "+inplace", "+reorder")
REMAT_BUDGET = 2e9


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _llama(scheme_name: str):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from pockjax.models import llama
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import lm_train_step

    config = llama.LlamaConfig.tiny(vocab=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                                    hidden_dim=688, max_seq_len=128)
    graphdef, params = llama.split(llama.Llama(config, rngs=nnx.Rngs(0)))
    tx = optax.adamw(1e-3)
    tokens = jax.random.randint(jax.random.key(1), (4, 128), 0, config.vocab)
    batch = (tokens, jnp.roll(tokens, -1, axis=1), jnp.ones(tokens.shape, jnp.float32))
    scheme = llama_scheme(scheme_name, config, blocks=2)
    return lm_train_step(graphdef, tx), scheme, (params, tx.init(params)), batch


def _cnn(sparse: bool):
    import flax.linen as nn
    import jax
    import optax

    import pockjax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, (features, stride) in enumerate(((32, 1), (64, 2), (64, 1), (128, 2))):
                x = nn.Conv(features, (3, 3), strides=(stride, stride), use_bias=False, name=f"conv{i}")(x)
                x = nn.BatchNorm(use_running_average=False, momentum=0.9, name=f"bn{i}")(x)
                x = nn.relu(x)
            return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))

    model, tx = CNN(), optax.adam(1e-3)
    images = jax.random.normal(jax.random.key(1), (32, 32, 32, 3))
    labels = jax.random.randint(jax.random.key(2), (32,), 0, 10)
    variables = dict(model.init(jax.random.key(0), images[:1]))

    def train_step(variables, opt_state, x, y):
        def loss_fn(params):
            logits, updates = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                                          mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        upd, opt_state = tx.update(grads, opt_state, variables["params"])
        return ({"params": optax.apply_updates(variables["params"], upd),
                 "batch_stats": updates["batch_stats"]}, opt_state, loss)

    if sparse:  # the last convolution, its BatchNorm and the head
        scheme = pockjax.UpdateScheme({"params.conv3.*": "full", "params.bn3.*": "full", "params.head.*": "full"})
    else:
        scheme = pockjax.UpdateScheme.full()
    return train_step, scheme, (variables, tx.init(variables["params"])), (images, labels)


def worker(workload: str, pipeline: str, backend: str, steps: int) -> dict:
    """Compile one workload with one pipeline on one backend and measure it (in this process)."""
    import jax

    import pockjax
    from pockjax.transforms.inplace_update import inplace_update
    from pockjax.transforms.reorder_for_memory import reorder_for_memory

    family, variant = workload.split("-")
    if family == "llama":
        step, scheme, state, batch = _llama(variant)
    else:
        step, scheme, state, batch = _cnn(variant == "sparse")
    passes = pockjax.default_passes(scheme)
    if pipeline == "+inplace":
        passes = pockjax.chain(passes, inplace_update())
    elif pipeline == "+reorder":
        passes = pockjax.chain(passes, reorder_for_memory(remat_budget=REMAT_BUDGET))
    target = None if backend == "xla" else "cpu"
    compiled = pockjax.compile(step, scheme=scheme, passes=passes, target=target)
    t0 = time.perf_counter()
    out = compiled(*state, *batch)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    result = {"workload": workload, "pipeline": pipeline, "backend": backend, "compile_and_first_s": first_s}
    if backend == "xla":
        mem = compiled.lower(*out[:2], *batch).compile().memory_analysis()
        result["xla_temp"] = int(mem.temp_size_in_bytes)
        result["xla_total"] = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                  + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = compiled(*out[:2], *batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    result.update(step_s=statistics.median(times), train_peak_rss=_vm("VmHWM"), loss=float(out[-1]))
    return result


def _run_fresh(workload, pipeline, backend, steps) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", workload, pipeline, backend, str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload} {pipeline} {backend} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backends", default="xla,iree")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        workload, pipeline, backend, steps = args.worker
        print(json.dumps(worker(workload, pipeline, backend, int(steps))))
        return 0
    rows = []
    for backend in args.backends.split(","):
        for workload in args.workloads.split(","):
            runs = {p: [] for p in PIPELINES}
            for r in range(args.rounds):
                order = PIPELINES[r % 3:] + PIPELINES[: r % 3]
                for pipeline in order:
                    runs[pipeline].append(_run_fresh(workload, pipeline, backend, args.steps))
            base = None
            for pipeline in PIPELINES:
                rs = runs[pipeline]
                row = {"backend": backend, "workload": workload, "pipeline": pipeline,
                       "step_s": statistics.median(x["step_s"] for x in rs),
                       "train_peak_rss": statistics.median(x["train_peak_rss"] for x in rs),
                       "xla_temp": rs[0].get("xla_temp"), "xla_total": rs[0].get("xla_total"),
                       "loss": rs[0]["loss"], "rounds": len(rs)}
                base = base or row
                row["time_ratio"] = row["step_s"] / base["step_s"]
                rows.append(row)
                print(f"| {backend} | {workload} | {pipeline} | {_mib(row['xla_temp'])} | {_mib(row['xla_total'])} "
                      f"| {_mib(row['train_peak_rss'])} | {row['step_s'] * 1e3:.2f} | {row['time_ratio']:.3f} |",
                      flush=True)
    if args.out:
        from pockjax.io.atomic import write_json

        write_json(args.out, {"rows": rows, "rounds": args.rounds, "steps": args.steps, "cpus": os.cpu_count()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

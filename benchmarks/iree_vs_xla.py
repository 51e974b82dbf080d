"""IREE (ahead of time) against XLA (in process): step time and module size.

Compiles the same LLaMA fine-tuning step, full and with the ``paper`` sparse
scheme, with ``pockjax.compile`` (XLA) and ``pockjax.compile(target=...)``
(IREE), runs both on this machine in the same process, alternating one XLA
step and one IREE step so that both see the same machine load, and prints
the median step time of each, their ratio and the IREE module's size. Layers
are unrolled (``scan_layers=False``) unless ``--scan-layers`` is given.

The step is the one ``pockjax finetune`` and ``pockjax bench`` train with
(``--loss answer``: reverse-words batches, logits on the answer window only);
``--loss sequence`` runs the output projection on every position instead
(random tokens). With several schemes each runs in its own process, so one
scheme's device memory never adds to the next's.

    python benchmarks/iree_vs_xla.py --model smollm2-135m --json out/ivx.json --markdown out/ivx.md
    python benchmarks/iree_vs_xla.py --model tiny --steps 3      # seconds, used by the tests

Run it under ``nice`` on a shared machine; the ratio is only meaningful
within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.harness


def build(model_name: str, scan_layers: bool):
    from flax import nnx

    from pockjax.models import llama

    if model_name == "tiny":
        # The byte tokenizer's vocabulary and room for its reverse-words rows (as pockjax bench's tiny model).
        config = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256, scan_layers=scan_layers)
        return llama.Llama(config, rngs=nnx.Rngs(0))
    model, _ = llama.load_pretrained(model_name, scan_layers=scan_layers)
    return model


def interleaved_times(runs: dict, batch, steps: int) -> dict[str, list[float]]:
    """Runs one step of each backend in turn, ``steps`` rounds after a warm-up round.

    ``runs`` maps a name to ``[step, params, opt_state]``; params and
    optimizer state are replaced by each step's outputs (kept on the device).
    """
    import numpy as np

    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(steps + 1):
        for name, run in runs.items():
            step, params, opt_state = run
            t0 = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, *batch)
            np.asarray(loss)  # wait for the result
            dt = time.perf_counter() - t0
            run[1], run[2] = params, opt_state
            if r:
                times[name].append(dt)
    return times


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` atomically and durably (:func:`pockjax.io.atomic.write_text`).

    main() has made the directory (and refused an unwritable path) before compiling.
    """
    from pockjax.io.atomic import write_text

    write_text(path, text)


def markdown(rows: list[dict], target: str) -> str:
    lines = [
        f"| model | scheme | batch x seq | loss positions | XLA step (s) | IREE {target} step (s) | IREE / XLA | module (MiB) "
        "| IREE compile (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['scheme']} | {r['batch']} x {r['seq']} "
            f"| {r.get('logit_positions', r['seq'])} ({r.get('loss', 'sequence')}) | {r['xla_step_s']:.3f} "
            f"| {r[f'{target}_step_s']:.3f} | {r['ratio']:.2f}x | {r['module_bytes'] / 2**20:.2f} "
            f"| {r[f'{target}_compile_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_results(args, rows: list[dict]) -> int:
    """Writes ``--json`` and ``--markdown`` (when given) for ``rows``."""
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=2))
    if args.markdown:
        write_atomic(args.markdown, markdown(rows, args.target))
    return 0


def _one_process_per_scheme(args, schemes: list[str], argv: list[str]) -> int:
    """Runs ``main`` once per scheme in a fresh process and writes the combined results."""
    import subprocess

    strip = {"--schemes", "--json", "--markdown"}
    base, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in strip:
            skip = True
            continue
        if a.split("=", 1)[0] in strip:
            continue
        base.append(a)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in schemes:
            out = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *base, "--schemes", name, "--json", out]
            if subprocess.run(cmd).returncode != 0:
                print(f"scheme {name!r} failed (see above)", file=sys.stderr)
                return 1
            from pockjax.errors import FileFormatError
            from pockjax.io.jsonfile import read_json

            got = read_json(out, what="rows of one scheme")
            if not isinstance(got, list):
                raise FileFormatError(f"{out}: expected a JSON list of rows")
            rows += got
    return write_results(args, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, or a pretrained name such as smollm2-135m")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--target-option", action="append", default=[], metavar="KEY=VALUE",
                        help="IREE target option, e.g. data_tiling=false or extra_flags='--flag1 --flag2' (repeatable)")
    parser.add_argument("--schemes", default="paper,full")
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per row (default: 128; 192 for tiny), clipped to the model's max_seq_len")
    parser.add_argument("--scan-layers", action="store_true", help="stack the layers and scan over them")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--loss", choices=("answer", "sequence"), default="answer",
                        help="answer: the fine-tuning step (logits on the answer window); sequence: on every position")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--markdown", default=None, help="write a markdown table here")
    args = parser.parse_args(argv)
    for out in (args.json, args.markdown):  # fail now, not after the compiles, if it cannot be written
        if out:
            parent = os.path.dirname(os.path.abspath(out))
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as e:
                parser.error(f"cannot create the output directory {parent}: {e}")
            if os.path.isdir(out):
                parser.error(f"{out} is a directory; give a file name")
    schemes = args.schemes.split(",")
    if len(schemes) > 1:
        return _one_process_per_scheme(args, schemes, argv if argv is not None else sys.argv[1:])

    import jax
    import jax.numpy as jnp
    import optax

    import pockjax
    from benchmarks.harness.common import BenchConfig, default_seq, make_data
    from pockjax.models import llama
    from pockjax.schemes import paper_blocks
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import ANSWER_STEP_XLA_OPTIONS, answer_train_step, lm_train_step

    options = {}
    for kv in args.target_option:
        k, _, v = kv.partition("=")
        options[k] = v.split() if k == "extra_flags" else {"true": True, "false": False}.get(v.lower(), v)
    model = build(args.model, args.scan_layers)
    graphdef, params = llama.split(model)
    tx = optax.adamw(1e-4)
    seq = min(default_seq(args.model) if args.seq_len is None else args.seq_len, model.config.max_seq_len)
    shape = (args.batch_size, seq)
    if args.loss == "answer":
        data = make_data(BenchConfig(model=args.model, batch=args.batch_size, seq=seq, warmup=0, steps=1), "speed")
        batch = ({k: jnp.asarray(v) for k, v in data["batches"][0].items()},)
        seq, window = data["seq"], data["window"]
        train_step = answer_train_step(graphdef, tx, window)
        xla_options = ANSWER_STEP_XLA_OPTIONS  # as pockjax finetune compiles it
    else:
        tokens = jax.random.randint(jax.random.key(0), shape, 0, model.config.vocab)
        batch = (tokens, tokens, jnp.ones(shape, jnp.float32))
        window = seq
        train_step = lm_train_step(graphdef, tx)
        xla_options = None
    blocks = paper_blocks(model.config.n_layers, args.blocks)  # as pockjax finetune
    rows = []
    for name in schemes:
        scheme = llama_scheme(name, model.config, blocks=blocks)
        result = {"scheme": name, "model": args.model, "batch": args.batch_size, "seq": seq,
                  "loss": args.loss, "logit_positions": window,
                  "scan_layers": args.scan_layers, "target": args.target}
        runs = {}
        for backend in ("xla", args.target):
            step = pockjax.compile(
                train_step, scheme=scheme, target=None if backend == "xla" else backend,
                target_options=None if backend == "xla" else options,
                xla_options=xla_options if backend == "xla" else None,
            )
            p = jax.tree.map(jnp.copy, params)
            s = pockjax.init_opt_state(tx, p, scheme)
            t0 = time.perf_counter()
            compiled = step.lower(p, s, *batch).compile()
            result[f"{backend}_compile_s"] = time.perf_counter() - t0
            if backend != "xla":
                module = compiled.executable.exe.compiled
                result["module_bytes"] = module.size_bytes
                # The step's state is passed as arguments and kept in device buffers, so no
                # parameter archive is part of the module; exporting writes one of this size.
                result["weights_bytes"] = sum(int(x.nbytes) for x in jax.tree.leaves((p, s)))
                result["iree_flags"] = module.metadata.target["flags"]
                result["workarounds"] = list(module.workarounds)
            runs[backend] = [step, p, s]
        times = interleaved_times(runs, batch, args.steps)
        for backend, ts in times.items():
            result[f"{backend}_step_s"] = statistics.median(ts)
            result[f"{backend}_step_min_s"] = min(ts)
        result["ratio"] = result[f"{args.target}_step_s"] / result["xla_step_s"]
        rows.append(result)
        print(
            f"{args.model} {name:6s} XLA {result['xla_step_s'] * 1e3:9.1f} ms  "
            f"IREE {args.target} {result[f'{args.target}_step_s'] * 1e3:9.1f} ms  "
            f"ratio {result['ratio']:.2f}x  module {result['module_bytes'] / 1024:.0f} KiB",
            flush=True,
        )
        del runs, times
    return write_results(args, rows)


if __name__ == "__main__":
    sys.exit(main())

"""``pockjax memory`` and ``pockjax plan`` on the command line.

``pockjax memory`` compiles the Flax LLaMA fine-tuning step (``tiny`` or
``smollm2-135m``, from abstract shapes: no weights are loaded) twice, with the
default passes and with the memory passes added (``inplace_update`` and
``reorder_for_memory``), prints the planner's figures next to XLA's memory
analysis, and writes the timelines before/after the memory passes.

``pockjax plan`` plans one step of a LLaMA-shaped model (``llama2-7b``,
``smollm2-135m``, ``tiny``) from ``jax.ShapeDtypeStruct`` shapes, without
compiling or allocating anything, with and without the in-place update order,
and says whether it fits in ``--budget-gb``.
"""

from __future__ import annotations

import argparse
import os
import time

__all__ = ["register", "run_memory", "run_plan"]

#: PockEngine's reported peak memory on Jetson AGX Orin, LLaMA-2-7B (GB).
PAPER_JETSON_GB = {"full": 43.1, "sparse": 31.2}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``memory`` and ``plan`` subcommands to a ``pockjax`` argument parser."""
    m = subparsers.add_parser(
        "memory",
        help="planner vs XLA memory of a LLaMA fine-tuning step, timelines before/after the memory passes",
        description=__doc__.split("\n\n")[1],
    )
    m.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    m.add_argument("--scheme", default="full", choices=("full", "paper", "norm-only"))
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--seq", type=int, default=128)
    m.add_argument("--remat-budget", type=float, default=0.0, help="FLOPs reorder_for_memory may add by recomputing")
    m.add_argument("--out", default="memory-timeline", help="directory for the timeline pictures")
    m.add_argument("--formats", default="png", help="comma-separated: png,svg")
    m.add_argument("--no-plot", action="store_true")
    m.set_defaults(func=run_memory)

    p = subparsers.add_parser(
        "plan",
        help="peak memory of a fine-tuning step from shapes alone (LLaMA-2-7B included); fits or not",
        description=__doc__.split("\n\n")[2],
    )
    p.add_argument("--model", default="llama2-7b", choices=("llama2-7b", "smollm2-135m", "tiny"))
    p.add_argument("--scheme", default="full", choices=("full", "paper", "norm-only", "both"))
    p.add_argument("--dtype", default=None, choices=("bf16", "f32"), help="default: bf16 for llama2-7b, else f32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=None, help="override the number of blocks")
    p.add_argument("--sparse-blocks", type=int, default=None, help="blocks the paper scheme trains (default: 8 of 30)")
    p.add_argument("--budget-gb", type=float, default=None, help="device memory in GiB")
    p.set_defaults(func=run_plan)


# -- pockjax memory ------------------------------------------------------------------


def run_memory(args: argparse.Namespace) -> int:
    import pockjax
    from pockjax.memory import format_bytes, memory_report, plot_timeline
    from pockjax.memory.workloads import llama_workload
    from pockjax.optim.state import SparseOptState
    from pockjax.transforms.inplace_update import inplace_update
    from pockjax.transforms.reorder_for_memory import reorder_for_memory

    t0 = time.perf_counter()
    w = llama_workload(args.model, args.scheme, batch=args.batch, seq=args.seq, abstract=True)
    sparse_state = isinstance(w.args[1], SparseOptState)
    base = pockjax.default_passes(w.scheme, sparse_state)
    pipelines = {
        "default": base,
        "+ memory passes": pockjax.chain(base, inplace_update(), reorder_for_memory(args.remat_budget or None)),
    }
    print(
        f"{args.model}, scheme {args.scheme}, AdamW, batch {args.batch}, seq {args.seq} "
        "(compiled from shapes; params and optimizer state donated)"
    )
    reports = {}
    for name, passes in pipelines.items():
        t = time.perf_counter()
        cs = pockjax.compile(w.step, scheme=w.scheme, passes=passes).lower(*w.args)
        reports[name] = (memory_report(cs), cs.graph.meta, time.perf_counter() - t)
    first = next(iter(reports.values()))[0]
    header = f"{'pipeline':<18}{'planner':>12}{'XLA temp':>12}{'XLA total':>12}{'ratio':>8}  updates in backward"
    print(f"{'as traced':<18}{format_bytes(first.before.peak_bytes):>12}  (planner, program order, no passes)")
    print(header)
    for name, (r, meta, secs) in reports.items():
        upd = f"{r.hlo['before_backward_end']}/{r.hlo['n_params']}" if r.hlo else "?"
        print(
            f"{name:<18}{format_bytes(r.after.peak_bytes):>12}{format_bytes(r.xla['temp_size_in_bytes']):>12}"
            f"{format_bytes(r.xla['total']):>12}{r.ratio:>8.3f}  {upd}   ({secs:.1f} s)"
        )
    meta = reports["+ memory passes"][1]
    if "inplace_update" in meta:
        iu = meta["inplace_update"]
        print(f"inplace_update: {iu['groups']} update groups, {iu['barriers']} barriers, coupled: {len(iu['coupled'])}")
    if "reorder_for_memory" in meta:
        ro = meta["reorder_for_memory"]
        print(
            f"reorder_for_memory: planner {format_bytes(ro['peak_before'])} -> {format_bytes(ro['peak_after'])}"
            f" (reordered: {ro['reordered']}, recomputed {ro['rematerialized']} values, {ro['remat_flops']:.3g} FLOPs)"
        )
    after = reports["+ memory passes"][0]
    print("at the peak (memory passes):")
    for line in after.after.summary().splitlines()[1:]:
        print(line)
    if not args.no_plot:
        fmts = tuple(f.strip() for f in args.formats.split(",") if f.strip())
        before = reports["default"][0]
        path = os.path.join(args.out, f"memory_{args.model}_{args.scheme}".replace("-", "_"))
        written = plot_timeline(
            after.after,
            path,
            before=before.after,
            titles=(
                f"default passes (planner {format_bytes(before.after.peak_bytes)})",
                f"+ inplace_update, reorder_for_memory (planner {format_bytes(after.after.peak_bytes)})",
            ),
            formats=fmts,
        )
        for f in written:
            print(f"wrote {f}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


# -- pockjax plan --------------------------------------------------------------------


def _shape_config(args: argparse.Namespace):
    import jax.numpy as jnp

    from pockjax.memory.llama_shapes import LlamaShape

    dtype = args.dtype or ("bf16" if args.model == "llama2-7b" else "f32")
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    over = {"dtype": dt}
    if args.layers:
        over["n_layers"] = args.layers
    if args.model == "llama2-7b":
        return LlamaShape.llama2_7b(**over), dtype
    if args.model == "smollm2-135m":
        return LlamaShape.smollm2_135m(**over), dtype
    return LlamaShape(**over), dtype


def trainable_for(scheme: str, n_layers: int, sparse_blocks: int | None = None):
    """Predicate on ``llama_shapes`` parameter paths for a scheme name (None: full).

    Example:
      >>> t = trainable_for("paper", 30)
      >>> t("layers.29.wq"), t("layers.29.w3"), t("layers.21.wq"), t("embed")
      (True, False, False, False)
    """
    from pockjax.memory.workloads import sparse_block_count

    if scheme == "full":
        return None
    if scheme == "norm-only":
        return lambda path: path == "norm" or path.split(".")[-1] in ("attn_norm", "ffn_norm")
    k = sparse_block_count(n_layers) if sparse_blocks is None else sparse_blocks
    first = n_layers - k

    def paper(path: str) -> bool:
        parts = path.split(".")
        return (
            parts[0] == "layers" and len(parts) == 3 and int(parts[1]) >= first
            and parts[2] in ("wq", "wk", "wv", "wo", "w1")
        )

    return paper


def plan_graph(cfg, scheme: str, *, batch: int, seq: int, sparse_blocks: int | None = None):
    """Trace a LLaMA-shaped AdamW step from shapes into a TrainGraph.

    The optimizer state exists for the trained parameters only; frozen parameters
    are plain (not donated) inputs. Returns ``(graph, donate_mask)``.
    """
    import jax
    import optax

    import pockjax
    from pockjax.memory.llama_shapes import _split, abstract_train_args, make_train_step

    tx = optax.adamw(1e-4)
    trainable = trainable_for(scheme, cfg.n_layers, sparse_blocks)
    args, _ = abstract_train_args(cfg, tx, batch=batch, seq=seq, trainable=trainable)
    if trainable is None:
        step = make_train_step(cfg, tx)
        graph = pockjax.trace_step(step, args)
        donate = [r in ("param", "opt_state") for r in graph.in_roles]
        return graph, donate
    train, frozen, opt_state, b = args
    sparse = make_train_step(cfg, tx, trainable)

    def step(train, opt_state, frozen, batch):  # (params, opt_state, *rest) for trace_step
        return sparse(train, frozen, opt_state, batch)

    n = [len(jax.tree.leaves(x)) for x in (train, opt_state, frozen, b)]
    roles = ["param"] * n[0] + ["opt_state"] * n[1] + ["param"] * n[2] + ["batch"] * n[3]
    graph = pockjax.trace_step(step, (train, opt_state, frozen, b), roles=roles)
    donate = [True] * (n[0] + n[1]) + [False] * (n[2] + n[3])
    del _split
    return graph, donate


def run_plan(args: argparse.Namespace) -> int:
    from pockjax.memory import analyze, format_bytes
    from pockjax.transforms.inplace_update import inplace_update

    cfg, dtype = _shape_config(args)
    schemes = ("full", "paper") if args.scheme == "both" else (args.scheme,)
    budget = None if args.budget_gb is None else args.budget_gb * 2**30
    paper_setting = args.model == "llama2-7b" and dtype == "bf16" and args.batch == 1 and args.seq == 512
    print(
        f"{args.model}: {cfg.n_layers} blocks, d={cfg.dim}, {cfg.n_params / 1e9:.3f} B params, {dtype}, "
        f"AdamW (moments in {dtype}), batch {args.batch}, seq {args.seq}; planned from shapes"
    )
    for scheme in schemes:
        t0 = time.perf_counter()
        graph, donate = plan_graph(cfg, scheme, batch=args.batch, seq=args.seq, sparse_blocks=args.sparse_blocks)
        t1 = time.perf_counter()
        program = analyze(graph, donate=donate)
        inplace = inplace_update()(graph)
        t2 = time.perf_counter()
        rep = analyze(inplace, donate=donate)
        t3 = time.perf_counter()
        label = scheme
        if scheme == "paper":
            from pockjax.memory.workloads import sparse_block_count

            k = args.sparse_blocks or sparse_block_count(cfg.n_layers)
            label = f"paper: attn q/k/v/o + mlp w1 of the last {k} blocks"
        print(f"\n[{label}]  (traced {t1 - t0:.1f} s, inplace_update {t2 - t1:.1f} s, analysed {t3 - t2:.1f} s)")
        print(f"  program order (as traced):  peak {format_bytes(program.peak_bytes):>11}  ({program.peak_bytes / 1e9:.2f} GB)")
        print(f"  with inplace_update:        peak {format_bytes(rep.peak_bytes):>11}  ({rep.peak_bytes / 1e9:.2f} GB)")
        if paper_setting:
            key = "full" if scheme == "full" else "sparse"
            print(f"  paper (Jetson AGX Orin, {key}): {PAPER_JETSON_GB[key]:.1f} GB")
        print("  at the peak (with inplace_update):")
        for cat, b in rep.peak_breakdown.items():
            if b:
                print(f"    {cat:<17} {format_bytes(b):>11}  {100 * b / max(rep.peak_bytes, 1):5.1f}%")
        if budget is not None:
            verdict = "fits" if rep.fits(budget) else "does NOT fit"
            print(f"  {verdict} in {args.budget_gb:g} GiB")
    return 0

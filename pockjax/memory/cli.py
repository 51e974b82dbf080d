"""``pockjax memory`` and ``pockjax plan`` on the command line.

``pockjax memory`` compiles the Flax LLaMA fine-tuning step (``tiny`` or
``smollm2-135m``, from abstract shapes: no weights are loaded) twice, with the
default passes and with the memory passes added (``inplace_update`` and
``reorder_for_memory``), prints the planner's figures next to XLA's memory
analysis, and writes the timelines before/after the memory passes.

``pockjax plan`` plans one fine-tuning step of the Flax LLaMA (``llama2-7b``,
``smollm2-135m``, ``tiny``) from ``jax.ShapeDtypeStruct`` shapes, without
compiling or allocating anything, with and without the in-place update order,
and says whether it fits in ``--budget-gb``. ``--dtype``/``--quantize`` plan a
precision policy (trained tensors and AdamW moments fp32, frozen weights bf16 or
block-quantized) with the weights split frozen/trained; ``--fits 8,16,24``
tabulates fp32, bf16, bf16+int8 and bf16+int4 against those devices (GiB).

Both take their schemes from :mod:`pockjax.schemes`, the ones ``pockjax
finetune`` trains (``--scheme paper --blocks N`` means the same tensors
everywhere), or a JSON scheme file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pockjax._cli_args import non_negative_finite_float, positive_finite_float, positive_int
from pockjax.schemes import ignores_blocks

__all__ = ["register", "run_memory", "run_plan"]

#: PockEngine's reported peak memory on Jetson AGX Orin, LLaMA-2-7B (GB).
PAPER_JETSON_GB = {"full": 43.1, "sparse": 31.2}


def _scheme_help() -> str:
    from pockjax.schemes import scheme_names

    return "|".join(scheme_names("llama")) + "|FILE"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``memory`` and ``plan`` subcommands to a ``pockjax`` argument parser."""
    from pockjax.schemes import paper_blocks

    blocks_help = (f"last blocks trained by paper/channels (default: a third of the blocks, at least"
                   f" 10; SmolLM2-135M {paper_blocks(30)}, LLaMA-2-7B {paper_blocks(32)})")
    m = subparsers.add_parser(
        "memory",
        help="planner vs XLA memory of a LLaMA fine-tuning step, timelines before/after the memory passes",
        description=__doc__.split("\n\n")[1],
    )
    m.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    m.add_argument("--scheme", default="full", metavar=_scheme_help(),
                   help="update scheme (pockjax.schemes, as pockjax finetune) or a JSON scheme file")
    m.add_argument("--blocks", type=positive_int, default=None, help=blocks_help)
    m.add_argument("--batch", type=positive_int, default=4)
    m.add_argument("--seq", type=positive_int, default=128)
    m.add_argument("--remat-budget", type=non_negative_finite_float, default=0.0,
                   help="FLOPs reorder_for_memory may add by recomputing (0: none)")
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
    p.add_argument("--scheme", default="full", metavar=_scheme_help() + "|both",
                   help="update scheme (pockjax.schemes, as pockjax finetune), a JSON scheme file,"
                        " or both (full and paper)")
    p.add_argument("--blocks", "--sparse-blocks", dest="blocks", type=positive_int, default=None,
                   help=blocks_help)
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "f32"), metavar="{fp32,bf16}",
                   help="precision policy: trained tensors and AdamW moments fp32, frozen float tensors in"
                        " this dtype (activations counted at fp32, an upper bound for bf16). Not given (and"
                        " no --quantize): every tensor in one dtype, as before: bf16 for llama2-7b (AdamW"
                        " moments too), else fp32")
    p.add_argument("--quantize", default=None, choices=tuple(_QUANTIZE),
                   help="frozen matrices (attention/MLP kernels, embedding, LM head) held block-quantized:"
                        " int8 = q8_0 (34 bytes per 32 values), int4 = q4_1 (20 bytes per 32); trained"
                        " tensors stay fp32, 1-D ones in --dtype")
    p.add_argument("--fits", default=None, metavar="GIB[,GIB...]",
                   help="a table of which of these devices (GiB) the step fits, for fp32, bf16, bf16+int8"
                        " and bf16+int4 (and --dtype/--quantize's combination), from one trace per scheme")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--seq", type=positive_int, default=512)
    p.add_argument("--layers", type=positive_int, default=None, help="override the number of blocks")
    p.add_argument("--budget-gb", type=positive_finite_float, default=None,
                   help="device memory in GiB (finite, > 0)")
    p.add_argument("--mesh", default="", metavar="AXIS=N[,AXIS=N]",
                   help="per-device view of the step partitioned over a mesh: fsdp=N, data=N or both"
                        " (compiled from shapes at reduced depth and read from XLA's memory analysis;"
                        " on a CPU the host is split into N devices); --batch is the global batch")
    p.add_argument("--devices", type=positive_int, default=None, metavar="N",
                   help="per-device view for N devices under each sharding strategy (data=N and fsdp=N)")
    p.add_argument("--check", action="store_true",
                   help="with --mesh/--devices: compile one more reduced depth and print the fit's error there")
    p.set_defaults(func=run_plan)


_QUANTIZE = ("none", "int8", "int4")  # pockjax.memory.llama_plan.QUANTIZE, without importing JAX


def _gib_list(text: str) -> tuple[float, ...]:
    """``--fits 8,16,24``: device sizes in GiB, each finite and > 0 (PockjaxError otherwise)."""
    from pockjax.errors import PockjaxError

    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise PockjaxError(f"--fits must be a comma-separated list of GiB, got {text!r}")
    try:
        return tuple(positive_finite_float(t) for t in items)
    except argparse.ArgumentTypeError as e:
        raise PockjaxError(f"--fits: {e} (in {text!r})") from None


def _error(command: str, e: BaseException) -> int:
    print(f"pockjax {command}: error: {e}", file=sys.stderr)
    return 2


#: The largest sizes ``pockjax plan`` and ``pockjax memory`` take, and why: they trace the step
#: (every block, and attention in query blocks whose count grows with the length: 32768 tokens
#: took 47 s on a 2-core CPU, so 131072, a long context, takes minutes) and count bytes in
#: 64-bit integers.
_SIZE_LIMITS = {"batch": (2**20, "byte counts must fit 64-bit integers"),
                "seq": (131072, "attention is traced in query blocks, more as the length grows"),
                "layers": (256, "every block is traced")}


def _check_sizes(args: argparse.Namespace) -> None:
    from pockjax.errors import PockjaxError

    for name, (most, why) in _SIZE_LIMITS.items():
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise PockjaxError(f"--{name} must be at least 1, got {v}")
        if v is not None and v > most:
            raise PockjaxError(f"--{name} {v} is more than pockjax {args.command} takes: at most {most}"
                               f" ({why})")


# -- pockjax memory ------------------------------------------------------------------


def run_memory(args: argparse.Namespace) -> int:
    import pockjax
    from pockjax.errors import PockjaxError
    from pockjax.memory import format_bytes, memory_report, plot_timeline
    from pockjax.memory.llama_plan import abstract_llama_step, model_config
    from pockjax.optim.state import SparseOptState
    from pockjax.transforms.inplace_update import InplaceUpdateRecord, inplace_update
    from pockjax.transforms.reorder_for_memory import ReorderForMemoryRecord, reorder_for_memory

    t0 = time.perf_counter()
    if _blocks_unused(args):
        return _error("memory", PockjaxError(_blocks_unused(args)))
    fmts = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    if args.no_plot and args.formats != "png":
        return _error("memory", PockjaxError("--formats chooses the plot's files: give it without --no-plot"))
    bad = sorted(set(fmts) - {"png", "svg", "pdf"})
    if not args.no_plot and (bad or not fmts):
        return _error("memory", PockjaxError(f"--formats {args.formats!r}: give a comma-separated list of png,"
                                             f" svg, pdf" + (f" ({', '.join(bad)} is not one)" if bad else "")))
    try:
        _check_sizes(args)
        w = abstract_llama_step(model_config(args.model), args.scheme, batch=args.batch, seq=args.seq,
                                blocks=args.blocks)
        desc = w.scheme.describe(w.args[0])
    except PockjaxError as e:
        return _error("memory", e)
    if not args.no_plot:
        from pockjax.io.atomic import remove_stale_temporaries

        if os.path.exists(args.out) and not os.path.isdir(args.out):
            return _error("memory", PockjaxError(f"--out {args.out} is a file; the plots go to a directory"))
        remove_stale_temporaries(args.out)  # what an interrupted run left (a missing --out is fine)
    sparse_state = isinstance(w.args[1], SparseOptState)
    base = pockjax.default_passes(w.scheme, sparse_state)
    pipelines = {
        "default": base,
        "+ memory passes": pockjax.chain(base, inplace_update(), reorder_for_memory(args.remat_budget or None)),
    }
    print(
        f"{args.model}, scheme {w.scheme.name or args.scheme}, AdamW, batch {args.batch}, seq {args.seq} "
        "(compiled from shapes; params and optimizer state donated)"
    )
    print(_trainable_line(desc))
    reports = {}
    for name, passes in pipelines.items():
        t = time.perf_counter()
        cs = pockjax.compile(w.step, scheme=w.scheme, passes=passes).lower(*w.args).compile()
        reports[name] = (memory_report(cs), cs.graph, time.perf_counter() - t)
    first = next(iter(reports.values()))[0]
    header = f"{'pipeline':<18}{'planner':>12}{'XLA temp':>12}{'XLA total':>12}{'ratio':>8}  updates in backward"
    print(f"{'as traced':<18}{format_bytes(first.before.peak_bytes):>12}  (planner, program order, no passes)")
    print(header)
    for name, (r, _, secs) in reports.items():
        upd = f"{r.hlo['before_backward_end']}/{r.hlo['n_params']}" if r.hlo else "?"
        print(
            f"{name:<18}{format_bytes(r.after.peak_bytes):>12}{format_bytes(r.xla['temp_size_in_bytes']):>12}"
            f"{format_bytes(r.xla['total']):>12}{r.ratio:>8.3f}  {upd}   ({secs:.1f} s)"
        )
    memory_graph = reports["+ memory passes"][1]
    iu = memory_graph.record(InplaceUpdateRecord)
    if iu is not None:
        print(f"inplace_update: {iu.groups} update groups, {iu.barriers} barriers, coupled: {len(iu.coupled)}")
    ro = memory_graph.record(ReorderForMemoryRecord)
    if ro is not None:
        print(
            f"reorder_for_memory: planner {format_bytes(ro.peak_before)} -> {format_bytes(ro.peak_after)}"
            f" (reordered: {ro.reordered}, recomputed {ro.rematerialized} values, {ro.remat_flops:.3g} FLOPs)"
        )
    after = reports["+ memory passes"][0]
    print("at the peak (memory passes):")
    for line in after.after.summary().splitlines()[1:]:
        print(line)
    if not args.no_plot:
        before = reports["default"][0]
        tag = os.path.splitext(os.path.basename(args.scheme))[0]
        path = os.path.join(args.out, f"memory_{args.model}_{tag}".replace("-", "_"))
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


def _traced_words(seconds: float | None) -> str:
    """'traced 4.2 s', or 'trace reused' for a step traced by the plan before."""
    return "trace reused" if seconds is None else f"traced {seconds:.1f} s"


def _trainable_line(desc) -> str:
    """The trained-parameter count, as ``pockjax finetune`` states it (``scheme.describe``)."""
    pct = 100 * desc.trainable / max(desc.total, 1)
    return f"trainable: {desc.trainable:,} of {desc.total:,} parameters ({pct:.1f}%)"


def _plan_inputs(args: argparse.Namespace):
    """``(dtype name, dtype, model config, scheme names, schemes)`` of ``pockjax plan``'s options.

    Raises PockjaxError for a size below 1 or a scheme that does not resolve.
    """
    import jax.numpy as jnp

    from pockjax.memory.llama_plan import model_config
    from pockjax.schemes import resolve_scheme

    dtype = args.dtype or ("bf16" if args.model == "llama2-7b" else "f32")
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    dtype = "f32" if dtype == "fp32" else dtype
    _check_sizes(args)
    cfg = model_config(args.model, **({"n_layers": args.layers} if args.layers else {}))
    names = ("full", "paper") if args.scheme == "both" else (args.scheme,)
    return dtype, dt, cfg, names, [resolve_scheme(n, cfg, blocks=args.blocks) for n in names]


def _blocks_unused(args: argparse.Namespace) -> str | None:
    """Why ``--blocks`` has no effect with this ``--scheme``, or None (as finetune refuses it)."""
    if args.blocks is not None and ignores_blocks(args.scheme):
        return (f"--blocks sets how many of the last blocks the paper and channels schemes train; --scheme"
                f" {args.scheme} does not use it (leave it out)")
    return None


def run_plan(args: argparse.Namespace) -> int:
    from pockjax.errors import PockjaxError

    if _blocks_unused(args):
        return _error("plan", ValueError(_blocks_unused(args)))
    if args.check and not (args.mesh or args.devices):
        return _error("plan", ValueError("--check compares the per-device plan with a compile: give --mesh or"
                                         " --devices"))

    if args.dtype == "f32":
        args.dtype = "fp32"  # the old spelling
    if args.fits is not None:
        try:
            args.fits = _gib_list(args.fits)
        except PockjaxError as e:
            return _error("plan", e)
    if args.mesh or args.devices:
        if args.quantize or args.fits or args.dtype == "bf16":
            return _error("plan", ValueError("--quantize, --fits and --dtype bf16 (frozen bf16, trained fp32)"
                                             " plan one device; not with --mesh/--devices"))
        return run_plan_per_device(args)
    if args.fits and args.budget_gb is not None and not (args.dtype or args.quantize):
        # (--fits alone prints the table of device sizes: a --budget-gb beside it was never read)
        return _error("plan", ValueError(f"--fits tells whether each precision fits {', '.join(f'{g:g}' for g in args.fits)}"
                                         f" GiB; --budget-gb {args.budget_gb:g} would say nothing more: add it to"
                                         f" --fits, or give --dtype/--quantize for one precision's verdict"))
    if args.dtype or args.quantize or args.fits:
        return run_plan_precision(args)
    from pockjax.errors import PockjaxError
    from pockjax.memory import format_bytes
    from pockjax.memory.llama_plan import plan_llama

    try:
        dtype, dt, cfg, names, schemes = _plan_inputs(args)
    except PockjaxError as e:
        return _error("plan", e)
    budget = None if args.budget_gb is None else args.budget_gb * 2**30
    paper_setting = args.model == "llama2-7b" and dtype == "bf16" and args.batch == 1 and args.seq == 512
    print(
        f"{args.model}: {cfg.n_layers} blocks, d={cfg.dim}, {cfg.num_params() / 1e9:.3f} B params, {dtype}, "
        f"AdamW (moments in {dtype}), batch {args.batch}, seq {args.seq}; planned from shapes"
    )
    for name, scheme in zip(names, schemes):
        try:
            r = plan_llama(cfg, scheme, dtype=dt, batch=args.batch, seq=args.seq)
        except PockjaxError as e:
            return _error("plan", e)
        sec = r.seconds
        print(f"\n[{scheme.name or name}]  ({_traced_words(sec['trace'])}, passes {sec['passes']:.1f} s,"
              f" inplace_update {sec['inplace_update']:.1f} s, analysed {sec['analyze']:.1f} s)")
        print(f"  {_trainable_line(r)}")
        print(f"  program order (as traced):  peak {format_bytes(r.program.peak_bytes):>11}"
              f"  ({r.program.peak_bytes / 1e9:.2f} GB)")
        print(f"  with inplace_update:        peak {format_bytes(r.inplace.peak_bytes):>11}"
              f"  ({r.inplace.peak_bytes / 1e9:.2f} GB)")
        if paper_setting and name in ("full", "paper"):
            key = "full" if name == "full" else "sparse"
            print(f"  paper (Jetson AGX Orin, {key}): {PAPER_JETSON_GB[key]:.1f} GB")
        print("  at the peak (with inplace_update):")
        for cat, b in r.inplace.peak_breakdown.items():
            if b:
                print(f"    {cat:<17} {format_bytes(b):>11}  {100 * b / max(r.inplace.peak_bytes, 1):5.1f}%")
        if budget is not None:
            verdict = "fits" if r.inplace.fits(budget) else "does NOT fit"
            print(f"  {verdict} in {args.budget_gb:g} GiB")
    return 0


def _weights_lines(p) -> list[str]:
    from pockjax.memory import format_bytes

    frozen = ", ".join(f"{fmt} {format_bytes(b)}" for fmt, b in sorted(p.frozen_bytes.items(), key=lambda kv: -kv[1])
                       if b) or "none"
    lines = [f"  weights {format_bytes(p.weight_bytes)}: frozen {format_bytes(sum(p.frozen_bytes.values()))}"
             f" ({frozen}), trained fp32 {format_bytes(p.trained_bytes)}",
             f"  optimizer state (fp32 moments of what is trained): {format_bytes(p.optimizer_bytes)}"]
    if p.dequant_bytes:
        lines.append(f"  dequantized copy of the largest quantized matrix ({p.dtype}, one at a time, added to"
                     f" the peak): {format_bytes(p.dequant_bytes)}")
    return lines


def run_plan_precision(args: argparse.Namespace) -> int:
    """``pockjax plan --dtype/--quantize/--fits``: the precision policy, from one trace per scheme."""
    from pockjax.errors import PockjaxError
    from pockjax.memory import format_bytes
    from pockjax.memory.llama_plan import PRECISIONS, QUANTIZE, check_precision, fit_table, plan_precisions

    try:
        _, _, cfg, names, schemes = _plan_inputs(args)
        own = check_precision(args.dtype or ("bf16" if args.model == "llama2-7b" else "fp32"),
                              args.quantize or "none")
    except PockjaxError as e:
        return _error("plan", e)
    combos = list(PRECISIONS) if args.fits else []
    if (args.dtype or args.quantize) and own not in combos:
        combos.append(own)
    budget = None if args.budget_gb is None else args.budget_gb * 2**30
    print(f"{args.model}: {cfg.n_layers} blocks, d={cfg.dim}, {cfg.num_params() / 1e9:.3f} B params, AdamW,"
          f" batch {args.batch}, seq {args.seq}; planned from shapes. Trained tensors and AdamW moments fp32;"
          f" frozen float tensors in the dtype; frozen matrices quantized with int8 ({QUANTIZE['int8']}) or"
          f" int4 ({QUANTIZE['int4']}); activations counted at fp32 (for bf16 an upper bound)")
    tables = []
    for name, scheme in zip(names, schemes):
        try:
            plans = plan_precisions(cfg, scheme, combos, batch=args.batch, seq=args.seq)
        except PockjaxError as e:
            return _error("plan", e)
        sec = plans[0].seconds
        print(f"\n[{scheme.name or name}]  ({_traced_words(sec['trace'])}, passes {sec['passes']:.1f} s,"
              f" inplace_update {sec['inplace_update']:.1f} s, analysed {sum(p.seconds['analyze'] for p in plans):.1f} s"
              f" for {len(plans)} precisions)")
        print(f"  {_trainable_line(plans[0])}")
        for p in plans:
            if (p.dtype, p.quantize) != own or not (args.dtype or args.quantize):
                continue  # --fits alone: the table only
            print(f"  {p.name}:")
            for line in _weights_lines(p):
                print("  " + line)
            print(f"    program order (as traced):  peak {format_bytes(p.program.peak_bytes + p.dequant_bytes):>11}")
            print(f"    with inplace_update:        peak {format_bytes(p.peak_bytes):>11}"
                  f"  ({p.peak_bytes / 1e9:.2f} GB)")
            print("    at the peak (with inplace_update):")
            for cat, b in p.inplace.peak_breakdown.items():
                if b:
                    print(f"      {cat:<17} {format_bytes(b):>11}  {100 * b / max(p.peak_bytes, 1):5.1f}%")
            if p.dequant_bytes:
                print(f"      {'dequantized':<17} {format_bytes(p.dequant_bytes):>11}"
                      f"  {100 * p.dequant_bytes / max(p.peak_bytes, 1):5.1f}%")
            if budget is not None:
                print(f"    {'fits' if p.fits(budget) else 'does NOT fit'} in {args.budget_gb:g} GiB")
        tables.append(plans)
    if args.fits:
        print("\nfits in (GiB): the peak with inplace_update, plus one dequantized matrix when quantized")
        print(fit_table([p for plans in tables for p in plans], args.fits))
    return 0


def run_plan_per_device(args: argparse.Namespace) -> int:
    """``pockjax plan --mesh fsdp=8`` / ``--devices N``: one device's memory of the partitioned step."""
    if args.mesh and args.devices:
        return _error("plan", ValueError("give --devices N or --mesh AXIS=N,..., not both"))
    meshes = [args.mesh] if args.mesh else [f"data={args.devices}", f"fsdp={args.devices}"]
    from pockjax.errors import PockjaxError
    from pockjax.sharding import request_host_devices, training_mesh_axes

    try:
        for mesh in meshes:
            training_mesh_axes(mesh)
    except PockjaxError as e:
        return _error("plan", e)

    for mesh in meshes:
        request_host_devices(mesh)  # before JAX starts (the CPU split into that many devices)
    import jax

    from pockjax.memory.sharded_plan import plan_llama_per_device

    try:
        dtype, dt, cfg, names, _ = _plan_inputs(args)
    except PockjaxError as e:
        return _error("plan", e)
    platform = jax.devices()[0].platform
    print(f"{args.model}: {cfg.n_layers} blocks, d={cfg.dim}, {cfg.num_params() / 1e9:.3f} B params, {dtype},"
          f" AdamW (moments in {dtype}), global batch {args.batch} x {args.seq} tokens; one device's bytes"
          f" from XLA's memory analysis of the partitioned step ({platform} compile), fitted over reduced depths")
    rows = []
    for name in names:
        for mesh in meshes:
            try:
                r = plan_llama_per_device(cfg, name, mesh=mesh, dtype=dt, batch=args.batch, seq=args.seq,
                                          blocks=args.blocks, check=args.check)
            except (PockjaxError, ValueError) as e:
                return _error("plan", e)
            rows.append((name, mesh, r))
    gib = 2**30
    print(f"\n| scheme | mesh | params + optimizer + batch slice | temporaries | peak per device |"
          f"{' fit error |' if args.check else ''}{' fits ' + format(args.budget_gb, 'g') + ' GiB |' if args.budget_gb else ''}")
    print(f"|---|---|---:|---:|---:|{'---:|' if args.check else ''}{'---|' if args.budget_gb else ''}")
    for name, mesh, r in rows:
        m = r.per_device
        line = (f"| {name} | {mesh} | {m.arguments / gib:.2f} GiB | {m.temporaries / gib:.2f} GiB |"
                f" {m.peak / gib:.2f} GiB |")
        if args.check:
            line += f" {100 * r.check_error:.1f}% |"
        if args.budget_gb:
            line += f" {'yes' if m.peak <= args.budget_gb * gib else 'no'} |"
        print(line)
    return 0

"""``pockjax search``: find the tensors to fine-tune under a step-time and memory budget.

::

    pockjax search --out search-smollm2              # SmolLM2-135M, reverse_words, budget = paper
    pockjax finetune --scheme search-smollm2/scheme.json

Steps (one progress bar): trace the fine-tuning step once and calibrate the
cost model on a few pruned graphs; evaluate the reference scheme exactly (the
budgets); one backward pass per proxy batch for the gains; the search; an exact
check of the result; optionally real one-unit fine-tunes to validate the proxy
(``--validate N``) and measured step times (``--measure``). Writes, in ``--out``:
``scheme.json`` (``pockjax finetune --scheme``), ``report.json``, ``units.tsv``
and ``gain_vs_cost.png``; prints the table of units by gain and cost.

``--model mobilenetv2`` or ``all-minilm-l6-v2`` runs the classifiers' sensitivity
analysis instead (:mod:`pockjax.search.classifier`: a short fine-tune of each
block x tensor kind with the head, ``--steps``, ``--budget``)::

    pockjax search --model mobilenetv2 --task mnist5k --blocks 7-16 --out search-mnv2

Example (a tiny random model, so it runs in seconds):
  >>> import tempfile, os
  >>> out = tempfile.mkdtemp()
  >>> main(["--model", "tiny", "--task", "uppercase", "--batch-size", "2", "--train-examples", "16",
  ...       "--eval-examples", "2", "--reference-blocks", "1", "--proxy-batches", "1",
  ...       "--out", out, "--no-progress", "--no-plot", "--top", "0"])  # doctest: +ELLIPSIS
  model tiny: 2 blocks, 14 candidate tensors ...
  0
  >>> sorted(os.listdir(out))
  ['report.json', 'scheme.json', 'units.tsv']
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from typing import Any, Callable

from pockjax._cli_args import StoreGiven, given_options, non_negative_int, positive_finite_float, positive_int

__all__ = ["SearchConfig", "SearchError", "main", "register", "run_search", "parse_budget"]

_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "flop": 1, "flops": 1, "mflop": 1e6, "gflop": 1e9, "tflop": 1e12}


def _errors():
    from pockjax.errors import PockjaxError

    class SearchError(PockjaxError, ValueError):
        """Bad ``pockjax search`` input."""

    return SearchError


SearchError = _errors()


def parse_budget(spec: str | None, kind: str, reference: float, full: float | None = None) -> float | None:
    """A budget: ``none``, ``paper`` (the reference scheme's figure), ``0.8*paper``,
    ``full``/``0.5*full``, or an absolute amount (``1.5GiB``, ``800MB``, ``2.4e12``,
    ``900GFLOP``).

    Example:
      >>> parse_budget("paper", "memory", 100.0), parse_budget("0.5*paper", "memory", 100.0)
      (100.0, 50.0)
      >>> parse_budget("1KiB", "memory", 1.0), parse_budget("2GFLOP", "time", 1.0), parse_budget("none", "time", 1.0)
      (1024.0, 2000000000.0, None)
    """
    if spec is None:
        return None
    s = spec.strip().lower().replace(" ", "")
    if s in ("none", "off", ""):
        return None
    m = re.fullmatch(r"(?:([0-9.e+-]+)\*)?(paper|reference|ref|full)", s)
    if m:
        factor = float(m.group(1)) if m.group(1) else 1.0
        base = full if m.group(2) == "full" else reference
        if base is None:
            raise SearchError(f"--{kind}-budget {spec!r}: the full scheme's figure is not known here")
        if not factor > 0:
            raise SearchError(f"--{kind}-budget {spec!r}: the factor must be positive")
        return factor * base
    m = re.fullmatch(r"([0-9.]+(?:e[+-]?[0-9]+)?)([a-z]*)", s)
    if m and (m.group(2) in _UNITS or m.group(2) == ""):
        try:
            v = float(m.group(1)) * _UNITS.get(m.group(2), 1)
        except ValueError:
            v = -1.0
        if v > 0:
            return v
    raise SearchError(f"bad --{kind}-budget {spec!r}: use none, paper, 0.8*paper, full, 0.5*full,"
                      f" or an amount such as " + ("1.5GiB or 800MB" if kind == "memory" else "2.4e12 or 900GFLOP"))


@dataclasses.dataclass
class SearchConfig:
    """The flags of ``pockjax search`` (see ``pockjax search --help``)."""

    model: str = "smollm2-135m"
    task: str = "reverse_words"
    data: str | None = None
    batch_size: int = 8
    seq_len: int | None = None
    seed: int = 0
    train_examples: int = 4000
    eval_examples: int = 40
    lr: float = 3e-4
    kinds: str = "wq,wk,wv,wo,w1,w3,w2"
    blocks: str | None = None
    reference: str = "paper"
    reference_blocks: int | None = None
    time_budget: str = "paper"
    memory_budget: str = "paper"
    proxy_batches: int = 4
    validate: int = 0
    validate_steps: int = 8
    validate_blocks: str | None = None
    measure: bool = False
    out: str | None = None
    plot: bool = True
    top: int = 20
    progress: bool = True


def _parse_blocks(spec: str | None, n_layers: int) -> list[int] | None:
    if not spec:
        return None
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d+)(?:-(\d+))?", part)
        if not m:
            raise SearchError(f"bad block list {spec!r}: use e.g. 20-29 or 0,5,29 (negative counts from the end)")
        a = int(m.group(1))
        a = a + n_layers if a < 0 else a
        b = int(m.group(2)) if m.group(2) else a
        if not (0 <= a <= b < n_layers):
            raise SearchError(f"block range {part!r} is outside the model's {n_layers} blocks (0-{n_layers - 1})")
        out.update(range(a, b + 1))
    return sorted(out)


def _load(cfg: SearchConfig):
    from pockjax.models import llama

    if cfg.model == "tiny":
        from flax import nnx

        c = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256)
        return llama.Llama(c, rngs=nnx.Rngs(cfg.seed)), llama.Tokenizer.byte_level_for_tests()
    return llama.load_pretrained(cfg.model)


def _fmt_bytes(n: float) -> str:
    from pockjax.memory import format_bytes

    return format_bytes(n)


def write_outputs(out: str, scheme: Any, report: dict, cols: list[str]) -> None:
    """``--out``: ``scheme.json`` (``pockjax finetune --scheme``), ``report.json`` and
    ``units.tsv`` (``report["units"]``, columns ``cols``), each written atomically."""
    from pockjax.io.atomic import atomic_open, nulls_for_non_finite, write_json
    from pockjax.schemes import save_scheme_file

    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise SearchError(f"cannot create --out {out}: {e.strerror or e}") from None
    save_scheme_file(os.path.join(out, "scheme.json"), scheme)
    # a gain over a diverged validation run may be inf or NaN: null in JSON
    write_json(os.path.join(out, "report.json"), nulls_for_non_finite(report), indent=1, ensure_ascii=True)
    with atomic_open(os.path.join(out, "units.tsv"), "w") as f:
        f.write("\t".join(cols) + "\n")
        for r in report["units"]:
            f.write("\t".join(str(r[c]) for c in cols) + "\n")


def run_search(cfg: SearchConfig, *, log: Callable[[str], None] | None = None, model: Any = None,
               tokenizer: Any = None) -> dict:
    """Runs the whole search (see the module docstring); returns the report dict.

    Raises:
      PockjaxError: bad input (SearchError, BudgetError, SchemeError, DataError, a missing or
        corrupt model file, ...).
    """
    import numpy as np
    from tqdm.auto import tqdm

    from pockjax.data import Batcher
    from pockjax.search.contribution import gradient_proxy, short_finetunes, spearman
    from pockjax.search.cost import StepGraph, calibrate, measure_step_seconds
    from pockjax.search.search import search
    from pockjax.search.units import KINDS, all_units, scheme_for, units_of_scheme
    from pockjax.train.finetune import FinetuneConfig, _examples
    from pockjax.io.atomic import remove_stale_temporaries
    from pockjax.schemes import resolve_scheme

    log = log or (lambda s: print(s, flush=True))
    t_start = time.perf_counter()
    if cfg.batch_size < 1 or cfg.proxy_batches < 1:
        raise SearchError("--batch-size and --proxy-batches must be at least 1")
    if cfg.validate < 0 or cfg.validate_steps < 1:
        raise SearchError("--validate must be >= 0 and --validate-steps >= 1")
    if not cfg.lr > 0:
        raise SearchError(f"the learning rate must be positive, got {cfg.lr}")
    kinds = [k.strip() for k in cfg.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise SearchError(f"unknown tensor kind(s) {bad or cfg.kinds!r}; use some of {','.join(KINDS)}")
    for spec, kind in ((cfg.time_budget, "time"), (cfg.memory_budget, "memory")):
        parse_budget(spec, kind, 1.0, 1.0)  # syntax only, before any work
    if parse_budget(cfg.time_budget, "time", 1.0, 1.0) is None and \
            parse_budget(cfg.memory_budget, "memory", 1.0, 1.0) is None:
        raise SearchError("give at least one of --time-budget and --memory-budget")
    if cfg.out and os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise SearchError(f"--out {cfg.out} exists and is not a directory")
    if cfg.out:
        remove_stale_temporaries(cfg.out)  # what an interrupted search left (a missing --out is fine)

    if model is None:
        model, tokenizer = _load(cfg)
    mc = model.config
    if mc.scan_layers:
        raise SearchError("the search names blocks one by one: load the model with unrolled layers")
    blocks = _parse_blocks(cfg.blocks, mc.n_layers)
    units = all_units(mc, kinds, blocks)
    fc = FinetuneConfig(model=cfg.model, task=cfg.task, data=cfg.data, batch_size=cfg.batch_size,
                        seq_len=cfg.seq_len, seed=cfg.seed, train_examples=cfg.train_examples,
                        eval_examples=cfg.eval_examples)
    train, held, data_name = _examples(fc)
    batcher = Batcher(tokenizer, train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                      max_seq_len=mc.max_seq_len)
    window = batcher.answer_window
    ref_scheme = resolve_scheme(cfg.reference, mc, blocks=cfg.reference_blocks)  # as pockjax finetune
    ref_units = units_of_scheme(ref_scheme, mc)
    if not ref_units:
        raise SearchError(f"the reference scheme {cfg.reference!r} trains none of the search's tensor kinds")
    unsearched = sorted({u.kind for u in ref_units} - set(kinds))
    if unsearched:  # the reference's gain is summed over its tensors: each must be a candidate
        raise SearchError(f"the reference scheme {cfg.reference!r} trains {','.join(unsearched)}, which --kinds"
                          f" {cfg.kinds} leaves out: add them to --kinds, or choose another --reference")
    val_units = []
    if cfg.validate:
        vb = _parse_blocks(cfg.validate_blocks, mc.n_layers) or [mc.n_layers - 1]
        pool = [u for u in units if u.block in vb]
        if not pool:
            raise SearchError("--validate-blocks names no candidate block")
        val_units = pool[:cfg.validate]

    log(f"model {cfg.model}: {mc.n_layers} blocks, {len(units)} candidate tensors ({','.join(kinds)});"
        f" data {data_name}: batch {cfg.batch_size} x {batcher.seq_len}, answer window {window}")
    n_calib = len(kinds) + 10
    total = n_calib + 1 + cfg.proxy_batches + 1 + len(val_units) + (3 if cfg.measure else 0)
    bar = tqdm(total=total, disable=not cfg.progress, unit="job", dynamic_ncols=True, file=sys.stderr)
    timings = {}
    try:
        # 1. trace once, calibrate the cost model
        t = time.perf_counter()
        bar.set_description("trace")
        sg = StepGraph.for_model(model, batch=cfg.batch_size, seq=batcher.seq_len, window=window,
                                 batch_arrays=batcher.batch(0))

        def calib_progress(name):
            bar.set_description(f"cost {name[:24]}")
            bar.update(1)

        cm = calibrate(sg, kinds=kinds, progress=calib_progress)
        bar.set_description(f"reference {cfg.reference}")
        ref = sg.evaluate(ref_units)
        bar.update(1)
        timings["cost_model_seconds"] = time.perf_counter() - t
        full = None
        if "full" in f"{cfg.time_budget} {cfg.memory_budget}".lower():
            full = sg.evaluate(all_units(mc))  # every candidate kind of every block
        flops_budget = parse_budget(cfg.time_budget, "time", ref.flops, full and full.flops)
        mem_budget = parse_budget(cfg.memory_budget, "memory", ref.peak_bytes, full and full.peak_bytes)
        cheapest = min(units, key=lambda u: (cm.flops([u]), cm.memory([u])))
        ex1 = sg.evaluate([cheapest])
        if not ((flops_budget is None or ex1.flops <= flops_budget)
                and (mem_budget is None or ex1.peak_bytes <= mem_budget)):
            from pockjax.search.search import BudgetError

            raise BudgetError(
                f"no unit fits the budget: the cheapest ({cheapest.name}) alone needs {ex1.flops / 1e9:.3g} GFLOP"
                f" and {_fmt_bytes(ex1.peak_bytes)} (budget: "
                f"{'-' if flops_budget is None else f'{flops_budget / 1e9:.3g} GFLOP'},"
                f" {'-' if mem_budget is None else _fmt_bytes(mem_budget)}; the step with nothing trained:"
                f" {cm.fwd_flops / 1e9:.3g} GFLOP, {_fmt_bytes(cm.calibration[0][1].peak_bytes)})")

        # 2. the gain proxy
        t = time.perf_counter()
        bar.set_description("gradients")
        batches = [batcher.batch(i) for i in range(cfg.proxy_batches)]
        contrib = gradient_proxy(model, batches, window, units, lr=cfg.lr, progress=bar.update)
        timings["proxy_seconds"] = time.perf_counter() - t

        # 3. search + exact check
        t = time.perf_counter()
        bar.set_description("search")
        rounds: list[str] = []
        result = search(contrib.gain, cm, flops_budget=flops_budget, memory_budget=mem_budget,
                        step_graph=sg, incumbents=[ref_units], log=rounds.append)
        bar.update(1)
        timings["search_seconds"] = time.perf_counter() - t
        search_wall = time.perf_counter() - t_start

        # 4. optional: validate the proxy with real one-unit fine-tunes
        validation = None
        if val_units:
            t = time.perf_counter()
            bar.set_description("validate")
            from pockjax.data import Batcher as _B

            eval_b = _B(tokenizer, held or train[:cfg.batch_size], batch_size=cfg.batch_size,
                        seq_len=batcher.seq_len, seed=cfg.seed, max_seq_len=mc.max_seq_len)
            n_eval = max(1, min(4, len(held) // cfg.batch_size))
            real = short_finetunes(model, [batcher.batch(i) for i in range(cfg.validate_steps)],
                                   [eval_b.batch(i) for i in range(n_eval)], window, val_units,
                                   steps=cfg.validate_steps, lr=cfg.lr, progress=bar.update)
            rg = [real["gain"][u] for u in val_units]
            validation = {
                "units": [u.name for u in val_units], "steps": cfg.validate_steps,
                "held_out_loss_before": real["loss_before"],
                "held_out_loss_gain": {u.name: real["gain"][u] for u in val_units},
                "spearman_gain": spearman([contrib.gain[u] for u in val_units], rg) if len(rg) > 1 else None,
                "spearman_abs_grad": spearman([contrib.abs_grad[u] for u in val_units], rg) if len(rg) > 1 else None,
                "spearman_grad_norm": spearman([contrib.grad_norm[u] for u in val_units], rg) if len(rg) > 1 else None,
                "seconds": time.perf_counter() - t,
            }

        # 5. optional: measured step times
        measured = None
        if cfg.measure:
            measured = {}
            for name, us in (("reference", ref_units), ("searched", result.units)):
                bar.set_description(f"measure {name}")
                measured[name] = measure_step_seconds(model, tokenizer, us, [batcher.batch(i) for i in range(3)],
                                                      window, steps=3, lr=cfg.lr)
                bar.update(1)
            bar.update(1)
    finally:
        bar.close()

    chosen = set(result.units)
    rows = []
    for u in units:
        rows.append({"unit": u.name, "path": u.path, "block": u.block, "kind": u.kind,
                     "gain": contrib.gain[u], "abs_grad": contrib.abs_grad[u], "grad_norm": contrib.grad_norm[u],
                     "params": sg.param_count(u), "flops_alone": cm.flops([u]) - cm.fwd_flops,
                     "weight_flops": cm.weight(u), "depth_flops": cm.depth(u),
                     "memory_alone": cm.memory([u]), "chosen": u in chosen, "reference": u in set(ref_units)})
    rows.sort(key=lambda r: -r["gain"])
    by_kind = {}
    for k in kinds:
        g = [contrib.gain[u] for u in units if u.kind == k]
        n = sg.param_count(next(u for u in units if u.kind == k))
        by_kind[k] = {"mean_gain": float(np.mean(g)), "mean_gain_per_param": float(np.mean(g)) / n,
                      "chosen": sum(1 for u in result.units if u.kind == k)}
    kind_rank = sorted(by_kind, key=lambda k: -by_kind[k]["mean_gain"])
    finding = None
    if {"w1", "w2"} <= set(kinds):
        attn = [k for k in ("wq", "wk", "wv", "wo") if k in kinds]
        w2 = by_kind["w2"]["mean_gain"]
        finding = {
            "w1_over_w2": by_kind["w1"]["mean_gain"] > w2,
            "attention_over_w2": {k: by_kind[k]["mean_gain"] > w2 for k in attn},
            "holds": by_kind["w1"]["mean_gain"] > w2 and all(by_kind[k]["mean_gain"] > w2 for k in attn),
        }
    ex = result.exact
    report = {
        "config": dataclasses.asdict(cfg), "data": data_name, "seq_len": batcher.seq_len, "window": window,
        "n_layers": mc.n_layers, "candidates": len(units),
        "reference": {"scheme": ref_scheme.name or cfg.reference, "units": [u.name for u in ref_units],
                      "flops": ref.flops, "planned_peak_bytes": ref.peak_bytes, "trainable": ref.trainable},
        "budget": {"flops": flops_budget, "memory_bytes": mem_budget, "time_spec": cfg.time_budget,
                   "memory_spec": cfg.memory_budget},
        "searched": {"units": [u.name for u in result.units], "predicted_gain": result.gain,
                     "reference_predicted_gain": sum(contrib.gain[u] for u in ref_units),
                     "predicted_flops": result.flops, "predicted_memory": result.memory,
                     "flops": ex.flops, "planned_peak_bytes": ex.peak_bytes, "trainable": ex.trainable,
                     "anchors": result.anchors, "rounds": rounds},
        "cost_model": cm.to_dict(),
        "cost_model_check": [{"units": [u.name for u in us], "exact_flops": e.flops, "predicted_flops": cm.flops(us),
                              "exact_peak_bytes": e.peak_bytes, "predicted_peak_bytes": cm.memory(us)}
                             for us, e in cm.calibration + [(ref_units, ref), (result.units, ex)]],
        "by_kind": by_kind, "kind_ranking": kind_rank, "paper_finding": finding,
        "validation": validation, "measured": measured,
        "timings": {**timings, "search_wall_seconds": search_wall, "wall_seconds": time.perf_counter() - t_start},
        "units": rows,
    }

    # -- print ------------------------------------------------------------------------
    if cfg.top:
        log(f"{'unit':<9} {'gain':>10} {'GFLOP alone':>11} {'W GFLOP':>8} {'mem alone':>11}  chosen ref")
        for r in rows[:cfg.top]:
            log(f"{r['unit']:<9} {r['gain']:10.4g} {r['flops_alone'] / 1e9:11.2f} {r['weight_flops'] / 1e9:8.3f}"
                f" {_fmt_bytes(r['memory_alone']):>11}  {'*' if r['chosen'] else ' ':^6} {'*' if r['reference'] else ' '}")
    log("kinds by mean gain: " + " > ".join(f"{k} ({by_kind[k]['mean_gain']:.3g})" for k in kind_rank))
    if finding is not None:
        log(f"paper's finding (attention and w1 over w2): {'holds' if finding['holds'] else 'does NOT hold'}")
    log(f"reference {report['reference']['scheme']}: {len(ref_units)} tensors, {ref.flops / 1e9:.1f} GFLOP,"
        f" planned peak {_fmt_bytes(ref.peak_bytes)}, predicted gain {report['searched']['reference_predicted_gain']:.4g}")
    log(f"searched: {len(result.units)} tensors (blocks {min(u.block for u in result.units)}-"
        f"{max(u.block for u in result.units)}), {ex.flops / 1e9:.1f} GFLOP, planned peak {_fmt_bytes(ex.peak_bytes)},"
        f" predicted gain {result.gain:.4g}")
    if validation and validation["spearman_gain"] is not None:
        log(f"proxy vs real {cfg.validate_steps}-step fine-tunes on {len(val_units)} tensors: Spearman"
            f" {validation['spearman_gain']:.3f} (abs-grad {validation['spearman_abs_grad']:.3f},"
            f" grad-norm {validation['spearman_grad_norm']:.3f})")
    if measured:
        log(f"measured step: reference {measured['reference']['seconds_per_step']:.2f} s,"
            f" searched {measured['searched']['seconds_per_step']:.2f} s")
    log(f"search wall time {search_wall:.1f} s (cost model {timings['cost_model_seconds']:.1f} s,"
        f" gradients {timings['proxy_seconds']:.1f} s, search {timings['search_seconds']:.1f} s)")

    if cfg.out:
        write_outputs(cfg.out, scheme_for(result.units, name=f"searched ({len(result.units)} tensors,"
                                                             f" budget {cfg.time_budget}/{cfg.memory_budget})"),
                      report, ["unit", "gain", "abs_grad", "grad_norm", "params", "flops_alone", "weight_flops",
                               "memory_alone", "chosen", "reference"])
        if cfg.plot:
            from pockjax.search.plot import plot_gain_vs_cost

            plot_gain_vs_cost(report, os.path.join(cfg.out, "gain_vs_cost.png"))
        log(f"wrote {cfg.out}/scheme.json (pockjax finetune --scheme {cfg.out}/scheme.json), report.json,"
            f" units.tsv" + (", gain_vs_cost.png" if cfg.plot else ""))
    return report


def register(subparsers) -> None:
    d = SearchConfig()
    p = subparsers.add_parser(
        "search", help="find the tensors to fine-tune under a step-time and memory budget",
        description="Layer contribution analysis and a budgeted scheme search (PockEngine).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=d.model, help="smollm2-135m, a .gguf, a Hugging Face dir, or tiny; or a"
                   " classifier (mobilenetv2, all-minilm-l6-v2): the per-unit sensitivity analysis")
    p.add_argument("--task", default=d.task, action=StoreGiven,
                   help="built-in task (a classifier's default: mnist5k, tweet_polarity)")
    p.add_argument("--data", default=None, help="Alpaca JSONL instead of a built-in task")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, action=StoreGiven)
    p.add_argument("--seq-len", type=positive_int, default=None, action=StoreGiven)
    p.add_argument("--seed", type=non_negative_int, default=d.seed)
    p.add_argument("--train-examples", type=positive_int, default=d.train_examples)
    p.add_argument("--eval-examples", type=non_negative_int, default=d.eval_examples, action=StoreGiven)
    p.add_argument("--lr", type=positive_finite_float, default=d.lr, action=StoreGiven,
                   help="AdamW learning rate (scales the gains)")
    p.add_argument("--kinds", default=d.kinds, action=StoreGiven,
                   help="tensor kinds to consider (classifiers: expand,depthwise,project or q,k,v,o,up,down)")
    p.add_argument("--blocks", default=None, help="candidate blocks, e.g. 10-29 (default: all)")
    p.add_argument("--reference", default=d.reference,
                   help="scheme the budgets refer to: a pockjax.schemes name (paper, full, ...), as pockjax"
                        " finetune trains it, or a scheme file")
    p.add_argument("--reference-blocks", type=positive_int, default=None,
                   help="--blocks of the reference scheme (default: the registry's, as pockjax finetune)")
    p.add_argument("--time-budget", default=d.time_budget,
                   help="step-time budget as step FLOPs: paper, 0.8*paper, 2.4e12, 900GFLOP, none")
    p.add_argument("--memory-budget", default=d.memory_budget,
                   help="planned peak memory: paper, 0.8*paper, 1.5GiB, 800MB, none")
    p.add_argument("--proxy-batches", type=positive_int, default=d.proxy_batches, help="backward passes for the gains")
    p.add_argument("--validate", type=non_negative_int, default=0, metavar="N",
                   help="also run real one-tensor fine-tunes on N tensors and report the rank correlation")
    p.add_argument("--validate-steps", type=positive_int, default=d.validate_steps)
    p.add_argument("--validate-blocks", default=None, help="blocks of the validated tensors (default: the last)")
    p.add_argument("--measure", action="store_true", help="compile and time the reference and searched steps")
    p.add_argument("--out", default=None, help="directory for scheme.json, report.json, units.tsv, the plot")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--top", type=non_negative_int, default=d.top, help="rows of the printed table")
    p.add_argument("--no-progress", action="store_true")
    c = p.add_argument_group("classifiers (--model mobilenetv2 or all-minilm-l6-v2)")
    c.add_argument("--steps", type=positive_int, default=None, help="fine-tuning steps per unit (default 20)")
    c.add_argument("--budget", default=None,
                   help="flops=X and/or params=X for the greedy scheme: paper, 0.5*paper, full, 2GFLOP, 200k"
                        " (default: flops=paper)")
    c.add_argument("--image-size", type=positive_int, default=None, help="image side in pixels (default 32)")
    c.add_argument("--train-per-class", type=non_negative_int, default=None,
                   help="training examples per class (default 100; 0: all)")
    c.add_argument("--optimizer", default=None, help="adam (default), adamw, sgd, lion")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    """Runs the search; a :class:`~pockjax.errors.PockjaxError` (bad input) reaches
    :mod:`pockjax.cli`, which prints it in one line (exit 2); anything else is a bug."""
    from pockjax.train.classify import CLASSIFIERS

    if args.model in CLASSIFIERS:
        return _run_classifier(args)
    extra = [f"--{k.replace('_', '-')}" for k in ("steps", "budget", "image_size", "train_per_class", "optimizer")
             if getattr(args, k) is not None]
    if extra:
        raise SearchError(f"{', '.join(extra)}: for the classifiers (--model mobilenetv2 or all-minilm-l6-v2)")
    if "task" in given_options(args) and args.data:  # as finetune: the data file replaces the task
        raise SearchError(f"--task {args.task} and --data {args.data}: the data file replaces the task; give one"
                          " of them")
    fields = {f.name for f in dataclasses.fields(SearchConfig)}
    kw = {k: getattr(args, k) for k in fields if hasattr(args, k)}
    kw["plot"] = not args.no_plot
    kw["progress"] = not args.no_progress
    run_search(SearchConfig(**kw))
    return 0


def _run_classifier(args: argparse.Namespace) -> int:
    """``pockjax search --model mobilenetv2|all-minilm-l6-v2`` (:mod:`pockjax.search.classifier`);
    the LLaMA-only options are refused, the shared ones left unset take the classifier's defaults."""
    from pockjax.search.classifier import ClassifierSearchConfig, run

    d = SearchConfig()
    llama_only = {"data": None, "train_examples": d.train_examples, "reference": d.reference,
                  "reference_blocks": None, "time_budget": d.time_budget, "memory_budget": d.memory_budget,
                  "proxy_batches": d.proxy_batches, "validate": 0, "validate_steps": d.validate_steps,
                  "validate_blocks": None, "measure": False}
    bad = [f"--{k.replace('_', '-')}" for k, v in llama_only.items() if getattr(args, k) != v]
    if bad:
        raise SearchError(f"{', '.join(bad)}: not for --model {args.model} (see the classifier options)")
    given = given_options(args)
    kw = {k: getattr(args, k) for k in ("model", "blocks", "seed", "out", "top", "steps", "budget", "image_size",
                                         "train_per_class", "optimizer") if getattr(args, k) is not None}
    kw.update({k: getattr(args, k) for k in ("task", "batch_size", "seq_len", "eval_examples", "lr", "kinds")
               if k in given})
    if kw.get("train_per_class") == 0:
        kw["train_per_class"] = None
    run(ClassifierSearchConfig(**kw, plot=not args.no_plot, progress=not args.no_progress))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``pockjax search ARGS`` as a function (returns the exit status)."""
    from pockjax.cli import main as cli_main

    return cli_main(["search", *(argv or [])])

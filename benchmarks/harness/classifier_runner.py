"""Runs ``pockjax bench --workload mobilenetv2|minilm``: the classifier rows of
:mod:`benchmarks.harness.classifier_rows`, each in its own process.

As the LLaMA benchmark (:mod:`benchmarks.harness.runner`, whose process runner and
worker environment this reuses): the data is prepared once (the same batches for
every row); the speed phase runs ``reps`` rounds of every row in a fresh process,
rotated so that no row always runs first; a row's step time is the median of all
its timed steps and its peak RSS the largest training-phase peak of its processes.
The quality phase (``quality_steps > 0``) fine-tunes every quality row for the same
steps on the same batches, then scores held-out accuracy on the same fixed test
examples, in the row's process. Writes ``results.json``, ``results.md`` and
``results.png`` (throughput and peak memory) to ``out``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

import numpy as np

from benchmarks.harness.classifier_rows import (CLASSIFIER_ROWS, WORKLOADS, ClassifierBenchConfig,
                                                default_classifier_rows, prepare, speed_summary)
from benchmarks.harness.common import BenchError, cpu_words, machine, versions
from benchmarks.harness.runner import _run_job, probe_gpu, worker_env
from pockjax.io.atomic import remove_stale_temporaries, save_figure, write_json, write_text

__all__ = ["run_classifier", "classifier_table", "plot_classifier"]

#: The models' names in the tables.
_TITLES = {"mobilenetv2": "MobileNetV2 (torchvision ImageNet weights), MNIST-5k",
           "minilm": "all-MiniLM-L6-v2 encoder, tweet_polarity"}


def run_classifier(cfg: ClassifierBenchConfig, *, rows: Sequence[str] | None = None, reps: int = 2,
                   quality_rows: Sequence[str] | None = None, out: str = "bench-results",
                   timeout: float | None = 1800.0, progress: bool = True, log=print) -> dict:
    """Runs the benchmark of ``cfg.workload`` and writes ``out/results.{json,md,png}``.

    ``rows`` default to :func:`default_classifier_rows`; ``quality_rows`` (run when
    ``cfg.quality_steps`` > 0) to the speed rows less the IREE one. A row that fails
    is reported in the results (its error) and the run goes on.

    Raises:
      BenchError: an unknown row, nothing to run, or reps below 1.
    """
    table = CLASSIFIER_ROWS[cfg.workload]
    rows = list(default_classifier_rows(cfg.workload, cfg.device) if rows is None else rows)
    if quality_rows is None:
        quality_rows = [r for r in rows if not table[r].options.get("target")]  # IREE: same update as paper
    quality_rows = list(quality_rows) if cfg.quality_steps else []
    unknown = [r for r in rows + quality_rows if r not in table]
    if unknown:
        raise BenchError(f"unknown {cfg.workload} rows {unknown}; rows: {', '.join(table)}")
    if not rows and not quality_rows:
        raise BenchError("nothing to run: give speed rows, or quality steps and rows")
    if reps < 1:
        raise BenchError(f"reps must be at least 1, got {reps}")
    cpu_only = [r for r in rows + quality_rows if cfg.device != "cpu"
                and (table[r].options.get("target") == "cpu" or table[r].options.get("cpu_only"))]
    if cpu_only:
        raise BenchError(f"rows {cpu_only} run on the CPU only; leave them out with --device gpu")
    gpu = probe_gpu(cfg) if cfg.device == "gpu" else None  # probe_gpu reads cfg.device only
    env = worker_env(cfg)
    workdir = os.path.join(out, "work")
    os.makedirs(workdir, exist_ok=True)
    for d in (out, workdir):
        remove_stale_temporaries(d)
    t_start = time.time()
    info = prepare(cfg, out)
    base = {"config": cfg.to_dict(), "workload": cfg.workload, **info}
    jobs = [(name, "speed", rep) for rep in range(reps if rows else 0)
            for name in rows[rep % len(rows):] + rows[:rep % len(rows)]]
    jobs += [(name, "quality", 0) for name in quality_rows]
    from tqdm.auto import tqdm

    raw: list[dict] = []
    with tqdm(total=len(jobs), disable=not progress, unit="run", dynamic_ncols=True, file=sys.stderr) as bar:
        for name, phase, rep in jobs:
            bar.set_description(f"{phase} {name}" + (f" {rep + 1}/{reps}" if phase == "speed" else ""))
            res = _run_job({**base, "row": name, "phase": phase, "rep": rep}, workdir, timeout, env)
            res["rep"] = rep
            if "error" in res:
                log(f"{name} ({phase}, round {rep + 1}) failed: {res['error'].strip().splitlines()[-1]}")
            raw.append(res)
            bar.update(1)
    results = summarize_classifier(raw, cfg, info)
    if gpu:
        results["machine"].update(gpu)
    results["wall_seconds"] = time.time() - t_start
    write_json(os.path.join(out, "results.json"), results, indent=1, ensure_ascii=True, default=str)
    write_text(os.path.join(out, "results.md"), classifier_table(results))
    plot_classifier(results, os.path.join(out, "results.png"))
    return results


def summarize_classifier(raw: list[dict], cfg: ClassifierBenchConfig, info: dict) -> dict:
    """The results: per-row speed (:func:`speed_summary`) and quality, the settings, the machine."""
    quality = {}
    for r in raw:
        if r.get("phase") == "quality":
            q = {"error": r.get("error"), "steps": len(r.get("losses", []))}
            if "error" not in r:
                q.update(accuracy=r["accuracy"], eval_examples=r["eval_examples"], first_loss=r["losses"][0],
                         final_loss=r["losses"][-1])
            quality[r["row"]] = q
    v = versions()
    for r in raw:
        v.update(r.get("versions") or {})
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "workload": cfg.workload,
            "machine": machine(), "versions": v, "config": cfg.to_dict(),
            "unit": WORKLOADS[cfg.workload]["unit"], "task": info["task"], "classes": info["classes"],
            "eval_examples": info["eval_examples"], "speed": speed_summary(raw, cfg), "quality": quality,
            "raw": raw}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def classifier_table(results: dict) -> str:
    """The results as a markdown table: step time, throughput, speed-up over PyTorch
    full, peak memory, trainable parameters and held-out accuracy, row by row."""
    cfg, unit, m = results["config"], results["unit"], results["machine"]
    gpu = cfg["device"] == "gpu"
    shape = (f"batch {cfg['batch']} x {cfg['image_size']}x{cfg['image_size']} images" if unit == "images"
             else f"batch {cfg['batch']} x {cfg['seq']} tokens")
    where = f"{m.get('gpu', 'GPU')}, host {m['cpu']}" if gpu else cpu_words(m)
    v = results["versions"]
    lines = [f"{_TITLES[results['workload']]}: fp32 fine-tuning step, {shape}",
             f"({results['date']}; {where}; " + ", ".join(
                 f"{k} {v[k]}" for k in ("jax", "flax", "optax", "torch", "transformers", "peft",
                                         "iree-base-compiler", "tensorflow") if k in v) + ")", ""]
    q_steps = cfg["quality_steps"]
    acc_head = f"held-out accuracy after {q_steps} step{'s' if q_steps != 1 else ''}" if q_steps \
        else "held-out accuracy"
    mem_key = "device_peak_bytes" if gpu else "train_peak_rss"
    lines.append(f"| row | what | step (s) | {unit}/s | vs PyTorch full | "
                 f"{'peak GPU memory' if gpu else 'peak RSS'} (GiB) | trainable | {acc_head} |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
    table = CLASSIFIER_ROWS[results["workload"]]
    names = [n for n in table if n in results["speed"] or n in results["quality"]]
    for name in names:
        s, q = results["speed"].get(name), results["quality"].get(name, {})
        if s and s["step_times"]:
            cells = [f"{s['step_s']:.3f}", f"{s['per_s']:.0f}",
                     f"{s['speedup_vs_torch_full']:.2f}x" if s.get("speedup_vs_torch_full") else "",
                     _gib(s[mem_key]) if s.get(mem_key) is not None else "",
                     f"{s['trainable_params'] / 1e6:.3f}M" if s.get("trainable_params") is not None else ""]
        else:
            cells = ["failed" if s else ""] * 5
        acc = (f"{100 * q['accuracy']:.1f}%" if q.get("accuracy") is not None
               else "failed" if q.get("error") else "")
        lines.append(f"| {name} | {table[name].description} | " + " | ".join(cells) + f" | {acc} |")
    lines.append("")
    if q_steps:
        lines.append(f"Quality: {q_steps} Adam step{'s' if q_steps != 1 else ''} of batch {cfg['batch']} on {results['task']} (the same"
                     f" batches for every row), then accuracy on the same {results['eval_examples']} held-out"
                     f" examples; learning rate {cfg['lr']:g} full, {cfg['sparse_lr']:g} sparse,"
                     f" {cfg['lora_lr']:g} LoRA.")
    failed = [(n, s["errors"][-1]) for n, s in results["speed"].items() if s["errors"]]
    failed += [(n, q["error"]) for n, q in results["quality"].items() if q.get("error")]
    for name, err in failed:
        lines.append(f"- {name} failed: {err.strip().splitlines()[-1]}")
    return "\n".join(lines) + "\n"


def plot_classifier(results: dict, path: str) -> str | None:
    """Throughput and peak memory per row (PNG); None without matplotlib or rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    table = CLASSIFIER_ROWS[results["workload"]]
    names = [n for n in table if results["speed"].get(n, {}).get("step_times")]
    if not names:
        return None
    gpu = results["config"]["device"] == "gpu"
    mem_key = "device_peak_bytes" if gpu else "train_peak_rss"
    colors = {"torch": "#ee6633", "tf": "#ffaa00", "jax": "#8899aa", "pockjax": "#3377cc"}
    panels = [([results["speed"][n]["per_s"] for n in names], f"{results['unit']} / s (higher is better)"),
              ([results["speed"][n].get(mem_key, 0) / 2**30 for n in names],
               f"peak {'GPU memory' if gpu else 'RSS'}, GiB (lower is better)")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 1.6))
    y = np.arange(len(names))
    for ax, (vals, title) in zip(axes, panels):
        ax.barh(y, vals, color=[colors.get(table[n].framework, "#999999") for n in names])
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.15)
    fig.suptitle(classifier_table(results).splitlines()[0], fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)

"""Runs the benchmark: every row in its own process, interleaved over repetitions.

``run(config, rows, reps, out)``:

1. prepares the data of each phase once (the same token batches for every row,
   saved as ``.npz``), and the model's source (the GGUF file for
   ``smollm2-135m``; for ``tiny`` and ``llama-1b`` a random model written as a
   Hugging Face directory, so every framework starts from the same weights);
   with ``device="gpu"`` it first checks, in a child process, that JAX sees an
   NVIDIA GPU (and names it in the results);
2. speed phase: ``reps`` rounds; each round runs every row once, in a fresh
   process, in a rotated order (round ``r`` starts at row ``r``), so that no row
   always runs first or last; each process does ``warmup`` untimed and
   ``steps`` timed steps; a row's step time is the median over all its timed
   steps, its peak RSS the largest training-phase peak over its processes;
3. quality phase (``quality_steps > 0``): each quality row fine-tunes for the
   same number of steps on the same batches, writes its weights, and this
   process scores held-out exact match on them with one evaluator (pockjax's
   greedy decoder), so every framework is judged the same way;
4. writes ``results.json``, ``results.md`` (the table) and ``results.png``
   (tokens/s and peak RSS, or peak GPU memory on ``gpu``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.harness.common import (RANDOM_MODELS, BenchConfig, BenchError, GpuUnavailableError, ResultsFileError,
                                       read_results, cpu_words, machine, make_data, median,
                                  random_config, versions)
from benchmarks.harness.rows import CPU_ONLY_ROWS, PRECISION_ROWS, QUALITY_ROWS, ROWS, default_rows
from pockjax.errors import FileFormatError
from pockjax.io.atomic import (atomic_directory, atomic_open, remove_stale_temporaries, save_figure, write_json,
                               write_text)
from pockjax.io.jsonfile import read_json_object

__all__ = ["run", "BenchInterrupted", "summarize", "merge", "markdown_table", "torch_mkl_note", "plot_results", "GOALS"]

#: The goals this benchmark checks (row, baseline, what).
GOALS = (
    ("pockjax-paper", "torch-lora", "speed", 2.0),
    ("pockjax-paper", "torch-full", "speed", 3.0),
    ("pockjax-full", "torch-full", "speed", 1.3),
    ("pockjax-paper", "torch-lora", "memory", 1.0),
    ("pockjax-lora", "torch-lora", "speed", 1.5),
    ("pockjax-paper", "pockjax-full", "accuracy", 2.0),
)


#: The source checkout this harness is in (``benchmarks/harness/`` below it).
CHECKOUT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_env(cfg: BenchConfig) -> dict:
    """The environment of a row's process: JAX pinned to the benchmark's device
    (``JAX_PLATFORMS``), and on ``gpu`` float32 matmuls at full precision (no
    TF32, as PyTorch's default) and no up-front allocation of most of the GPU,
    so that its peak memory is what the row used. The checkout's root comes
    first on ``PYTHONPATH``, so the process imports this harness
    (``python -m benchmarks.harness.worker``).

    Example:
        >>> env = worker_env(BenchConfig(device="gpu"))
        >>> env["JAX_PLATFORMS"], env["JAX_DEFAULT_MATMUL_PRECISION"]
        ('cuda', 'highest')
        >>> worker_env(BenchConfig())["JAX_PLATFORMS"]
        'cpu'
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CHECKOUT_ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if cfg.device == "gpu":
        env.update(JAX_PLATFORMS="cuda", JAX_DEFAULT_MATMUL_PRECISION="highest",
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
    else:
        env["JAX_PLATFORMS"] = "cpu"
    return env


_GPU_PROBE = """
import json
try:
    import jax
    devices = jax.devices("cuda")
    stats = devices[0].memory_stats() or {}
    print(json.dumps({"gpu": devices[0].device_kind, "gpus": len(devices),
                      "gpu_memory_bytes": int(stats.get("bytes_limit", 0))}))
except Exception as e:
    print(json.dumps({"error": f"jax.devices('cuda') raised {type(e).__name__}: {e}".rstrip(": ")}))
"""


def probe_gpu(cfg: BenchConfig, timeout: float = 300.0) -> dict:
    """Checks in a child process (this one's JAX stays off the GPU) that JAX sees
    an NVIDIA GPU; returns its name, count and usable memory.

    Raises:
      GpuUnavailableError: no GPU (the message gives JAX's reason and what to do).
    """
    try:
        proc = subprocess.run([sys.executable, "-c", _GPU_PROBE], env=worker_env(cfg),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise GpuUnavailableError(f"--device gpu: JAX did not start its CUDA backend within {timeout:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    try:
        info = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        info = {"error": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
    if "error" in info:
        raise GpuUnavailableError("--device gpu needs an NVIDIA GPU that JAX can use (a jaxlib CUDA plugin,"
                           " e.g. `pip install jax[cuda13]`, and PyTorch built with CUDA), but "
                           f"{info['error']}. Run on the CPU with --device cpu.")
    return info


def _write_npz(path: str, batches: list[dict]) -> None:
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    with atomic_open(path, "wb") as f:
        np.savez(f, **stacked)


def _prepare(cfg: BenchConfig, out: str, phases: Sequence[str]) -> dict:
    from benchmarks.harness.common import load_tokenizer_for
    from pockjax.models import llama

    src: dict[str, Any] = {}
    if cfg.model in RANDOM_MODELS:
        from flax import nnx

        hf_dir = os.path.join(out, f"{cfg.model}-model")
        with atomic_directory(hf_dir) as tmp:  # replaces an earlier run's checkpoint in one step
            llama.save_hf_checkpoint(llama.Llama(random_config(cfg.model), rngs=nnx.Rngs(cfg.seed)), tmp)
        src["hf_dir"] = hf_dir
        config = llama.read_hf_checkpoint(hf_dir)[0]
    else:
        src["gguf"] = llama.pretrained_path(cfg.model)
        from pockjax.models.llama.gguf import gguf_config, open_gguf

        config = gguf_config(open_gguf(src["gguf"]))
    tokenizer = load_tokenizer_for(cfg.model)
    data = {}
    for phase in phases:
        d = make_data(cfg, phase, tokenizer)
        path = os.path.join(out, f"data-{phase}.npz")
        _write_npz(path, d["batches"])
        data[phase] = {"path": path, "window": d["window"], "seq": d["seq"], "batch": d["batch"],
                       "held": d["held"]}
    from benchmarks.harness.common import torch_name
    from pockjax.train.schemes import llama_scheme

    paper = llama_scheme("paper", config, blocks=cfg.blocks)
    return {"src": src, "data": data, "config": config, "tokenizer": tokenizer,
            "paper_torch_names": [torch_name(p) for p, _ in paper.rules], "paper_name": paper.name}


def _run_job(job: dict, workdir: str, timeout: float | None, env: dict) -> dict:
    tag = f"{job['phase']}-{job['row']}-{job.get('rep', 0)}"
    jpath, rpath = os.path.join(workdir, f"job-{tag}.json"), os.path.join(workdir, f"result-{tag}.json")
    write_json(jpath, job, indent=None, ensure_ascii=True)
    if os.path.exists(rpath):
        os.remove(rpath)
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.harness.worker", jpath, rpath], env=env,
                              capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        return {"row": job["row"], "phase": job["phase"], "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t
    if not os.path.exists(rpath):
        return {"row": job["row"], "phase": job["phase"],
                "error": f"the worker died (exit {proc.returncode}):\n{tail}"}
    try:
        result = read_json_object(rpath, what="row result")
    except FileFormatError as e:
        return {"row": job["row"], "phase": job["phase"], "error": f"the worker's result is unreadable: {e}"}
    result["wall_s"] = wall
    return result


def _evaluate(save_dir: str, prep: dict, cfg: BenchConfig) -> dict:
    from pockjax.data import evaluate_model
    from pockjax.models import llama

    model = llama.load_hf_checkpoint(save_dir)
    held = prep["data"]["quality"]["held"]
    tok = prep["tokenizer"]
    answers = [len(tok.encode(ex.answer, add_bos=False)) for ex in held]
    res = evaluate_model(model, tok, held, max_new_tokens=max(answers, default=0) + 8,
                         batch_size=len(held) if len(held) <= 64 else 32)
    return {"accuracy": res["accuracy"], "correct": res["correct"], "total": res["total"],
            "predictions": res["predictions"][:3]}


def run(cfg: BenchConfig, *, rows: Sequence[str] | None = None, reps: int = 2,
        quality_rows: Sequence[str] | None = None, out: str = "bench-results",
        timeout: float | None = 1800.0, progress: bool = True, log=print) -> dict:
    """Runs the benchmark and writes ``out/results.{json,md,png}``.

    Args:
      cfg: The :class:`BenchConfig`.
      rows: Speed-phase rows (names of :data:`benchmarks.harness.rows.ROWS`; default
        :func:`~benchmarks.harness.rows.default_rows` of ``cfg.device``); empty: no speed phase.
      reps: Rounds of the speed phase.
      quality_rows: Quality-phase rows (default :data:`QUALITY_ROWS` when
        ``cfg.quality_steps`` > 0).
      out: Output directory (created; earlier results there are replaced).
      timeout: Seconds one row's process may take.
      progress: Show a progress bar.

    Returns:
      The results dict (also in ``results.json``).

    Raises:
      BenchError: an unknown row, no rows at all, a CPU-only row on ``gpu``,
        or a precision row (:data:`~benchmarks.harness.rows.PRECISION_ROWS`) in the quality phase.
      GpuUnavailableError: ``cfg.device`` is ``gpu`` and JAX sees no GPU.
      VendorShimError: ``cfg.torch_mkl_any_cpu`` and the shim cannot be built.
    """
    rows = list(default_rows(cfg.device) if rows is None else rows)
    quality_rows = list(QUALITY_ROWS if quality_rows is None else quality_rows) if cfg.quality_steps else []
    unknown = [r for r in rows + quality_rows if r not in ROWS]
    if unknown:
        raise BenchError(f"unknown benchmark rows {unknown}; rows: {', '.join(ROWS)}")
    if not rows and not quality_rows:
        raise BenchError("nothing to run: give speed rows, or quality steps and rows")
    in_precision = [r for r in quality_rows if r in PRECISION_ROWS]
    if in_precision:
        raise BenchError(f"rows {in_precision} have no quality phase here (their frozen tensors are held in"
                         " another precision); leave them out of --quality-rows, and measure their quality"
                         " with benchmarks/precision.py --finetune")
    if reps < 1:
        raise BenchError(f"reps must be at least 1, got {reps}")
    gpu = None
    if cfg.device == "gpu":
        cpu_only = [r for r in rows + quality_rows if r in CPU_ONLY_ROWS]
        if cpu_only:
            raise BenchError(f"rows {cpu_only} run on the CPU only (IREE's cpu target); leave them out"
                             " with --device gpu")
        gpu = probe_gpu(cfg)
        # This process's JAX (the random model's init, the evaluator) must not
        # take most of the GPU up front while the rows' processes run.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env = worker_env(cfg)
    os.makedirs(out, exist_ok=True)
    workdir = os.path.join(out, "work")
    os.makedirs(workdir, exist_ok=True)
    for d in (out, workdir):  # what an interrupted run left
        remove_stale_temporaries(d)
    torch_env = env
    if cfg.torch_mkl_any_cpu:
        from benchmarks.harness.mkl import build_vendor_shim, preload_env

        torch_env = preload_env(env, build_vendor_shim(workdir))

    def env_of(name: str) -> dict:  # the shim, if any, goes to the PyTorch rows only
        return torch_env if ROWS[name].framework == "torch" else env

    phases = (["speed"] if rows else []) + (["quality"] if quality_rows else [])
    t_start = time.time()
    prep = _prepare(cfg, out, phases)
    from tqdm.auto import tqdm

    total = reps * len(rows) + len(quality_rows)
    bar = tqdm(total=total, disable=not progress, unit="run", dynamic_ncols=True, file=sys.stderr)
    raw: list[dict] = []
    base = {"config": cfg.to_dict(), **prep["src"], "trainable": prep["paper_torch_names"]}
    try:
        for rep in range(reps if rows else 0):
            order = rows[rep % len(rows):] + rows[:rep % len(rows)]
            for name in order:
                bar.set_description(f"speed {rep + 1}/{reps} {name}")
                d = prep["data"]["speed"]
                job = {**base, "row": name, "phase": "speed", "rep": rep, "data": d["path"],
                       "window": d["window"]}
                res = _run_job(job, workdir, timeout, env_of(name))
                res["rep"] = rep  # the round, for per-round ratios (pockjax bench --history)
                if "error" in res:
                    log(f"{name} (round {rep + 1}) failed: {res['error'].strip().splitlines()[-1]}")
                raw.append(res)
                bar.update(1)
        for name in quality_rows:
            bar.set_description(f"quality {name}")
            d = prep["data"]["quality"]
            save = os.path.join(workdir, f"weights-{name}")
            job = {**base, "row": name, "phase": "quality", "data": d["path"], "window": d["window"],
                   "save": save}
            res = _run_job(job, workdir, timeout, env_of(name))
            if "error" not in res:
                try:
                    res["eval"] = _evaluate(save, prep, cfg)
                except Exception as e:  # noqa: BLE001 - recorded in the results
                    res["error"] = f"evaluation failed: {type(e).__name__}: {e}"
            if "error" in res:
                log(f"{name} (quality) failed: {res['error'].strip().splitlines()[-1]}")
            raw.append(res)
            bar.update(1)
    except KeyboardInterrupt:  # Ctrl-C, or `timeout -s INT`: keep the rows that finished
        if not raw:
            raise BenchInterrupted(written=False) from None
        log(f"interrupted: writing the {len(raw)} runs that finished")
        interrupted = True
    else:
        interrupted = False
    finally:
        bar.close()
    results = summarize(raw, cfg, prep)
    if gpu:
        results["machine"].update(gpu)
    results["wall_seconds"] = time.time() - t_start
    results["interrupted"] = interrupted
    _write_results(results, out)
    if interrupted:
        raise BenchInterrupted(written=True)
    return results


class BenchInterrupted(KeyboardInterrupt):
    """:func:`run` was interrupted; ``written``: the runs that finished were written."""

    def __init__(self, written: bool):
        super().__init__("interrupted")
        self.written = written


def summarize(raw: list[dict], cfg: BenchConfig, prep: dict | None = None) -> dict:
    """Aggregates per-process results into one row each, the speed-ups and the goals."""
    speed: dict[str, dict] = {}
    for r in raw:
        if r.get("phase") != "speed":
            continue
        s = speed.setdefault(r["row"], {"step_times": [], "train_peak_rss": 0, "errors": [],
                                        "processes": 0, "setup_s": [], "compile_s": []})
        if "error" in r:
            s["errors"].append(r["error"])
            continue
        s["processes"] += 1
        s["step_times"] += r["step_times"]
        s["train_peak_rss"] = max(s["train_peak_rss"], r["train_peak_rss"])
        if r.get("device_peak_bytes") is not None:
            s["device_peak_bytes"] = max(s.get("device_peak_bytes", 0), r["device_peak_bytes"])
        s["setup_s"].append(r["setup_s"])
        if r.get("compile_s") is not None:
            s["compile_s"].append(r["compile_s"])
        s["trainable_params"] = r.get("trainable_params")
        s["first_loss"] = r["losses"][0] if r["losses"] else None
        if r.get("step_flops"):
            s["step_flops"] = r["step_flops"]
        if r.get("weights_bytes") is not None:
            s["weights_bytes"] = r["weights_bytes"]
        for key in ("torch_mkl", "mkl_vendor_shim"):  # PyTorch rows: how their matmuls ran
            if key in r:
                s[key] = bool(s.get(key, True) and r[key])
    tokens = cfg.batch * cfg.seq
    for name, s in speed.items():
        s["step_s"] = median(s["step_times"])
        s["tokens_per_s"] = tokens / s["step_s"] if s["step_times"] else None  # None: no step ran
        if s.get("step_flops") and s["step_times"]:
            s["gflop_per_s"] = s["step_flops"] / 1e9 / s["step_s"]
    ref = speed.get("torch-full", {}).get("step_s") if speed.get("torch-full", {}).get("step_times") else None
    for s in speed.values():
        s["speedup_vs_torch_full"] = (ref / s["step_s"]) if ref and s["step_times"] else None
    quality = {}
    for r in raw:
        if r.get("phase") != "quality":
            continue
        q = {"steps": len(r.get("losses", [])), "error": r.get("error")}
        if "eval" in r:
            q.update(accuracy=r["eval"]["accuracy"], correct=r["eval"]["correct"],
                     total=r["eval"]["total"], predictions=r["eval"]["predictions"])
        if r.get("losses"):
            q.update(first_loss=r["losses"][0], final_loss=r["losses"][-1],
                     train_step_s=median(r["step_times"][1:] or r["step_times"]))
        quality[r["row"]] = q
    goals = []
    mem_key = _memory_key(cfg.device)
    for row, base, what, target in GOALS:
        g = {"row": row, "baseline": base, "what": what, "target": target, "value": None, "met": None}
        if what == "speed" and row in speed and base in speed and speed[row]["step_times"] \
                and speed[base]["step_times"]:
            g["value"] = speed[base]["step_s"] / speed[row]["step_s"]
            g["met"] = g["value"] >= target
            if speed[row].get("step_flops") and speed[base].get("step_flops"):
                # value = (the baseline's FLOPs / the row's) x (the row's FLOP rate / the baseline's)
                g["flop_ratio"] = speed[base]["step_flops"] / speed[row]["step_flops"]
                g["rate_ratio"] = speed[row]["gflop_per_s"] / speed[base]["gflop_per_s"]
        elif what == "memory" and speed.get(row, {}).get(mem_key) and speed.get(base, {}).get(mem_key):
            g["value"] = speed[row][mem_key] / speed[base][mem_key]
            g["met"] = g["value"] <= target
        elif what == "accuracy" and quality.get(row, {}).get("accuracy") is not None \
                and quality.get(base, {}).get("accuracy") is not None:
            g["value"] = 100 * (quality[base]["accuracy"] - quality[row]["accuracy"])
            g["met"] = g["value"] <= target
        goals.append(g)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "versions": versions(), "config": cfg.to_dict(), "speed": speed, "quality": quality,
           "goals": goals, "raw": raw}
    if prep is not None:
        out["paper_scheme"] = prep["paper_name"]
        out["answer_window"] = {p: d["window"] for p, d in prep["data"].items()}
        if "quality" in prep["data"]:
            q = prep["data"]["quality"]
            out["quality_shape"] = {"batch": q["batch"], "seq": q["seq"]}
    return out


def _device(config: dict) -> str:
    """The device of a results file's ``config`` (runs from before ``--device`` ran on the CPU)."""
    return config.get("device", "cpu")


def _memory_key(device: str) -> str:
    """The speed-row field holding a row's peak memory: host RSS, or GPU memory on ``gpu``."""
    return "device_peak_bytes" if device == "gpu" else "train_peak_rss"


def merge(paths: Sequence[str], out: str) -> dict:
    """Combines the speed phase of one run with the quality phase of another
    (``results.json`` files of the same model, seed and data settings) into
    ``out/results.{json,md,png}``: the two phases need not share a sitting.

    Raises:
      BenchError: the runs differ in model, seed, or the setting of a phase both ran.
      FileMissingError, ResultsFileError: a path that is not a ``results.json``.
    """
    runs = [read_results(p) for p in paths]
    if not runs:
        raise BenchError("nothing to merge")
    first = {**runs[0]["config"], "device": _device(runs[0]["config"])}
    for r in runs[1:]:
        c = {**r["config"], "device": _device(r["config"])}
        # The learning rates only shape the quality phase: they come from the quality run.
        for key in ("model", "device", "seed", "lora_rank", "blocks"):
            if c.get(key) != first.get(key):
                raise BenchError(f"cannot merge runs with different {key}: {first.get(key)!r} vs {c.get(key)!r}")
    speed_runs = [r for r in runs if r["speed"]]
    quality_runs = [r for r in runs if r["quality"]]
    if len(speed_runs) > 1 or len(quality_runs) > 1:
        raise BenchError("give at most one run with a speed phase and one with a quality phase")
    base = speed_runs[0] if speed_runs else runs[0]
    cfg = BenchConfig.from_dict(base["config"])
    if quality_runs:
        q = quality_runs[0]["config"]
        try:
            cfg.quality_steps, cfg.quality_batch, cfg.quality_seq, cfg.eval_examples = (
                q["quality_steps"], q["quality_batch"], q["quality_seq"], q["eval_examples"])
            cfg.lr, cfg.lora_lr = q["lr"], q["lora_lr"]
        except KeyError as e:
            path = paths[runs.index(quality_runs[0])]
            raise ResultsFileError(f"{path}: its 'config' lacks {e.args[0]!r}; not a results.json of"
                                   " pockjax bench") from None
        cfg.sparse_lr = q.get("sparse_lr", q["lr"])  # runs before sparse_lr trained sparse rows at lr
    raw = [x for r in runs for x in r["raw"]
           if (x.get("phase") == "speed" and r in speed_runs) or (x.get("phase") == "quality" and r in quality_runs)]
    results = summarize(raw, cfg)
    results["date"] = base["date"]
    results["machine"], results["versions"] = base.get("machine", {}), base.get("versions", {})  # where it ran
    results["merged_from"] = [{"path": p, "date": r["date"]} for p, r in zip(paths, runs)]
    for key in ("paper_scheme", "answer_window", "quality_shape"):
        for r in runs:
            if key in r:
                if isinstance(r[key], dict) and isinstance(results.get(key), dict):
                    results[key].update(r[key])
                else:
                    results.setdefault(key, r[key])
    os.makedirs(out, exist_ok=True)
    remove_stale_temporaries(out)
    _write_results(results, out)
    return results


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def markdown_table(results: dict) -> str:
    """The results as a markdown table (speed, memory, accuracy) with the machine and goals."""
    cfg = results["config"]
    m = results["machine"]
    v = results["versions"]
    device = _device(cfg)
    gpu = device == "gpu"
    where = (f"{m.get('gpu', 'GPU')} ({_gib(m.get('gpu_memory_bytes', 0))} GiB usable), host {m['cpu']}"
             if gpu else cpu_words(m))
    names = list(dict.fromkeys(list(results["speed"]) + list(results["quality"])))
    names.sort(key=lambda n: list(ROWS).index(n) if n in ROWS else 99)
    precision = ("fine-tuning step (fp32 unless the row says otherwise)"
                 if any(n in PRECISION_ROWS for n in names) else "fp32 fine-tuning step")
    lines = [f"SmolLM2-135M-Instruct {precision}, batch {cfg['batch']} x {cfg['seq']} tokens"
             if cfg["model"] == "smollm2-135m" else
             f"{cfg['model']} (random weights) {precision}, batch {cfg['batch']} x {cfg['seq']} tokens",
             f"({results['date']}; {where}; "
             + ", ".join(f"{k} {v[k]}" for k in ("jax", "flax", "optax", "torch", "transformers", "peft",
                                                 "iree-base-compiler") if k in v) + ")", ""]
    q_steps = cfg.get("quality_steps") or 0
    qs = results.get("quality_shape") or {}
    acc_head = (f"exact match after {q_steps} steps" if q_steps else "exact match")
    mem_head = "peak GPU memory (GiB)" if gpu else "peak RSS (GiB)"
    mem_key = _memory_key(device)
    lines.append(f"| row | what | step (s) | tokens/s | vs PyTorch full | matmul GFLOP/step | GFLOP/s"
                 f" | {mem_head} | trainable | {acc_head} |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        s = results["speed"].get(name)
        q = results["quality"].get(name, {})
        if s and s["step_times"]:
            step = f"{s['step_s']:.2f}"
            tps = f"{s['tokens_per_s']:.0f}"
            sp = f"{s['speedup_vs_torch_full']:.2f}x" if s.get("speedup_vs_torch_full") else ""
            rss = _gib(s[mem_key]) if s.get(mem_key) is not None else ""
            tr = f"{s['trainable_params'] / 1e6:.2f}M" if s.get("trainable_params") is not None else ""
            gf = f"{s['step_flops'] / 1e9:.1f}" if s.get("step_flops") else ""
            rate = f"{s['gflop_per_s']:.0f}" if s.get("gflop_per_s") else ""
        else:
            step = tps = sp = rss = tr = gf = rate = "failed" if s else ""
        acc = f"{100 * q['accuracy']:.1f}%" if q.get("accuracy") is not None else ("failed" if q.get("error") else "")
        desc = ROWS[name].description if name in ROWS else ""
        lines.append(f"| {name} | {desc} | {step} | {tps} | {sp} | {gf} | {rate} | {rss} | {tr} | {acc} |")
    lines.append("")
    if any(s.get("step_flops") for s in results["speed"].values()):
        lines.append("Matmul GFLOP/step: the matrix products of one step, forward and backward, as"
                     " executed (PyTorch's FlopCounterMode for the PyTorch rows; pockjax.count_flops"
                     "(matmul_only=True) of the traced step for plain JAX, of the compiled step for"
                     " pockjax); GFLOP/s: those over the median step time. A speed-up over a baseline is"
                     " its FLOPs over the row's times the row's GFLOP/s over the baseline's.")
    from pockjax.memory import format_bytes

    held = [(n, results["speed"][n]["weights_bytes"]) for n in names
            if results["speed"].get(n, {}).get("weights_bytes")]
    if any(n in PRECISION_ROWS for n, _ in held):
        lines.append("Parameters each pockjax step holds (frozen ones in the row's precision): "
                     + ", ".join(f"{n} {format_bytes(b)}" for n, b in held) + ".")
    mkl_note = torch_mkl_note(results)
    if mkl_note:
        lines.append(mkl_note)
    if q_steps:
        lines.append(f"Quality: {q_steps} AdamW steps of {qs.get('batch')} x {qs.get('seq')} tokens on"
                     f" reverse-words, exact match on {cfg['eval_examples']} held-out examples"
                     f" (same batches and evaluator for every row); AdamW learning rate {cfg['lr']:g} for"
                     f" full fine-tuning, {cfg.get('sparse_lr', cfg['lr']):g} for the sparse rows,"
                     f" {cfg['lora_lr']:g} for LoRA.")
    if results.get("interrupted"):
        lines.append("INTERRUPTED: this run was cut short; the rows above are the runs that finished.")
    lines.append("Goals:")
    for g in results["goals"]:
        if g["value"] is None:
            state = "not measured"
        elif g["what"] == "speed":
            state = f"{g['value']:.2f}x (goal >= {g['target']}x) {'met' if g['met'] else 'NOT met'}"
            if g.get("flop_ratio"):
                state += (f"; {g['flop_ratio']:.2f}x fewer matmul FLOPs, run at {g['rate_ratio']:.2f}x"
                          f" the baseline's GFLOP/s")
        elif g["what"] == "memory":
            state = f"{g['value']:.2f} of it (goal <= {g['target']}) {'met' if g['met'] else 'NOT met'}"
        else:
            gap = (f"{g['value']:.1f} points below" if g["value"] > 0 else
                   f"{-g['value']:.1f} points above" if g["value"] < 0 else "level")
            state = f"{gap} (goal: at most {g['target']} below) {'met' if g['met'] else 'NOT met'}"
        lines.append(f"- {g['row']} vs {g['baseline']}, {g['what']}: {state}")
    return "\n".join(lines) + "\n"


def torch_mkl_note(results: dict) -> str:
    """How the PyTorch rows' CPU matmuls ran, where that matters: on a non-Intel
    x86 CPU with Intel MKL (see :mod:`benchmarks.harness.mkl`); ``""`` elsewhere.

    Example:
      >>> r = {"config": {}, "machine": {"vendor": "amd"},
      ...      "speed": {"torch-full": {"torch_mkl": True, "mkl_vendor_shim": False}}}
      >>> torch_mkl_note(r).split(":")[0]
      "PyTorch's matmuls"
      >>> r["machine"]["vendor"] = "intel"
      >>> torch_mkl_note(r)
      ''
    """
    rows = [s for n, s in results["speed"].items() if s.get("torch_mkl")]
    if not rows or _device(results["config"]) != "cpu" or results["machine"].get("vendor") in (None, "intel"):
        return ""
    if all(s.get("mkl_vendor_shim") for s in rows):
        return ("PyTorch's matmuls: Intel MKL, run with its CPU-vendor check answered 'Intel'"
                " (--torch-mkl-any-cpu), so that it picks its kernels by instruction set on this"
                " non-Intel CPU.")
    return ("PyTorch's matmuls: Intel MKL, which takes its generic kernels on a non-Intel CPU such"
            " as this one (benchmarks.harness.mkl); --torch-mkl-any-cpu runs the PyTorch rows on its"
            " instruction-set kernels instead.")


def plot_results(results: dict, path: str) -> str | None:
    """Bar chart of tokens/s, matmul FLOPs per step (when counted) and peak memory
    per row (PNG); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [n for n, s in results["speed"].items() if s["step_times"]]
    names.sort(key=lambda n: list(ROWS).index(n) if n in ROWS else 99)
    if not names:
        return None
    colors = {"torch": "#ee6633", "jax": "#8899aa", "pockjax": "#3377cc"}
    col = [colors.get(ROWS[n].framework, "#999999") if n in ROWS else "#999999" for n in names]
    device = _device(results["config"])
    gpu = device == "gpu"
    mem_key = _memory_key(device)
    tps = [results["speed"][n]["tokens_per_s"] for n in names]
    rss = [results["speed"][n].get(mem_key, 0) / 2**30 for n in names]
    mem_title = "peak GPU memory, GiB (lower is better)" if gpu else "peak RSS while training, GiB (lower is better)"
    panels = [(tps, "tokens / s (higher is better)", "{:.0f}")]
    if any(results["speed"][n].get("step_flops") for n in names):
        flops = [results["speed"][n].get("step_flops", 0) / 1e9 for n in names]
        panels.append((flops, "matmul GFLOP per step (the work each row does)", "{:.0f}"))
    panels.append((rss, mem_title, "{:.2f}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 0.45 * len(names) + 1.6))
    for ax, (vals, title, fmt) in zip(axes, panels):
        y = np.arange(len(names))
        ax.barh(y, vals, color=col)
        ax.set_yticks(y)
        ax.set_yticklabels(names)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        for yi, val in zip(y, vals):
            ax.text(val, yi, " " + fmt.format(val), va="center", fontsize=8)
        ax.margins(x=0.15)
    cfg = results["config"]
    m = results["machine"]
    where = m.get("gpu", "GPU") if gpu else cpu_words(m)
    fig.suptitle(f"{cfg['model']} fp32, batch {cfg['batch']} x {cfg['seq']}; {where}; {results['date']}",
                 fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def _write_results(results: dict, out: str) -> None:
    write_json(os.path.join(out, "results.json"), results, indent=1, ensure_ascii=True, default=str)
    write_text(os.path.join(out, "results.md"), markdown_table(results))
    plot_results(results, os.path.join(out, "results.png"))

"""Peak RSS of SmolLM2-135M fine-tuning: pockjax (each memory pass) vs PyTorch.

Every configuration runs in its own fresh process (``_memory_rss.peak_rss``),
one after the other, in the same run:

* pockjax, Flax LLaMA + AdamW (fp32), full fine-tuning and the sparse ``paper``
  scheme of :mod:`pockjax.schemes`, the one ``pockjax finetune`` trains (attention
  q/k/v/o + mlp.w1/w3 of the last 10 of 30 blocks), each with the
  default passes, ``+ inplace_update`` and ``+ inplace_update + reorder_for_memory``.
  The step is compiled from abstract shapes first, then the pretrained weights are
  loaded and ``--steps`` steps run.
* PyTorch: transformers ``LlamaForCausalLM`` from the same GGUF file and
  ``torch.optim.AdamW`` (fp32), the same batch shape and cross-entropy loss.

Each process reports its whole peak RSS (loading included) and the peak of its
training phase alone (``VmHWM`` reset after loading with ``/proc/self/clear_refs``).
pockjax rows also give the planner's peak and XLA's ``memory_analysis()``.

    python benchmarks/memory_rss_vs_torch.py [--batch 4] [--seq 128] [--steps 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import memory_rss_workers as W  # noqa: E402

from _memory_rss import peak_rss  # noqa: E402

from pockjax.memory import format_bytes  # noqa: E402

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "memory.md")
BEGIN, END = "<!-- rss-vs-torch:begin -->", "<!-- rss-vs-torch:end -->"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--remat-budget", type=float, default=2e9, help="FLOPs for reorder_for_memory's recomputation")
    ap.add_argument("--only", default="", help="comma-separated subset of: full,paper,torch,baselines")
    ap.add_argument("--pipelines", default="default,inplace,memory")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--write-docs", action="store_true", help="replace the table in docs/memory.md")
    a = ap.parse_args(argv)
    only = set(filter(None, a.only.split(","))) or {"full", "paper", "torch", "baselines"}
    pipelines = [p for p in a.pipelines.split(",") if p]
    rows, results = [], {}
    t_start = time.perf_counter()

    def record(name, r, extra):
        res = r.result or {}
        whole = max(r.peak_bytes, res.get("setup_peak", 0))
        train = res.get("train_peak", r.peak_bytes)
        results[name] = (whole, train, res)
        losses = res.get("losses") or []
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"
        rows.append((name, *extra, _gib(whole), _gib(train), loss, f"{res.get('step_s', float('nan')):.1f}"))
        print(f"  {name}: peak RSS {format_bytes(whole)} (setup {format_bytes(res.get('setup_peak', 0))}, RSS before "
              f"training {format_bytes(res.get('rss_before_train', 0))}, training phase {format_bytes(train)}), "
              f"loss {loss}, load {res.get('load_s', 0):.0f} s", flush=True)

    print(f"SmolLM2-135M, AdamW fp32, batch {a.batch}, seq {a.seq}, {a.steps} steps; one fresh process each", flush=True)
    if "baselines" in only:
        bj = peak_rss(W.jax_baseline, timeout=600)
        bt = peak_rss(W.torch_baseline, timeout=600)
        print(f"  baselines: import jax + one jit {format_bytes(bj.peak_bytes)}; import torch + transformers "
              f"{format_bytes(bt.peak_bytes)}", flush=True)
        results["baseline jax"] = (bj.peak_bytes, bj.peak_bytes, {})
        results["baseline torch"] = (bt.peak_bytes, bt.peak_bytes, {})
    for scheme in ("full", "paper"):
        if scheme not in only:
            continue
        for pipe in pipelines:
            name = f"pockjax {scheme}, {pipe}"
            r = peak_rss(
                W.pockjax_train,
                kwargs=dict(scheme=scheme, pipeline=pipe, batch=a.batch, seq=a.seq, steps=a.steps,
                            remat_budget=a.remat_budget),
                timeout=a.timeout,
            )
            res = r.result
            extra = (
                _gib(res["planner_before"]), _gib(res["planner"]), _gib(res["xla"]["temp_size_in_bytes"]),
                _gib(res["xla"]["total"]), f"{res['planner'] / res['xla']['total']:.3f}",
                f"{res['hlo'].get('before_backward_end', '?')}/{res['hlo'].get('n_params', '?')}",
            )
            record(name, r, extra)
    if "torch" in only:
        r = peak_rss(W.torch_train, kwargs=dict(batch=a.batch, seq=a.seq, steps=a.steps), timeout=a.timeout)
        record("PyTorch full (transformers + AdamW)", r, ("-",) * 6)

    head = ("run", "planner as traced (GiB)", "planner compiled (GiB)", "XLA temp (GiB)", "XLA total (GiB)",
            "planner / XLA", "updates in backward (HLO)", "peak RSS (GiB)", "training-phase peak RSS (GiB)",
            "loss", "s/step")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    goals = []
    torch_name = "PyTorch full (transformers + AdamW)"
    if torch_name in results:
        tw, tt, _ = results[torch_name]
        for name, (w, t, _) in results.items():
            if name.startswith("pockjax full, default"):
                goals.append(f"- pockjax full (default pipeline) {_gib(w)} GiB vs PyTorch full {_gib(tw)} GiB: "
                             f"{'met' if w <= tw else 'NOT met'} (goal: at or below)")
            if name.startswith("pockjax paper, default"):
                goals.append(f"- pockjax sparse `paper` (default pipeline) {_gib(w)} GiB vs half of PyTorch full "
                             f"{_gib(tw / 2)} GiB: {'met' if w <= tw / 2 else 'NOT met'} (goal: at most half)")
    if "baseline jax" in results:
        goals.append(f"- process floors: import jax + one jit {_gib(results['baseline jax'][0])} GiB; "
                     f"import torch + transformers {_gib(results['baseline torch'][0])} GiB")
    table = "\n".join(lines + [""] + goals)
    print()
    print(table)
    print(f"\n({time.perf_counter() - t_start:.0f} s)")
    if a.write_docs:
        with open(DOC, encoding="utf-8") as f:
            text = f.read()
        block = (f"{BEGIN}\nSmolLM2-135M (pretrained GGUF), AdamW fp32, batch {a.batch}, seq {a.seq}, "
                 f"{a.steps} steps, `python benchmarks/memory_rss_vs_torch.py --batch {a.batch} --seq {a.seq} "
                 f"--steps {a.steps}`:\n\n{table}\n{END}")
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda m: block, text, flags=re.S)
        else:
            text += "\n" + block + "\n"
        from pockjax.io.atomic import write_text

        write_text(DOC, text)
        print(f"wrote the table into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

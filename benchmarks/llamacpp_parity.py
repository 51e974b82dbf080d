"""Do a fine-tune's answers survive the trip to llama.cpp? Held-out exact match of the exported GGUF.

Exports a ``pockjax finetune`` output directory with ``pockjax export-model``
(GGUF, each ``--quant``), runs llama.cpp (``llama-cpp-python``, greedy, the
same chat-template prompts and token budget as ``pockjax finetune``'s
evaluation) on the run's own held-out examples, and prints its exact match
next to pockjax's (the run's ``metrics.json``, and pockjax generating from the
same GGUF file).

Usage (needs ``make test-llamacpp``'s llama-cpp-python)::

    pockjax finetune --out runs/finetune
    python -m benchmarks.llamacpp_parity --run runs/finetune --quants f16,q8_0
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def llamacpp_answers(path: str, tokenizer, examples, max_new: int) -> list[str]:
    """Greedy llama.cpp answers to ``examples`` (prompts tokenized by pockjax's tokenizer, as pockjax's eval)."""
    import llama_cpp

    from pockjax.data.batching import end_of_turn_id

    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=os.cpu_count(), verbose=False, seed=0)
    eos = {tokenizer.eos_id, llm.token_eos(), end_of_turn_id(tokenizer)}  # Gemma's turns end <end_of_turn>
    answers = []
    for ex in examples:
        ids = tokenizer.apply_chat_template(ex.messages())
        out = []
        for tid in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if tid in eos or len(out) >= max_new:
                break
            out.append(tid)
        answers.append(tokenizer.decode(out, skip_special_tokens=True))
    return answers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a pockjax finetune output directory")
    p.add_argument("--quants", default="f16,q8_0")
    args = p.parse_args(argv)

    from pockjax.data import evaluate, evaluate_model
    from pockjax.io.jsonfile import read_json_object
    from pockjax.models import llama
    from pockjax.models.llama.export import export_model
    from pockjax.train.finetune import FinetuneConfig, _examples

    run = read_json_object(os.path.join(args.run, "run.json"), what="run")
    metrics = read_json_object(os.path.join(args.run, "metrics.json"), what="metrics")
    cfg = FinetuneConfig.from_dict(run["config"])
    _, held, name = _examples(cfg)
    tokenizer = llama.load_tokenizer(args.run)
    answers = [len(tokenizer.encode(ex.answer, add_bos=False)) for ex in held]
    max_new = cfg.eval_max_new_tokens or (max(answers, default=0) + 8)
    own = metrics["accuracy_after"]
    print(f"run {args.run}: {name}, scheme {metrics.get('scheme')}, {len(held)} held-out examples;"
          f" pockjax's own exact match {100 * own:.1f}%")
    print("| model | runtime | exact match | vs pockjax's own (points) |")
    print("|---|---|---:|---:|")
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for q in args.quants.split(","):
            path = os.path.join(d, f"model.{q}.gguf")
            export_model(args.run, path, format="gguf", quant=q)
            t = time.time()
            got = evaluate(llamacpp_answers(path, tokenizer, held, max_new), held, cfg.task if not cfg.data else None)
            results[q] = got["accuracy"]
            print(f"| GGUF {q} ({os.path.getsize(path) / 1e6:.0f} MB) | llama.cpp (llama-cpp-python), greedy"
                  f" ({time.time() - t:.0f} s) | {100 * got['accuracy']:.1f}% |"
                  f" {100 * (got['accuracy'] - own):+.1f} |", flush=True)
            model, _ = llama.load_pretrained(path)
            mine = evaluate_model(model, tokenizer, held, task=cfg.task if not cfg.data else None,
                                  max_new_tokens=max_new)
            print(f"| GGUF {q} | pockjax (load_gguf), greedy | {100 * mine['accuracy']:.1f}% |"
                  f" {100 * (mine['accuracy'] - own):+.1f} |", flush=True)
    worst = min(results.values()) - own
    print(f"goal: llama.cpp within 5 points of pockjax's own exact match: worst {100 * worst:+.1f} points,"
          f" {'met' if worst >= -0.05 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

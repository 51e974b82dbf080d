"""``pockjax finetune`` and ``pockjax generate`` (registered by :mod:`pockjax.cli`)."""

from __future__ import annotations

import argparse
import sys

from pockjax._cli_args import (StoreGiven, float_in, given_options, non_negative_finite_float,
                               non_negative_int, positive_finite_float, positive_int, probability)
from pockjax.models.llama.mixed import DTYPES, QUANTIZE
from pockjax.train.finetune import DEFAULT_LR, SCHEDULES, FinetuneConfig
from pockjax.train.schemes import SCHEMES
from pockjax.schemes import ignores_blocks

_D = FinetuneConfig()
_IMAGE_SIZE, _PER_CLASS = 64, 400  # the classifiers' defaults (ClassifierConfig)


def _error(command: str, e: BaseException) -> int:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    print(f"pockjax {command}: error: {msg}", file=sys.stderr)
    return 2


def _bad_input():
    from pockjax.errors import PockjaxError

    return (PockjaxError, FileNotFoundError, KeyError, ValueError, OSError)


def run_classifier(args: argparse.Namespace) -> int:
    """``pockjax finetune --model mobilenetv2|all-minilm-l6-v2``: a classifier on a shipped task."""
    from pockjax.schemes import ignores_fraction
    from pockjax.train.classify import CLASSIFIERS, ClassifierConfig, finetune_classifier

    given = given_options(args)
    if args.resume or args.data or "seq_len" in given and args.model == "mobilenetv2":
        what = "--resume" if args.resume else "--data" if args.data else "--seq-len"
        return _error("finetune", ValueError(f"{what} is not available for --model {args.model}"
                                             " (classifiers train on a built-in --task)"))
    # an option that would have no effect, recorded in run.json as if it had, is refused
    if "image_size" in given and args.model != "mobilenetv2":
        return _error("finetune", ValueError(f"--image-size is for --model mobilenetv2, not {args.model}"))
    if "fraction" in given and ignores_fraction(args.scheme, CLASSIFIERS[args.model].scheme_family()):
        return _error("finetune", ValueError(f"--fraction is the 'channels' scheme's; --scheme {args.scheme}"
                                             " does not take it"))
    if args.fail_below and "eval_examples" in given and args.eval_examples == 0:  # (the gate passed, unread)
        return _error("finetune", ValueError("--fail-below gates on the held-out accuracy: --eval-examples is 0"))
    fields = {k: getattr(args, k) for k in ("model", "scheme", "blocks", "seed", "out")}
    # options left at the LLaMA run's defaults take the classifier's own
    for name in ("task", "optimizer", "lr", "steps", "batch_size", "eval_examples", "seq_len"):
        if name in given and getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    fields.update(image_size=args.image_size, fraction=args.fraction,
                  train_per_class=args.train_per_class or None, progress=not args.no_progress)
    try:
        metrics = finetune_classifier(ClassifierConfig(**fields))
    except _bad_input() as e:
        return _error("finetune", e)
    except KeyboardInterrupt:
        print("pockjax finetune: interrupted; nothing was saved", file=sys.stderr)
        return 130
    after = metrics.get("accuracy_after")
    return 0 if after is None or not args.fail_below or after >= args.fail_below else 1


def run_finetune(args: argparse.Namespace) -> int:
    import pockjax
    from pockjax.train.classify import CLASSIFIERS
    from pockjax.train.finetune import finetune

    if args.devices is not None and args.mesh:
        return _error("finetune", ValueError("give --devices N or --mesh AXIS=N,..., not both"))
    mesh = args.mesh or (f"data={args.devices}" if args.devices is not None else "")
    if mesh:
        from pockjax.sharding import request_host_devices

        request_host_devices(mesh)
    # Before JAX's first computation: each step reuses its working memory.
    pockjax.keep_step_memory(quiet=True)
    given = given_options(args)
    if "train_replies" in given and not args.data and not args.resume:
        return _error("finetune", ValueError("--train-replies chooses what is trained of the chat records of --data;"
                                             " a built-in task has none (give --data, or leave it out)"))
    if args.out == "":  # (a classifier run once trained, saved nothing and exited 0)
        return _error("finetune", ValueError("--out is empty: give the directory the run goes to"))
    if args.model in CLASSIFIERS:
        if mesh:
            return _error("finetune", ValueError("--mesh and --devices train the LLaMA models; the classifiers"
                                                 " train on one device"))
        if args.dtype != _D.dtype or args.quantize != _D.quantize:
            return _error("finetune", ValueError("--dtype and --quantize are for the LLaMA models; the"
                                                 " classifiers train in float32"))
        if args.grad_accum != _D.grad_accum or args.max_seq_len is not None:
            return _error("finetune", ValueError("--grad-accum and --max-seq-len are for the LLaMA models; the"
                                                 " classifiers train on fixed-shape batches of --batch-size"))
        llama_only = [f"--{name.replace('_', '-')}" for name in ("schedule", "warmup", "grad_clip", "eval_every",
                                                                 "save_every", "show") if name in given]
        if llama_only:
            return _error("finetune", ValueError(f"{', '.join(llama_only)} {'is' if len(llama_only) == 1 else 'are'}"
                                                 f" for the LLaMA models; the classifiers train at a constant"
                                                 f" learning rate, without clipping, and write --out at the end"
                                                 f" (leave {'it' if len(llama_only) == 1 else 'them'} out)"))
        return run_classifier(args)
    # (by what was given: --fraction 0.5, the default's value, was once taken and ignored)
    if {"image_size", "train_per_class", "fraction"} & given:
        return _error("finetune", ValueError("--image-size, --train-per-class and --fraction are for the"
                                             " classifiers (--model mobilenetv2 or all-minilm-l6-v2)"))
    from pockjax.data import TASKS

    if args.task not in TASKS:
        return _error("finetune", ValueError(f"--task {args.task!r} is not a LLaMA task; use one of"
                                             f" {', '.join(sorted(TASKS))} (the vision and text tasks"
                                             " are for --model mobilenetv2 / all-minilm-l6-v2)"))

    if args.fail_below and args.eval_examples == 0:
        return _error("finetune", ValueError("--fail-below gates on the held-out accuracy: --eval-examples is 0"))
    if "show" in given and args.show and args.eval_examples == 0:
        return _error("finetune", ValueError("--show prints held-out answers: --eval-examples is 0"))
    if "save_every" in given and args.save_every and not args.out and not args.resume:
        return _error("finetune", ValueError("--save-every saves to --out: give --out"))
    if "task" in given and args.data:  # the run would record a task it did not train on
        return _error("finetune", ValueError(f"--task {args.task} and --data {args.data}: the data file replaces"
                                             " the task; give one of them"))
    if "blocks" in given and ignores_blocks(args.scheme):
        return _error("finetune", ValueError(f"--blocks sets how many of the last blocks the paper and channels"
                                             f" schemes train; --scheme {args.scheme} does not use it (leave it out)"))
    fields = {k: getattr(args, k) for k in (
        "model", "task", "data", "scheme", "blocks", "optimizer", "lr", "steps", "batch_size",
        "seq_len", "seed", "eval_examples", "save_every", "out", "resume", "show", "dtype", "quantize",
        "schedule", "warmup", "grad_clip", "eval_every", "grad_accum", "max_seq_len", "train_replies")}
    fields["mesh"] = mesh
    if {"mesh", "devices"} & given:  # --devices N is --mesh data=N: either one replaces the run's mesh
        given.add("mesh")
    if fields["steps"] is None:  # with --resume: the run's own
        fields["steps"] = _D.steps
    fields["progress"] = not args.no_progress
    given.add("progress")
    try:
        result = finetune(FinetuneConfig(**fields), given=given)
    except _bad_input() as e:
        return _error("finetune", e)
    except KeyboardInterrupt:
        hint = (f"; continue from the last checkpoint with: pockjax finetune --out {args.out}"
                f" --resume" if args.out else "")
        print(f"pockjax finetune: interrupted{hint}", file=sys.stderr)
        return 130
    after = result.metrics.get("accuracy_after")
    return 0 if after is None or not args.fail_below or after >= args.fail_below else 1


def run_generate(args: argparse.Namespace) -> int:
    from pockjax.models import llama

    given = given_options(args)
    if args.temperature == 0 and given & {"top_p", "seed"}:
        flags = " and ".join("--" + k.replace("_", "-") for k in sorted(given & {"top_p", "seed"}))
        verb = "shapes" if " and " not in flags else "shape"
        return _error("generate", ValueError(f"{flags} {verb} sampling: give --temperature above 0 with it"
                                             " (0, the default, is greedy)"))
    if any(not p.strip() for p in args.prompt):
        return _error("generate", ValueError("--prompt is empty: give the user message to answer"))

    try:
        from pockjax.models.llama.generate import check_finite_weights

        model, tok = llama.load_pretrained(args.model)
        check_finite_weights(model, args.model)
        answers = llama.generate_text(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, top_p=args.top_p,
                                      seed=args.seed)
    except _bad_input() as e:
        return _error("generate", e)
    for prompt, answer in zip(args.prompt, answers):
        if len(args.prompt) > 1:
            print(f">>> {prompt}")
        print(answer.strip())
    return 0


def register(subparsers) -> None:
    """Adds ``finetune`` and ``generate`` to the ``pockjax`` command."""
    from pockjax.data import TASKS
    from pockjax.data.batching import REPLIES
    from pockjax.data.text_classification import TEXT_TASKS
    from pockjax.data.vision import VISION_TASKS
    from pockjax.train.classify import CLASSIFIERS

    p = subparsers.add_parser(
        "finetune", help="sparse fine-tuning of a LLaMA model, MobileNetV2 or a BERT encoder",
        description="Fine-tune a pretrained model with a sparse update scheme (default: SmolLM2-135M"
                    " learns to reverse the words of a sentence with the PockEngine 'paper'"
                    " scheme, about 3 minutes on a 2-core CPU). --model mobilenetv2 fine-tunes"
                    " ImageNet MobileNetV2 on a vision task (mnist5k), --model all-minilm-l6-v2"
                    " a BERT encoder on a text task (tweet_polarity, tweet_sentiment).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # StoreGiven: --resume tells the options given from those left at their
    # defaults; a given one that decides the result must equal the run's own.
    p.add_argument("--model", default=_D.model, action=StoreGiven,
                   help="smollm2-135m, gemma3-270m, a .gguf file, or a Hugging Face LLaMA / Qwen2 /"
                        " Gemma 3 directory; or a"
                        " classifier: " + ", ".join(CLASSIFIERS))
    p.add_argument("--task", default=_D.task, action=StoreGiven,
                   choices=sorted(TASKS) + sorted(VISION_TASKS) + sorted(TEXT_TASKS),
                   help="built-in task (LLaMA: " + ", ".join(sorted(TASKS)) + "; vision: "
                        + ", ".join(sorted(VISION_TASKS)) + "; text: " + ", ".join(sorted(TEXT_TASKS))
                        + "; a classifier's default: " + ", ".join(
                            f"{s.name} {s.default_task}" for s in CLASSIFIERS.values()) + ")")
    p.add_argument("--data", default=None, metavar="FILE.jsonl", action=StoreGiven,
                   help="JSONL of Alpaca records (instruction, input, output) or chat records ({\"messages\": [...]},"
                        " every assistant reply trained on, the last held out; see --train-replies) instead of --task")
    p.add_argument("--train-replies", default=_D.train_replies, choices=REPLIES, action=StoreGiven,
                   help="what is trained of a chat record: every assistant reply, or only the last (the"
                        " earlier turns then context)")
    p.add_argument("--scheme", default=_D.scheme, metavar="|".join(SCHEMES) + "|FILE",
                   action=StoreGiven,
                   help="update scheme, or a JSON scheme file (UpdateScheme.to_dict)")
    p.add_argument("--blocks", type=positive_int, default=None, action=StoreGiven,
                   help="last blocks trained by paper/channels (default: the registry's depth rule,"
                        " see pockjax/schemes.py paper_blocks)")
    p.add_argument("--optimizer", default=_D.optimizer, choices=sorted(DEFAULT_LR),
                   action=StoreGiven)
    p.add_argument("--lr", type=positive_finite_float, default=None, action=StoreGiven,
                   help="learning rate, finite and > 0 (default: " + ", ".join(
                       f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    p.add_argument("--steps", type=positive_int, default=None, action=StoreGiven,
                   help=f"training steps (default {_D.steps}; with --resume: the run's own;"
                   " a larger value continues the run exactly under the constant schedule (a"
                   " cosine or linear one is refused), one below its current step is refused)")
    p.add_argument("--batch-size", type=positive_int, default=_D.batch_size, action=StoreGiven,
                   help="rows per step (per micro-batch with --grad-accum)")
    p.add_argument("--grad-accum", type=positive_int, default=_D.grad_accum, action=StoreGiven, metavar="K",
                   help="gradient accumulation: each of --steps updates once on K micro-batches of --batch-size"
                        " rows (the loss averaged over all their trained (answer) tokens), run one after another inside"
                        " the compiled step: a K x larger batch with the activation memory of one")
    p.add_argument("--seq-len", type=positive_int, default=None, action=StoreGiven,
                   help="row length (default: the longest example, rounded up to 16)")
    p.add_argument("--max-seq-len", type=positive_int, default=None, action=StoreGiven, metavar="N",
                   help="length bucketing instead of --seq-len: each step's rows are padded to the shortest"
                        " of up to 4 lengths (multiples of 16, chosen from the data to pad least) that fits"
                        " them, at most N; the step compiles once per length; an example longer than N is"
                        " an error")
    p.add_argument("--seed", type=non_negative_int, default=_D.seed, action=StoreGiven)
    p.add_argument("--eval-examples", type=non_negative_int, default=_D.eval_examples,
                   action=StoreGiven,
                   help="held-out examples for exact match before and after (0: skip)")
    p.add_argument("--save-every", type=positive_int, default=_D.save_every, action=StoreGiven,
                   help="checkpoint every N steps (N >= --steps: only at the end)")
    p.add_argument("--show", type=non_negative_int, default=_D.show, action=StoreGiven,
                   help="generations shown before/after")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory: weights, tokenizer, scheme, metrics (metrics.csv, loss.png,"
                        " TensorBoard event files in tb/), resume state")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--mesh", default="", metavar="AXIS=N[,AXIS=N]", action=StoreGiven,
                   help="train over several devices: data=N (data parallel), fsdp=N (parameters"
                        " and optimizer state split N ways) or both, e.g. data=2,fsdp=4; on a CPU"
                        " the host is split into that many devices")
    p.add_argument("--devices", type=positive_int, default=None, metavar="N", action=StoreGiven,
                   help="data parallel over N devices (the same as --mesh data=N)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=_D.dtype, action=StoreGiven,
                   help="bf16: matrix products in bfloat16 and frozen float weights held in bfloat16;"
                        " trained weights and optimizer state stay float32 (LLaMA models)")
    p.add_argument("--schedule", choices=SCHEDULES, default=_D.schedule, action=StoreGiven,
                   help="learning-rate schedule after --warmup: constant, cosine or linear (to 0 at the end)")
    p.add_argument("--warmup", type=non_negative_int, default=_D.warmup, action=StoreGiven,
                   help="updates of linear learning-rate warm-up from 0")
    p.add_argument("--grad-clip", type=positive_finite_float, default=None, action=StoreGiven, metavar="NORM",
                   help="clip the gradients to this global norm")
    p.add_argument("--eval-every", type=non_negative_int, default=_D.eval_every, action=StoreGiven, metavar="N",
                   help="every N steps, the loss on the held-out examples (0: never)")
    p.add_argument("--quantize", choices=tuple(QUANTIZE), default=_D.quantize, action=StoreGiven,
                   help="hold the frozen matrices block-quantized: int8 (Q8_0) or int4 (Q4_1; a GGUF"
                        " file's own Q4_0/Q4_1 blocks are kept as they are); dequantized per product"
                        " inside the step (LLaMA models)")
    p.add_argument("--image-size", type=positive_int, default=_IMAGE_SIZE, action=StoreGiven,
                   help="classifiers: image side in pixels (mobilenetv2)")
    p.add_argument("--train-per-class", type=non_negative_int, default=_PER_CLASS, action=StoreGiven,
                   help="classifiers: training examples per class (0: all)")
    p.add_argument("--fraction", type=probability, default=0.5, action=StoreGiven,
                   help="classifiers: the 'channels' scheme's fraction of output channels")
    p.add_argument("--fail-below", type=float_in(0.0, 1.0), default=None, metavar="ACC",
                   help="exit with status 1 if the held-out accuracy ends below ACC")
    p.set_defaults(func=run_finetune)

    g = subparsers.add_parser(
        "generate", help="answer a prompt with a base or fine-tuned model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m, gemma3-270m, a .gguf file, or a directory written by finetune --out")
    g.add_argument("--prompt", action="append", required=True,
                   help="user message (repeat for several prompts)")
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=non_negative_finite_float, default=0.0,
                   help="0: greedy")
    g.add_argument("--top-p", type=probability, default=1.0, action=StoreGiven, help="in (0, 1]; with --temperature")
    g.add_argument("--seed", type=non_negative_int, default=0, action=StoreGiven, help="with --temperature")
    g.set_defaults(func=run_generate)

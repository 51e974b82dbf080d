"""``finetune(config)``: sparse fine-tuning of a LLaMA model on a task, end to end.

The train step is an ordinary functional JAX + Optax step::

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

compiled with ``pockjax.compile(train_step, scheme=scheme)`` and run on
``pockjax.init_opt_state(tx, params, scheme)`` (optimizer state for the
trained entries only). Around it: held-out exact-match evaluation before and
after, a progress bar (loss, tokens/s, memory), and an output directory that
is only ever replaced whole (see :func:`write_output`)::

    OUT/config.json, model.safetensors        tuned weights (Hugging Face layout)
    OUT/tokenizer.json, tokenizer_config.json
    OUT/scheme.json                           the UpdateScheme (UpdateScheme.from_dict)
    OUT/metrics.json                          accuracy before/after, timings, losses
    OUT/run.json                              the FinetuneConfig of the run
    OUT/state/opt_state.npz, trainer.json     optimizer state, step, rng: for --resume

``OUT`` loads with ``llama.load_pretrained(OUT)`` and ``pockjax generate --model OUT``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax
from pockjax.data import Batcher, DataError, evaluate_model, load_alpaca_jsonl, train_eval_split
from pockjax.models import llama
from pockjax.runtime.module import process_rss_bytes
from pockjax.train.schemes import llama_scheme, load_scheme_file, save_scheme_file
from pockjax.train.steps import ANSWER_STEP_XLA_OPTIONS, answer_train_step

__all__ = ["FinetuneConfig", "FinetuneError", "FinetuneResult", "finetune", "make_optimizer",
           "write_output", "OUTPUT_FILES"]

#: Files a finished output directory holds (``state/`` holds the resume state).
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "scheme.json", "metrics.json", "run.json", "state")

DEFAULT_LR = {"adamw": 3e-4, "adam": 3e-4, "sgd": 1e-2, "lion": 3e-5}

# The default run's goal (see the closing summary).
GOAL_ACCURACY = 0.8
GOAL_MINUTES = 15.0


class FinetuneError(pockjax.PockjaxError, ValueError):
    """A fine-tuning run cannot start (bad arguments or output directory)."""


@dataclasses.dataclass
class FinetuneConfig:
    """Everything a fine-tuning run needs (the CLI flags of ``pockjax finetune``).

    Attributes:
      model: ``"smollm2-135m"``, a ``.gguf`` file, or a Hugging Face directory.
      task: A built-in task (``pockjax.data.TASKS``); ignored when ``data`` is set.
      data: An Alpaca-format JSONL file (its last ``eval_examples`` records, after a
        seeded shuffle, are held out).
      scheme: ``full``, ``paper``, ``norm-only``, ``channels`` or a scheme file.
      blocks: Last blocks trained by ``paper``/``channels`` (None: the default).
      optimizer: ``adamw``, ``adam``, ``sgd`` (momentum 0.9) or ``lion``.
      lr: Learning rate (None: the optimizer's default in ``DEFAULT_LR``).
      steps: Training steps.
      batch_size: Rows per step.
      seq_len: Row length (None: the longest example, rounded up to 16).
      seed: Seed of the data split and the batch order.
      train_examples: Generated training examples (built-in tasks).
      eval_examples: Held-out examples for exact match before and after (0: skip).
      eval_max_new_tokens: Generation budget (None: longest answer + margin).
      show: Generations printed before and after.
      save_every: Write a checkpoint every this many steps (0: only at the end).
      out: Output directory (None: write nothing).
      resume: Continue the run in ``out``.
      progress: Show the progress bar.
    """

    model: str = "smollm2-135m"
    task: str = "reverse_words"
    data: str | None = None
    scheme: str = "paper"
    blocks: int | None = None
    optimizer: str = "adamw"
    lr: float | None = None
    steps: int = 100
    batch_size: int = 8
    seq_len: int | None = None
    seed: int = 0
    train_examples: int = 4000
    eval_examples: int = 40
    eval_max_new_tokens: int | None = None
    show: int = 3
    save_every: int = 50
    out: str | None = None
    resume: bool = False
    progress: bool = True

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FinetuneConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass
class FinetuneResult:
    """What :func:`finetune` returns."""

    metrics: dict
    model: Any
    tokenizer: Any
    scheme: pockjax.UpdateScheme
    out: str | None


def make_optimizer(name: str, lr: float | None = None) -> optax.GradientTransformation:
    """An Optax optimizer by name (``adamw``, ``adam``, ``sgd``, ``lion``).

    Example:
      >>> make_optimizer("sgd", 0.1).init({"w": jnp.zeros(2)})[0].trace["w"].shape
      (2,)
    """
    key = name.lower()
    if key not in DEFAULT_LR:
        raise FinetuneError(f"unknown optimizer {name!r}; use one of {', '.join(DEFAULT_LR)}")
    lr = DEFAULT_LR[key] if lr is None else float(lr)
    if not lr > 0:
        raise FinetuneError(f"the learning rate must be positive, got {lr}")
    if key == "adamw":
        return optax.adamw(lr, weight_decay=0.0)
    if key == "adam":
        return optax.adam(lr)
    if key == "sgd":
        return optax.sgd(lr, momentum=0.9)
    return optax.lion(lr)


# -- memory and output --------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process now (0 if unknown)."""
    return process_rss_bytes() or 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GB"


def _json_dump(obj: Any, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)


def _recover(out: str) -> None:
    """Finishes an interrupted directory swap (see :func:`write_output`)."""
    old = out + ".old"
    if not os.path.exists(out) and os.path.isdir(old):
        os.replace(old, out)


def write_output(out: str, *, model: Any, tokenizer: Any, scheme: pockjax.UpdateScheme,
                 metrics: dict, run: dict, opt_state: Any, step: int, rng: Any) -> None:
    """Writes a complete output directory atomically.

    Everything goes to ``OUT.tmp-PID`` first; then the old ``OUT`` is renamed to
    ``OUT.old``, the new one to ``OUT``, and ``OUT.old`` is deleted. A failure
    while writing leaves the previous ``OUT`` untouched (and no temporary
    directory); a crash between the two renames is repaired by the next run
    (``OUT.old`` is moved back).
    """
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    try:
        os.makedirs(os.path.join(tmp, "state"))
        llama.save_hf_checkpoint(model, tmp)
        tokenizer.save(tmp)
        save_scheme_file(os.path.join(tmp, "scheme.json"), scheme)
        _json_dump(metrics, os.path.join(tmp, "metrics.json"))
        _json_dump(run, os.path.join(tmp, "run.json"))
        leaves = jax.tree.leaves(opt_state)
        np.savez(os.path.join(tmp, "state", "opt_state.npz"),
                 **{f"leaf_{i:04d}": np.asarray(x) for i, x in enumerate(leaves)})
        _json_dump({"step": int(step), "rng": np.asarray(rng).tolist(),
                    "opt_state_leaves": len(leaves),
                    "opt_state_shapes": [list(np.shape(x)) for x in leaves]},
                   os.path.join(tmp, "state", "trainer.json"))
        _recover(out)
        old = out + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        if os.path.exists(out):
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _read_state(out: str) -> tuple[dict, list[np.ndarray]]:
    tj = os.path.join(out, "state", "trainer.json")
    npz = os.path.join(out, "state", "opt_state.npz")
    try:
        with open(tj, encoding="utf-8") as f:
            trainer = json.load(f)
        with np.load(npz) as z:
            leaves = [z[f"leaf_{i:04d}"] for i in range(trainer["opt_state_leaves"])]
    except (OSError, KeyError, ValueError) as e:
        raise FinetuneError(f"cannot resume from {out}: its training state is unreadable"
                            f" ({type(e).__name__}: {e})") from None
    return trainer, leaves


# -- data --------------------------------------------------------------------------


def _examples(cfg: FinetuneConfig):
    if cfg.data:
        records = load_alpaca_jsonl(cfg.data)
        n_eval = cfg.eval_examples
        if len(records) <= n_eval:
            raise DataError(f"{cfg.data} has {len(records)} records; at least"
                            f" {n_eval + 1} are needed for {n_eval} held-out examples"
                            f" (lower --eval-examples)")
        order = np.random.default_rng(cfg.seed).permutation(len(records))
        held = [records[i] for i in order[:n_eval]]
        train = [records[i] for i in order[n_eval:]]
        return train, held, os.path.basename(cfg.data)
    train, held = train_eval_split(cfg.task, cfg.train_examples, cfg.eval_examples, seed=cfg.seed)
    return train, held, cfg.task


def _eval(model, tok, held, cfg, max_new):
    if not held:
        return None
    return evaluate_model(model, tok, held, max_new_tokens=max_new,
                          batch_size=len(held) if len(held) <= 64 else 32)


def _show(title: str, held, result, n: int, log) -> None:
    if not result or n <= 0:
        return
    log(f"--- {title} ---")
    for ex, pred in list(zip(held, result["predictions"]))[:n]:
        prompt = ex.prompt if len(ex.prompt) < 100 else ex.prompt[:97] + "..."
        log(f"  prompt:   {prompt}")
        log(f"  expected: {ex.answer}")
        log(f"  model:    {pred.strip()!r}")


# -- the run -----------------------------------------------------------------------

_RESUME_KEEP = ("steps", "out", "save_every", "progress", "show")


def finetune(config: FinetuneConfig, *, model: Any = None, tokenizer: Any = None,
             log: Callable[[str], None] | None = None,
             on_step: Callable[[int, float], None] | None = None) -> FinetuneResult:
    """Fine-tunes a model with a sparse (or full) update scheme; see the module docstring.

    Args:
      config: The run's :class:`FinetuneConfig`.
      model, tokenizer: Use these instead of loading ``config.model`` (tests).
      log: Where text goes (default ``print``).
      on_step: Called after each step as ``on_step(step, loss)`` (``step``
        counts finished steps); an exception there stops the run like a crash.

    Returns:
      A :class:`FinetuneResult`.

    Raises:
      FinetuneError, DataError, SequenceLengthError, SchemeError (including
      UnmatchedPatternError), GGUFError, FileNotFoundError: bad input; raised
      before anything is written.
    """
    log = log or (lambda s: print(s, flush=True))
    t_start = time.time()
    cfg = dataclasses.replace(config)
    out = os.path.abspath(cfg.out) if cfg.out else None

    # -- 1. validate everything before touching the output directory ----------------
    resume_state = None
    if out:
        _recover(out)
    if cfg.resume:
        if not out:
            raise FinetuneError("--resume needs --out DIR (the directory of the run to continue)")
        if not os.path.isfile(os.path.join(out, "run.json")):
            raise FinetuneError(f"nothing to resume: {out} holds no fine-tuning run (run.json)")
        with open(os.path.join(out, "run.json"), encoding="utf-8") as f:
            saved = FinetuneConfig.from_dict(json.load(f)["config"])
        keep = {k: getattr(cfg, k) for k in _RESUME_KEEP if getattr(cfg, k) is not None}
        cfg = dataclasses.replace(saved, **keep, resume=True)
        resume_state = _read_state(out)
    elif out and os.path.exists(out) and os.listdir(out):
        raise FinetuneError(f"{out} already exists and is not empty; pass --resume to continue"
                            f" the run in it, or choose another --out")
    if cfg.steps is None:
        cfg.steps = FinetuneConfig.steps
    if cfg.steps < 0 or cfg.batch_size < 1:
        raise FinetuneError("--steps must be >= 0 and --batch-size >= 1")
    tx = make_optimizer(cfg.optimizer, cfg.lr)

    if cfg.resume:
        model, tokenizer = llama.load_pretrained(out)
        log(f"resuming {out} at step {resume_state[0]['step']}")
    elif model is None:
        model, tokenizer = llama.load_pretrained(cfg.model)
    elif tokenizer is None:
        raise FinetuneError("pass a tokenizer with the model")
    else:
        cfg.model = "(given model)"
    if model.config.scan_layers:
        raise FinetuneError("finetune trains an unrolled model (scan_layers=False): pockjax"
                            " prunes the backward pass per block there")
    train, held, data_name = _examples(cfg)
    batcher = Batcher(tokenizer, train, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                      seed=cfg.seed, max_seq_len=model.config.max_seq_len)
    if cfg.resume:
        scheme = load_scheme_file(os.path.join(out, "scheme.json"))
    else:
        scheme = llama_scheme(cfg.scheme, model.config, blocks=cfg.blocks)
    graphdef, params = llama.split(model)
    description = scheme.describe(params)  # raises UnmatchedPatternError on a mismatch
    answers = [len(tokenizer.encode(ex.answer, add_bos=False)) for ex in held]
    max_new = cfg.eval_max_new_tokens or (max(answers, default=0) + 8)
    prompt_len = max((len(tokenizer.apply_chat_template(ex.messages())) for ex in held), default=0)
    if held and prompt_len + 16 + max_new > model.config.max_seq_len:
        raise FinetuneError(f"held-out prompts ({prompt_len} tokens) plus {max_new} new tokens"
                            f" exceed the model's context of {model.config.max_seq_len}")

    if cfg.resume:
        trainer, leaves = resume_state
        opt_state = pockjax.init_opt_state(tx, params, scheme)
        shapes = [list(np.shape(x)) for x in opt_state.leaves]
        if shapes != [list(np.shape(x)) for x in leaves]:
            raise FinetuneError(f"cannot resume from {out}: the saved optimizer state does not"
                                f" match the scheme and optimizer")
        opt_state = jax.tree_util.tree_unflatten(
            jax.tree.structure(opt_state),
            [jnp.asarray(v, dtype=ref.dtype) for v, ref in zip(leaves, opt_state.leaves)])
        start = int(trainer["step"])
        rng = np.asarray(trainer["rng"], np.uint32)
        with open(os.path.join(out, "metrics.json"), encoding="utf-8") as f:
            metrics = json.load(f)
    else:
        opt_state = pockjax.init_opt_state(tx, params, scheme)
        start = 0
        rng = np.asarray(jax.random.key_data(jax.random.key(cfg.seed)), np.uint32)
        metrics = {"losses": [], "accuracy_before": None}

    trainable, total = description.trainable, description.total
    source = out if cfg.resume else cfg.model
    log(f"model {source}: {total / 1e6:.1f}M parameters,"
        f" {model.config.n_layers} blocks")
    log(f"scheme {scheme.name or cfg.scheme}: {trainable / 1e6:.2f}M trainable"
        f" ({100 * trainable / total:.1f}%)")
    log(f"data {data_name}: {len(train)} training / {len(held)} held-out examples;"
        f" batch {cfg.batch_size} x {batcher.seq_len} tokens, answer window"
        f" {batcher.answer_window}; optimizer {cfg.optimizer} lr {cfg.lr or DEFAULT_LR[cfg.optimizer]}")

    # -- 2. evaluate before ------------------------------------------------------------
    if not cfg.resume:
        t = time.time()
        before = _eval(model, tokenizer, held, cfg, max_new)
        if before is not None:
            metrics["accuracy_before"] = before["accuracy"]
            metrics["predictions_before"] = before["predictions"][:max(cfg.show, 0)]
            log(f"held-out exact match before: {100 * before['accuracy']:.1f}%"
                f" ({before['correct']}/{before['total']}, {time.time() - t:.0f} s)")
            _show("before fine-tuning", held, before, cfg.show, log)
        metrics["eval_seconds_before"] = time.time() - t

    # -- 3. the train step ---------------------------------------------------------------
    window = batcher.answer_window

    step_fn = pockjax.compile(answer_train_step(graphdef, tx, window), scheme=scheme,
                              xla_options=ANSWER_STEP_XLA_OPTIONS)

    def batch_at(i):
        return {k: jnp.asarray(v) for k, v in batcher.batch(i).items()}

    t = time.time()
    if start < cfg.steps:
        step_fn.lower(params, opt_state, batch_at(start))
    compile_s = time.time() - t
    if start < cfg.steps:
        log(f"compiled the sparse train step in {compile_s:.1f} s")

    run = {"config": cfg.to_dict(), "scheme": scheme.to_dict()}

    def save(step):
        metrics["step"] = step
        write_output(out, model=llama.merge(graphdef, params), tokenizer=tokenizer,
                     scheme=scheme, metrics=metrics, run=run, opt_state=opt_state,
                     step=step, rng=rng)

    tokens_per_step = cfg.batch_size * batcher.seq_len
    step_times: list[float] = []
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=start, disable=not cfg.progress, unit="step",
               dynamic_ncols=True, file=sys.stderr)
    t_train = time.time()
    try:
        for i in range(start, cfg.steps):
            t = time.time()
            params, opt_state, loss = step_fn(params, opt_state, batch_at(i))
            loss = float(loss)
            dt = time.time() - t
            step_times.append(dt)
            metrics["losses"].append(round(loss, 5))
            if not math.isfinite(loss):
                raise FinetuneError(f"the loss became {loss} at step {i}; lower --lr")
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:.0f}",
                            rss=_gb(rss_bytes()), refresh=False)
            bar.update(1)
            if on_step is not None:
                on_step(i + 1, loss)
            if out and cfg.save_every and (i + 1) % cfg.save_every == 0 and i + 1 < cfg.steps:
                save(i + 1)
    finally:
        bar.close()
    train_s = time.time() - t_train

    # -- 4. evaluate after, summarise, write ----------------------------------------------
    model = llama.merge(graphdef, params)
    t = time.time()
    after = _eval(model, tokenizer, held, cfg, max_new)
    eval_after_s = time.time() - t
    if after is not None:
        metrics["accuracy_after"] = after["accuracy"]
        metrics["predictions_after"] = after["predictions"][:max(cfg.show, 0)]
        _show("after fine-tuning", held, after, cfg.show, log)
    steady = step_times[1:] if len(step_times) > 1 else step_times
    s_per_step = float(np.mean(steady)) if steady else float("nan")
    wall = time.time() - t_start
    metrics.update({
        "model": cfg.model, "data": data_name, "scheme": scheme.name or cfg.scheme,
        "trainable_params": trainable, "total_params": total,
        "steps": cfg.steps, "steps_this_run": len(step_times), "batch_size": cfg.batch_size,
        "seq_len": batcher.seq_len, "compile_seconds": compile_s,
        "train_seconds_this_run": train_s, "seconds_per_step": s_per_step,
        "tokens_per_second": tokens_per_step / s_per_step if steady else None,
        "eval_seconds_after": eval_after_s, "wall_seconds_this_run": wall,
        "peak_rss_bytes": peak_rss_bytes(), "final_loss": metrics["losses"][-1]
        if metrics["losses"] else None, "eval_examples": len(held),
    })
    if out:
        save(cfg.steps)
    _summary(metrics, cfg, out, log)
    return FinetuneResult(metrics, model, tokenizer, scheme, out)


def _summary(m: dict, cfg: FinetuneConfig, out: str | None, log) -> None:
    pct = 100 * m["trainable_params"] / max(m["total_params"], 1)
    minutes = m["wall_seconds_this_run"] / 60
    lines = ["", "=== pockjax finetune: summary ==="]
    lines.append(f"model      {m['model']}, scheme {m['scheme']}: {m['trainable_params'] / 1e6:.2f}M"
                 f" of {m['total_params'] / 1e6:.1f}M parameters trainable ({pct:.1f}%)")
    tps = m["tokens_per_second"]
    lines.append(f"training   {m['steps_this_run']} steps (to step {m['steps']}) of"
                 f" {m['batch_size']} x {m['seq_len']} tokens in {m['train_seconds_this_run'] / 60:.1f} min:"
                 f" {m['seconds_per_step']:.2f} s/step, {tps or 0:.0f} tokens/s"
                 f" (+ {m['compile_seconds']:.0f} s compile); final loss {m['final_loss']}")
    # The default run (SmolLM2-135M on reverse_words) has a stated goal; say whether it was met.
    default_run = (m["model"] == FinetuneConfig.model and cfg.data is None
                   and cfg.task == FinetuneConfig.task)
    before, after = m.get("accuracy_before"), m.get("accuracy_after")
    if after is not None:
        b = "n/a" if before is None else f"{100 * before:.1f}%"
        goal = (f" (goal >= {100 * GOAL_ACCURACY:.0f}%: "
                f"{'met' if after >= GOAL_ACCURACY else 'NOT met'})") if default_run else ""
        lines.append(f"held-out   exact match {b} -> {100 * after:.1f}% on {m['eval_examples']}"
                     f" {m['data']} examples{goal}")
    goal = (f" (goal <= {GOAL_MINUTES:.0f} min: {'met' if minutes <= GOAL_MINUTES else 'NOT met'})"
            if default_run else "")
    lines.append(f"time       {minutes:.1f} min wall for this run{goal};"
                 f" peak RSS {_gb(m['peak_rss_bytes'])}")
    if out:
        lines.append(f"output     {out}  (pockjax generate --model {out} --prompt ...)")
    for line in lines:
        log(line)

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
    OUT/metrics.csv, loss.png                 step, loss, learning rate, held-out loss; the plot
    OUT/tb/events.out.tfevents.TIME.HOST      the same curves for TensorBoard (one file per
                                              run and per --resume)
    OUT/run.json                              the FinetuneConfig of the run, effective
                                              lr / seq_len, the data file's SHA-256
    OUT/state/opt_state.npz, trainer.json     optimizer state, step, the SHA-256 of every
                                              file above but metrics.csv and loss.png
                                              (redrawn from metrics.json): for --resume

``OUT`` loads with ``llama.load_pretrained(OUT)`` and ``pockjax generate --model OUT``.

Trust: every number is checked before any work; ``resume=True`` continues the
run exactly or refuses (:data:`RESULT_FIELDS`); the step returns
:func:`~pockjax.train.steps.weight_health` and the run stops with a
:class:`~pockjax.errors.NonFiniteError` (naming the step and the first bad
tensor) when the loss or a trained weight is not finite or the weights
diverge (:data:`WEIGHT_GROWTH_LIMIT`); no checkpoint holding a NaN or an
infinity is ever written.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import shutil
import sys
import time
import warnings
import zipfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax
from pockjax.data import Batcher, DataError, evaluate_model, load_alpaca_jsonl, refuse_control_text, train_eval_split
from pockjax.data.batching import REPLIES, SequenceLengthError
from pockjax.io.atomic import atomic_directory, file_above, remove_stale_temporaries, write_json
from pockjax.io.jsonfile import read_json_object
from pockjax import quant
from pockjax.adapters import LoraTensor, add_adapters, expand_flat, has_adapters, merge as merge_adapters
from pockjax.scheme import LORA_PARTS
from pockjax.models import llama
from pockjax.models.llama.config import is_finite_number
from pockjax.models.llama.mixed import LlamaWeights
from pockjax.runtime.heap import process_rss_bytes, release_free_heap
from pockjax.runtime.module import file_sha256
from pockjax.train.schemes import llama_scheme, load_scheme_file, save_scheme_file
from pockjax.errors import NonFiniteError, SchemeError
from pockjax.scheme import Frozen, Full
from pockjax.train.steps import ANSWER_STEP_XLA_OPTIONS, answer_train_step, first_non_finite

__all__ = ["FinetuneConfig", "FinetuneError", "FinetuneResult", "finetune", "make_optimizer",
           "write_output", "OUTPUT_FILES", "RESULT_FIELDS", "WEIGHT_GROWTH_LIMIT"]

#: Files a finished output directory holds (``state/`` holds the resume state).
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "scheme.json", "metrics.json", "metrics.csv", "run.json", "state", "tb")
#: A LoRA run's adapters and their bases, for ``--resume`` (in ``state/``).
ADAPTERS_FILE = "adapters.safetensors"
#: The loss curve, also written where Matplotlib is installed (``pockjax[plot]``).
PLOT_FILE = "loss.png"
#: The TensorBoard event files' directory (scalars train/loss, train/lr, val/loss).
TB_DIR = "tb"
SCHEDULES = ("constant", "cosine", "linear")

DEFAULT_LR = {"adamw": 3e-4, "adam": 3e-4, "sgd": 1e-2, "lion": 3e-5}

#: A run stops (:class:`~pockjax.errors.NonFiniteError`) when the L2 norm of
#: the fully trained weights grows beyond this many times its value at the
#: start of the run: the updates diverge (``--lr 1e9`` makes weights of size
#: 1e9 in one step), and the NaN or infinity they lead to would come a step
#: later or never (a final RMSNorm keeps the loss finite). Ordinary
#: fine-tuning changes that norm by a few percent.
WEIGHT_GROWTH_LIMIT = 1000.0

#: The options that decide the trained weights: ``--resume`` keeps them (a
#: different value is refused, with the differences listed). The others may
#: change on resume: ``steps`` (not below the run's current step: continuing
#: is exact), ``save_every``, ``show``, ``progress``, ``eval_max_new_tokens``,
#: ``mesh`` (the saved state is whole, so a run may continue on other devices).
RESULT_FIELDS = ("model", "task", "data", "scheme", "blocks", "optimizer", "lr", "batch_size",
                 "seq_len", "seed", "train_examples", "eval_examples", "dtype", "quantize",
                 "schedule", "warmup", "grad_clip", "grad_accum", "max_seq_len", "train_replies")

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
      data: An Alpaca-format or chat JSONL file (its last ``eval_examples`` records, after a
        seeded shuffle, are held out).
      train_replies: ``"all"``: every assistant reply of a chat record is
        trained on; ``"last"``: only its last (the answer), the earlier turns
        context (:class:`~pockjax.data.Batcher` ``replies``).
      scheme: ``full``, ``paper``, ``norm-only``, ``channels`` or a scheme file.
      blocks: Last blocks trained by ``paper``/``channels`` (None: the default).
      optimizer: ``adamw``, ``adam``, ``sgd`` (momentum 0.9) or ``lion``.
      lr: Learning rate (None: the optimizer's default in ``DEFAULT_LR``).
      steps: Training steps.
      batch_size: Rows per micro-batch (per step without ``grad_accum``).
      seq_len: Row length (None: the longest example, rounded up to 16).
      max_seq_len: Length bucketing instead of one row length: each step's
        rows are padded to the shortest of up to 4 lengths (chosen from the
        data to pad least, :func:`~pockjax.data.batching.choose_buckets`)
        that fits its longest example, at most this many tokens; the step
        compiles once per length. A longer example is an error. Not with
        ``seq_len``.
      grad_accum: Gradient accumulation: each optimizer update (each of
        ``steps``) averages the loss over ``grad_accum`` micro-batches of
        ``batch_size`` rows, run one after another inside the compiled step
        (:func:`~pockjax.train.steps.answer_train_step` ``accum``): the update
        of a ``grad_accum * batch_size`` batch with the activation memory of
        ``batch_size`` rows. With ``mesh``, each micro-batch is split over
        the devices.
      seed: Seed of the data split and the batch order.
      train_examples: Generated training examples (built-in tasks).
      eval_examples: Held-out examples for exact match before and after (0: skip).
      eval_max_new_tokens: Generation budget (None: longest answer + margin).
      show: Generations printed before and after.
      save_every: Write a checkpoint every this many steps (0: only at the end;
        the CLI's ``--save-every`` takes >= 1).
      out: Output directory (None: write nothing).
      resume: Continue the run in ``out``.
      progress: Show the progress bar.
      mesh: Train over several devices: ``"data=2"`` (data parallel),
        ``"fsdp=8"`` (parameters and optimizer state split over 8 devices) or
        both (``"data=2,fsdp=4"``); the batch is split over all of them.
        Empty: one device. It may change on resume (the saved state is whole).
      dtype: ``"fp32"`` or ``"bf16"``: bf16 computes every matrix product of
        the step in bfloat16 (``pockjax.compile(precision="bf16")``) and holds
        the frozen float tensors in bfloat16; trained tensors and the
        optimizer state stay float32.
      quantize: ``"none"``, ``"int8"`` or ``"int4"``: frozen matrices held
        block-quantized (Q8_0; Q4_1, or the GGUF file's own Q4_0/Q4_1 blocks),
        dequantized per product inside the step (:mod:`pockjax.quant`).
      schedule: Learning-rate schedule over the run: ``constant``, ``cosine``
        (to 0 at the last step) or ``linear`` (to 0), after ``warmup``.
      warmup: Steps of linear warm-up from 0 to ``lr``.
      grad_clip: Clip the gradients to this global norm (None: no clipping).
      eval_every: Every this many steps, the loss on the held-out examples
        (``metrics.json``'s ``val_losses``, ``metrics.csv``'s ``val_loss``; 0: never).
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
    mesh: str = ""
    dtype: str = "fp32"
    quantize: str = "none"
    schedule: str = "constant"
    warmup: int = 0
    grad_clip: float | None = None
    eval_every: int = 0
    grad_accum: int = 1
    max_seq_len: int | None = None
    train_replies: str = "all"

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


def make_optimizer(name: str, lr: float | None = None, *, schedule: str = "constant", warmup: int = 0,
                   steps: int | None = None, grad_clip: float | None = None) -> optax.GradientTransformation:
    """An Optax optimizer by name (``adamw``, ``adam``, ``sgd``, ``lion``), with the run's schedule.

    Args:
      name, lr: the optimizer and its (peak) learning rate (None: ``DEFAULT_LR``).
      schedule, warmup, steps: :func:`lr_schedule` over ``steps`` updates.
      grad_clip: clip the gradients to this global norm first.

    Example:
      >>> make_optimizer("sgd", 0.1).init({"w": jnp.zeros(2)})[0].trace["w"].shape
      (2,)
      >>> tx = make_optimizer("adamw", 1e-3, schedule="cosine", warmup=2, steps=10, grad_clip=1.0)
    """
    key = name.lower()
    if key not in DEFAULT_LR:
        raise FinetuneError(f"unknown optimizer {name!r}; use one of {', '.join(DEFAULT_LR)}")
    lr = DEFAULT_LR[key] if lr is None else float(lr)
    if not (lr > 0 and math.isfinite(lr)):
        raise FinetuneError(f"the learning rate must be a finite number > 0, got {lr}")
    rate = lr_schedule(lr, schedule, warmup, steps) if (schedule != "constant" or warmup) else lr
    if key == "adamw":
        tx = optax.adamw(rate, weight_decay=0.0)
    elif key == "adam":
        tx = optax.adam(rate)
    elif key == "sgd":
        tx = optax.sgd(rate, momentum=0.9)
    else:
        tx = optax.lion(rate)
    if grad_clip is not None:
        tx = optax.chain(optax.clip_by_global_norm(float(grad_clip)), tx)
    return tx


def lr_schedule(lr: float, schedule: str = "constant", warmup: int = 0, steps: int | None = None):
    """The learning rate at each update: linear warm-up from 0, then constant, cosine or linear to 0.

    Example:
      >>> f = lr_schedule(1.0, "cosine", warmup=2, steps=10)
      >>> [round(float(f(i)), 3) for i in (0, 1, 2, 6, 10)]
      [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    if schedule not in SCHEDULES:
        raise FinetuneError(f"unknown --schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    steps = max(int(steps or 1), warmup + 1)
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=0.0)
    after = (optax.constant_schedule(lr) if schedule == "constant"
             else optax.linear_schedule(lr, 0.0, steps - warmup))
    if not warmup:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


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
    write_json(path, obj, indent=1)


def _recover(out: str) -> None:
    """Repairs what a killed run left beside ``out`` (see :func:`write_output`): removes the
    temporaries of dead processes and moves back an old directory whose swap was interrupted
    (:func:`~pockjax.io.atomic.remove_stale_temporaries`). Only names that carry the
    ``.pockjax-tmp-`` marker are touched: a user's ``OUT.old`` or ``OUT.tmp-1`` is theirs (the
    names versions before 2026-11-25 used, which ``_recover`` once moved and removed).
    """
    remove_stale_temporaries(os.path.dirname(os.path.abspath(out)))


@dataclasses.dataclass
class EventsLog:
    """One run's TensorBoard event file, ``OUT/tb/NAME``: the steps after ``start``.

    A resumed run writes a new file and keeps the earlier runs' files as they
    are (TensorBoard reads a directory's files in name order). ``wall_times``
    maps a step to the time it finished.
    """

    name: str
    start: int = 0
    wall_times: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def for_run(cls, out: str | None, start: int, now: float | None = None) -> "EventsLog":
        """A log for a run starting after step ``start``, named after ``now`` and not yet taken in ``out``."""
        from pockjax.io.tfevents import events_file_name

        base = events_file_name(now)
        taken = set(os.listdir(os.path.join(out, TB_DIR))) if out and os.path.isdir(os.path.join(out, TB_DIR)) else set()
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}.{n}"
        return cls(name, start)


def write_output(out: str, *, model: Any, tokenizer: Any, scheme: pockjax.UpdateScheme,
                 metrics: dict, run: dict, opt_state: Any, step: int,
                 adapters: dict | None = None, events: EventsLog | None = None) -> None:
    """Writes a complete output directory atomically and durably.

    ``model`` is what the directory holds for users (LoRA adapters merged);
    ``adapters`` (``{path: LoraTensor}``) go to ``state/adapters.safetensors``,
    base and factors, so that ``--resume`` continues the run exactly.
    ``events``: this run's TensorBoard file in ``tb/`` (the other files there,
    of the runs before a ``--resume``, are carried over); None: one file of
    every step.

    Everything goes to a temporary sibling (``OUT.pockjax-tmp-PID-TAG``), is
    fsynced, and then takes the place of ``OUT`` (see
    :func:`pockjax.io.atomic.atomic_directory`). A failure while writing
    leaves the previous ``OUT`` untouched and no temporary; a process killed
    while writing leaves a temporary that the next run removes (and an
    interrupted swap, which the next run undoes).
    """
    out = os.path.abspath(out)
    _recover(out)
    with atomic_directory(out) as tmp:
        os.makedirs(os.path.join(tmp, "state"))
        llama.save_hf_checkpoint(model, tmp)
        tokenizer.save(tmp)
        save_scheme_file(os.path.join(tmp, "scheme.json"), scheme)
        _json_dump(metrics, os.path.join(tmp, "metrics.json"))
        if events is not None and os.path.isdir(os.path.join(out, TB_DIR)):
            os.makedirs(os.path.join(tmp, TB_DIR))
            for name in sorted(os.listdir(os.path.join(out, TB_DIR))):
                if name != events.name and name.startswith("events.out.tfevents."):
                    shutil.copyfile(os.path.join(out, TB_DIR, name), os.path.join(tmp, TB_DIR, name))
        _write_curves(tmp, metrics, run, events)
        _json_dump(run, os.path.join(tmp, "run.json"))
        if adapters:
            from pockjax.io.safetensors import write_safetensors

            write_safetensors(os.path.join(tmp, "state", ADAPTERS_FILE),
                              {f"{path}.{part}": _host_float(getattr(t, part)) for path, t in adapters.items()
                               for part in LORA_PARTS})
        leaves = jax.tree.leaves(opt_state)
        np.savez(os.path.join(tmp, "state", "opt_state.npz"),
                 **{f"leaf_{i:04d}": np.asarray(x) for i, x in enumerate(leaves)})
        _json_dump({"step": int(step),
                    "opt_state_leaves": len(leaves),
                    "opt_state_shapes": [list(np.shape(x)) for x in leaves],
                    "sha256": _resume_digests(tmp)},
                   os.path.join(tmp, "state", "trainer.json"))


#: What ``--resume`` reads back beside the arrays: the options the run is held to, its curves so
#: far, the scheme and the model's configuration.
_RESUME_JSON = ("run.json", "metrics.json", "scheme.json", "config.json")
#: Drawn again from ``metrics.json`` at every save: not checked (a user may open and save them).
_REDRAWN = ("metrics.csv", "loss.png")


def _resume_files(directory: str, with_json: bool = True) -> list[str]:
    """The files ``--resume`` reads back (relative paths) that ``directory`` holds: the weights,
    adapters and optimizer state, and (``with_json``) :data:`_RESUME_JSON` (a file a user put
    beside them is not one)."""
    names = ("model.safetensors", os.path.join("state", ADAPTERS_FILE), os.path.join("state", "opt_state.npz"))
    names += _RESUME_JSON if with_json else ()
    return [n for n in names if os.path.isfile(os.path.join(directory, n))]


def _resume_digests(directory: str) -> dict[str, str]:
    """``{relative path: sha256}`` of every file the run wrote in ``directory`` (the tokenizer and
    earlier TensorBoard events too) but ``state/trainer.json`` and :data:`_REDRAWN`: ``--resume``
    checks them, so that a damaged weight file is refused rather than trained on (its values can
    be any float), and an edited ``run.json`` or ``config.json`` rather than continued under
    other options."""
    skip = {os.path.join("state", "trainer.json"), *_REDRAWN}
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in skip:
                out[rel] = file_sha256(os.path.join(directory, rel))
    return dict(sorted(out.items()))


def _host_float(x: Any) -> np.ndarray:
    """``x`` on the host; a quantized or bf16-held LoRA base (:class:`~pockjax.quant.QTensor`) as its float32 value."""
    return quant.dequantize_host(x, np.float32) if quant.is_qtensor(x) else np.asarray(x)


def _curve_rows(metrics: dict, run: dict) -> list[tuple[int, float, float, float | None]]:
    """``(step, loss, learning rate, held-out loss or None)`` of every step so far.

    The one source of ``metrics.csv``, the TensorBoard events and the plot.
    """
    losses = metrics.get("losses", [])
    cfg = run.get("config", {})
    lr = run.get("effective", {}).get("lr", 0.0)
    rate = lr_schedule(lr, cfg.get("schedule", "constant"), int(cfg.get("warmup", 0) or 0),
                       int(cfg.get("steps", len(losses)) or 1))
    held = {int(step): v for step, v in metrics.get("val_losses", [])}
    return [(i + 1, loss, float(f"{float(rate(i)):.6g}"), held.get(i + 1)) for i, loss in enumerate(losses)]


def _write_curves(directory: str, metrics: dict, run: dict, events: EventsLog | None = None) -> bool:
    """The curves of the run so far (:func:`_curve_rows`): ``metrics.csv``, ``tb/`` and ``loss.png``.

    ``metrics.csv``: step, loss, learning rate, held-out loss. ``tb/``: the
    TensorBoard scalars ``train/loss``, ``train/lr`` and ``val/loss`` of the
    steps of ``events`` (None: of every step). Returns whether it drew
    ``loss.png`` (False: Matplotlib is not installed).
    """
    from pockjax.io.atomic import save_figure, write_text
    from pockjax.io.tfevents import write_events

    curve = _curve_rows(metrics, run)
    rows = ["step,loss,lr,val_loss"] + [f"{step},{loss},{lr:.6g},{'' if val is None else val}"
                                        for step, loss, lr, val in curve]
    write_text(os.path.join(directory, "metrics.csv"), "\n".join(rows) + "\n")
    events = events or EventsLog.for_run(None, 0)
    scalars = [(step, {"train/loss": loss, "train/lr": lr, **({} if val is None else {"val/loss": val})})
               for step, loss, lr, val in curve if step > events.start]
    if scalars:
        os.makedirs(os.path.join(directory, TB_DIR), exist_ok=True)
        write_events(os.path.join(directory, TB_DIR, events.name), scalars, wall_time=events.wall_times or None)
    losses = [loss for _, loss, _, _ in curve]
    held = {step: val for step, _, _, val in curve if val is not None}
    cfg = run.get("config", {})
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2, label="training")
    if held:
        ax.plot(list(held), list(held.values()), "o-", ms=3, lw=1.2, label="held-out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{metrics.get('scheme') or cfg.get('scheme', '')} on {cfg.get('task') or cfg.get('data')}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, os.path.join(directory, PLOT_FILE))
    return True


def _restore_adapters(out: str, params: Any, scheme: pockjax.UpdateScheme) -> Any:
    """``params`` (the run's merged weights) with each LoRA tensor rebuilt from ``state/adapters.safetensors``."""
    from pockjax.io.safetensors import read_safetensors

    path = os.path.join(out, "state", ADAPTERS_FILE)
    try:
        saved = read_safetensors(path)
    except pockjax.PockjaxError as e:
        raise FinetuneError(f"cannot resume from {out}: its LoRA adapters are unreadable ({e})") from None
    flat = llama.flatten_params(params)
    ruled = {p: rule for p in flat for rule in [scheme.rule_for(p)[0]] if isinstance(rule, pockjax.Lora)}
    expected = {f"{p}.{part}" for p in ruled for part in LORA_PARTS}
    if set(saved) != expected:
        raise FinetuneError(f"cannot resume from {out}: {path} does not hold the adapters of the scheme"
                            f" (missing {sorted(expected - set(saved))[:3]}, unexpected"
                            f" {sorted(set(saved) - expected)[:3]})")
    for p, rule in ruled.items():
        base, a, b = (np.array(saved[f"{p}.{part}"]) for part in LORA_PARTS)
        if base.shape != tuple(np.shape(flat[p])) or a.shape != base.shape[:-1] + (rule.rank,) \
                or b.shape != base.shape[:-2] + (rule.rank, base.shape[-1]):
            raise FinetuneError(f"cannot resume from {out}: the saved adapter of {p} does not fit the model"
                                f" and the rule {rule}")
        flat[p] = LoraTensor(jnp.asarray(base), jnp.asarray(a), jnp.asarray(b), scale=rule.scale)
    return _with_flat(params, flat)


def _with_flat(params: Any, flat: dict) -> Any:
    """``params`` with its leaves (LoRA tensors and quantized tensors whole) replaced by ``flat``'s, by path."""
    from pockjax.paths import keypath_to_parts

    def visit(keypath, x):
        return flat[".".join(keypath_to_parts(keypath))]

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=lambda x: isinstance(x, LoraTensor)
                                            or quant.is_qtensor(x))


def _read_state(out: str) -> tuple[dict, list[np.ndarray]]:
    tj = os.path.join(out, "state", "trainer.json")
    npz = os.path.join(out, "state", "opt_state.npz")
    try:
        trainer = read_json_object(tj, what="training state")
        n = trainer.get("opt_state_leaves")
        if type(n) is not int or n < 0 or type(trainer.get("step")) is not int:
            raise ValueError(f"{tj} lacks an integer step and opt_state_leaves")
        digests = trainer.get("sha256")
        if digests == {}:  # (it would check nothing; pockjax never writes it)
            raise ValueError(f"{tj}: sha256 is empty, though a run records the digest of every file it writes")
        if digests is None:  # a run written before 2026-11-27
            warnings.warn(f"{tj} records no sha256 digests (a run written before 2026-11-27, or the entry was"
                          " removed): the weight and optimizer-state files cannot be checked for damage",
                          stacklevel=2)
            digests = {}
        if not isinstance(digests, dict):
            raise ValueError(f"{tj}: sha256 is not a mapping of file names to digests")
        # a run written before 2026-11-28 has the digests of its arrays only
        expected = _resume_files(out, with_json="run.json" in digests) if digests else []
        unlisted = sorted(set(expected) - set(digests))
        if unlisted:
            raise ValueError(f"{tj}: sha256 lists no digest for {', '.join(unlisted)}, which the run wrote")
        for rel, digest in sorted(digests.items()):
            if ".." in rel.split(os.sep) or os.path.isabs(rel):
                raise ValueError(f"{tj}: sha256 names a file outside the run: {rel!r}")
            if not os.path.exists(os.path.join(out, rel)):
                if rel.startswith(TB_DIR + os.sep):  # carried over to the next save: it would be lost
                    raise ValueError(f"{os.path.join(out, rel)}, the TensorBoard events of an earlier part"
                                     " of the run, is missing; put it back, or start a new run in another --out")
                continue  # a missing file: its own reader says which, and what it holds
            if file_sha256(os.path.join(out, rel)) != digest:
                raise ValueError(f"{os.path.join(out, rel)} is not the file this run wrote (its sha256"
                                 " differs from the one recorded in state/trainer.json): it was damaged or"
                                 " edited; a run continues only as it was written (start a new run in"
                                 " another --out for other options)")
        with np.load(npz, allow_pickle=False) as z:  # never unpickle
            leaves = [z[f"leaf_{i:04d}"] for i in range(n)]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, pockjax.PockjaxError) as e:
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
        # no held-out prompt is trained on (a record given twice would be both): as train_eval_split
        asked = {(ex.prompt, ex.context) for ex in held}
        # nor a held-out question with its answer in another setting (a system message, earlier turns);
        # with every reply trained, nor a conversation with a held-out question and answer among its turns
        # (which covers one that starts with a held-out conversation and its answer)
        pairs = {(ex.prompt, ex.answer) for ex in held}

        def turns(ex):  # (user message, the assistant's reply) of the earlier turns
            c = ex.context
            return {(c[i][1], c[i + 1][1]) for i in range(len(c) - 1) if (c[i][0], c[i + 1][0]) == ("user", "assistant")}

        def held_in(ex):
            return (ex.prompt, ex.context) in asked or (ex.prompt, ex.answer) in pairs or (
                cfg.train_replies == "all" and bool(turns(ex) & pairs))

        train = [records[i] for i in order[n_eval:] if not held_in(records[i])]
        if not train:
            raise DataError(f"{cfg.data}: every record's prompt is among the {n_eval} held out; nothing is left"
                            f" to train on (lower --eval-examples, or add records)")
        return train, held, os.path.basename(cfg.data)
    train, held = train_eval_split(cfg.task, cfg.train_examples, cfg.eval_examples, seed=cfg.seed)
    return train, held, cfg.task


def _compute_precision(dtype: str) -> str | None:
    """The step's compute policy for ``--dtype``: bf16 products on a GPU only.

    On a CPU, XLA ran SmolLM2's paper step with bfloat16 products slower than
    in float32 (1.21 against 0.84 s, with 0.54 against 0.44 GB of
    temporaries, docs/precision.md): there ``--dtype bf16`` holds the frozen
    weights in bfloat16 and computes in float32.
    """
    return "bf16" if dtype == "bf16" and jax.default_backend() == "gpu" else None


def _model_of(model, graphdef, params):
    """The model to evaluate and save: ``params`` (LoRA adapters merged) in the form ``model`` came in."""
    if has_adapters(params):
        params = merge_adapters(params)
    if isinstance(model, LlamaWeights):
        return model.replace(params)
    return llama.merge(graphdef, params)


def _load_mixed(cfg: FinetuneConfig, source: str, held: dict | None = None):
    """The model with its frozen tensors in ``cfg.dtype`` / ``cfg.quantize`` (see :mod:`pockjax.models.llama.mixed`)."""
    from pockjax.models.llama.mixed import DTYPES, abstract_model, load_for_training

    def frozen_paths(config):
        scheme = (load_scheme_file(os.path.join(source, "scheme.json")) if cfg.resume
                  else llama_scheme(cfg.scheme, config, blocks=cfg.blocks))
        return scheme.frozen_paths(llama.flatten_params(abstract_model(config)[1]), lora_bases=True).__contains__

    return load_for_training(source, frozen_paths, quantize=cfg.quantize, dtype=DTYPES[cfg.dtype], held=held)


def _eval(model, tok, held, cfg, max_new):
    if not held:
        return None
    # 20 prompts per call: the prefill of every prompt at once held most of the
    # run's peak memory (40 SmolLM2 prompts: 0.7 GB of activations)
    return evaluate_model(model, tok, held, max_new_tokens=max_new, batch_size=min(len(held), 20))


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

#: Fields that may change on ``--resume`` (see :data:`RESULT_FIELDS`).
RESUME_MAY_CHANGE = ("steps", "save_every", "show", "progress", "eval_max_new_tokens", "mesh", "eval_every")

# The smallest value of each whole-number field (None allowed where the field defaults to None).
_INT_MIN = {"steps": 1, "batch_size": 1, "seed": 0, "train_examples": 1, "eval_examples": 0,
            "show": 0, "save_every": 0, "blocks": 1, "seq_len": 1, "eval_max_new_tokens": 1,
            "warmup": 0, "eval_every": 0, "grad_accum": 1, "max_seq_len": 1}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _validate(cfg: FinetuneConfig, steps_known: bool = True) -> None:
    """Refuses a number out of range (one line naming the option), before any work.

    ``steps_known=False``: ``cfg.steps`` may be a placeholder (a ``--resume``
    before the run's own options are read): the checks against it wait.
    """
    for name, low in _INT_MIN.items():
        value = getattr(cfg, name)
        if value is None and name in ("blocks", "seq_len", "eval_max_new_tokens", "max_seq_len"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise FinetuneError(f"{_flag(name)} must be a whole number >= {low}, got {value!r}")
        setattr(cfg, name, int(value))  # a numpy integer as a Python one: run.json holds it
    if cfg.lr is not None:
        lr = cfg.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating)) \
                or not (math.isfinite(lr) and lr > 0):
            raise FinetuneError(f"--lr must be a finite number > 0, got {lr!r}")
        cfg.lr = float(lr)
    if cfg.grad_clip is not None:
        c = cfg.grad_clip
        if isinstance(c, bool) or not isinstance(c, (int, float, np.floating)) or not (math.isfinite(c) and c > 0):
            raise FinetuneError(f"--grad-clip must be a finite number > 0, got {c!r}")
        cfg.grad_clip = float(c)
    if not isinstance(cfg.optimizer, str) or cfg.optimizer.lower() not in DEFAULT_LR:
        raise FinetuneError(f"--optimizer must be one of {', '.join(DEFAULT_LR)}, got {cfg.optimizer!r}")
    cfg.optimizer = cfg.optimizer.lower()
    if cfg.data is not None and not (isinstance(cfg.data, (str, os.PathLike)) and os.fspath(cfg.data).strip()):
        # (an empty --data once trained the built-in task without a word)
        raise FinetuneError(f"--data must name a JSONL file, got {cfg.data!r}; leave it out to train the"
                            f" built-in --task")
    if cfg.data is not None:  # run.json holds where it is, wherever --resume is run from later
        cfg.data = os.path.abspath(os.fspath(cfg.data))
    if cfg.train_replies not in REPLIES:
        raise FinetuneError(f"--train-replies must be one of {', '.join(REPLIES)}, got {cfg.train_replies!r}")
    if cfg.seq_len is not None and cfg.max_seq_len is not None:
        raise FinetuneError(f"--seq-len {cfg.seq_len} pads every row to one length, --max-seq-len"
                            f" {cfg.max_seq_len} each step's rows to their own bucket: give one of them")
    if cfg.eval_every and not cfg.eval_examples:
        raise FinetuneError("--eval-every computes the loss on the held-out examples: --eval-examples is 0")
    if cfg.eval_every and cfg.mesh:
        raise FinetuneError("--eval-every runs on one device for now: leave out --mesh / --devices")
    if steps_known and cfg.warmup and cfg.warmup >= cfg.steps:
        raise FinetuneError(f"--warmup {cfg.warmup} leaves no step at the full learning rate of a run of"
                            f" --steps {cfg.steps}; use a shorter warm-up")
    if steps_known and cfg.eval_every > cfg.steps:
        raise FinetuneError(f"--eval-every {cfg.eval_every} is beyond --steps {cfg.steps}: no held-out loss"
                            f" would ever be computed; use --eval-every {cfg.steps} or less")
    from pockjax.models.llama.mixed import DTYPES, QUANTIZE

    for name, choices in (("dtype", DTYPES), ("quantize", QUANTIZE), ("schedule", SCHEDULES)):
        if getattr(cfg, name) not in choices:
            *first, last = choices
            raise FinetuneError(f"--{name} must be {', '.join(first)} or {last}, got {getattr(cfg, name)!r}")
    if cfg.mesh and (cfg.dtype != "fp32" or cfg.quantize != "none"):
        raise FinetuneError(f"--mesh trains fp32 weights: --dtype {cfg.dtype} / --quantize {cfg.quantize}"
                            " run on one device (leave out --mesh / --devices)")
    if cfg.mesh:
        from pockjax.sharding import training_mesh_axes

        axes = training_mesh_axes(cfg.mesh)  # ShardingError on a malformed mesh or another axis
        split = math.prod(axes.values())
        if cfg.batch_size % split:
            raise FinetuneError(f"--batch-size {cfg.batch_size} cannot be split over the {split} devices"
                                f" of --mesh {cfg.mesh}: use a multiple of {split}")


def _check_out_path(out: str) -> None:
    """Refuses an ``--out`` that is a file or lies under one (before any work, not at the first save)."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise FinetuneError(f"--out {out} is an existing file, but a run writes a directory there: give a"
                            f" directory path, or remove the file")
    above = file_above(out)
    if above is not None:
        raise FinetuneError(f"--out {out} lies under {above}, which is a file, not a directory: give"
                            f" another --out")


def _same_option(name: str, given: Any, saved: FinetuneConfig, n_layers: int | None = None) -> bool:
    """Whether ``given`` means the same as the run's value of ``name``.

    ``blocks`` compares the block counts trained on the run's ``n_layers``
    (:func:`~pockjax.schemes.paper_blocks`: None is the registry's default).
    """
    from pockjax.train.schemes import SCHEMES, paper_blocks

    have = getattr(saved, name)
    if name == "lr":
        return float(DEFAULT_LR.get(saved.optimizer, 0) if have is None else have) == \
            float(DEFAULT_LR.get(saved.optimizer, 0) if given is None else given)
    if name == "blocks" and n_layers is not None:
        # a run saved before 2026-11-27 may hold more blocks than the model has (then capped)
        have = None if have is None else min(int(have), n_layers)
        return paper_blocks(n_layers, have) == paper_blocks(n_layers, given)
    if name == "data" and have and given:
        return os.path.abspath(have) == os.path.abspath(given)
    if name == "scheme" and have not in SCHEMES and given not in SCHEMES:
        return os.path.abspath(str(have)) == os.path.abspath(str(given))
    return have == given


def _run_layers(out: str) -> int | None:
    """The block count of the model in ``out`` (its ``config.json``), or None if unreadable."""
    try:
        return int(read_json_object(os.path.join(out, "config.json"))["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, pockjax.PockjaxError):
        return None


def _resume_config(cfg: FinetuneConfig, out: str, run: dict, given: set[str]) -> FinetuneConfig:
    """The run's own configuration with the allowed changes in ``given`` applied.

    Raises FinetuneError listing every option in ``given`` that differs from the
    run's and decides its result (:data:`RESULT_FIELDS`).
    """
    from pockjax.train.schemes import paper_blocks

    saved = FinetuneConfig.from_dict(run["config"])
    if "train_replies" not in run["config"]:  # saved before 2026-11-28, when only the last reply was trained
        saved = dataclasses.replace(saved, train_replies="last")
    try:  # (a run.json of an older run has no digest to catch an edit: "blocks": "3" failed on a compare)
        _validate(dataclasses.replace(saved))
    except FinetuneError as e:
        raise FinetuneError(f"cannot resume {out}: its run.json holds an option the run could not have had"
                            f" ({e}); it was damaged or edited: start a new run in another --out") from None
    n_layers = _run_layers(out)

    def shown(name, value):
        if value is None and name == "lr":
            return f"{DEFAULT_LR.get(saved.optimizer, 0):g} (default)"
        if value is None and name == "blocks":
            return "the default" if n_layers is None else f"{paper_blocks(n_layers)} (default)"
        return repr(value)

    diffs = [f"{_flag(k)}: the run has {shown(k, getattr(saved, k))}, given {shown(k, getattr(cfg, k))}"
             for k in RESULT_FIELDS
             if k in given and not _same_option(k, getattr(cfg, k), saved, n_layers)]
    if diffs:
        raise FinetuneError(
            f"cannot resume {out} with other options than its own ({'; '.join(diffs)}): they decide"
            f" the trained weights; leave them out to continue the run exactly, or start a new run"
            f" in another --out (only {', '.join(_flag(k) for k in RESUME_MAY_CHANGE)} may change)")
    keep = {k: getattr(cfg, k) for k in RESUME_MAY_CHANGE if k in given}
    if saved.blocks is not None and n_layers is not None and saved.blocks > n_layers:
        keep["blocks"] = n_layers  # saved before 2026-11-27, when more blocks than the model's were capped
    return dataclasses.replace(saved, **keep, out=cfg.out, resume=True)


def _check_metrics(out: str, metrics: dict) -> None:
    """Refuses a ``metrics.json`` whose curves a resumed run would carry on wrongly (or crash on, steps later)."""
    losses, held = metrics.get("losses", []), metrics.get("val_losses", [])
    norm, before = metrics.get("trained_weight_norm_start"), metrics.get("accuracy_before")
    checks = [
        (isinstance(losses, list) and all(map(is_finite_number, losses)), "'losses' is not a list of finite numbers"),
        (isinstance(held, list) and all(isinstance(v, list) and len(v) == 2 and type(v[0]) is int
                                        and (v[1] is None or is_finite_number(v[1])) for v in held),
         "'val_losses' is not a list of [step, finite loss or null] pairs"),
        (type(metrics.get("step", 0)) is int, "'step' is not a whole number"),
        (not isinstance(held, list) or not isinstance(losses, list)
         or all(isinstance(v, list) and v and type(v[0]) is int and 1 <= v[0] <= len(losses) for v in held)
         and [v[0] for v in held] == sorted({v[0] for v in held}),
         "'val_losses' names a step the run has not reached, or a step twice"),
        (norm is None or (is_finite_number(norm) and norm >= 0),
         "'trained_weight_norm_start' is not a finite number >= 0"),
        (before is None or (is_finite_number(before) and 0 <= before <= 1),
         "'accuracy_before' is not a number in [0, 1]"),
    ]
    bad = next((what for ok, what in checks if not ok), None)
    if bad:
        raise FinetuneError(f"cannot resume from {out}: its metrics.json is corrupt ({bad}); it cannot be"
                            f" continued: start a new run in another --out")


def _host_norm(params: Any, paths: list[str]) -> float:
    """L2 norm of the tensors ``paths`` of ``params`` (flat dict)."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(params[p]).astype(np.float64))))
                         for p in paths))


def _host_peak(params: Any, paths: list[str]) -> tuple[float, str | None]:
    """Largest magnitude among ``paths`` of ``params`` (flat dict), and its path."""
    peak, where = 0.0, None
    for path in paths:
        x = np.asarray(params[path])
        if x.size == 0:
            continue
        m = float(np.max(np.abs(x.astype(np.float32))))
        if m > peak or where is None:
            peak, where = m, path
    return peak, where


def finetune(config: FinetuneConfig, *, model: Any = None, tokenizer: Any = None,
             log: Callable[[str], None] | None = None,
             on_step: Callable[[int, float], None] | None = None,
             given: Any = None) -> FinetuneResult:
    """Fine-tunes a model with a sparse (or full) update scheme; see the module docstring.

    Args:
      config: The run's :class:`FinetuneConfig`.
      model, tokenizer: Use these instead of loading ``config.model`` (tests).
      log: Where text goes (default ``print``).
      on_step: Called after each step as ``on_step(step, loss)`` (``step``
        counts finished steps); an exception there stops the run like a crash.
      given: With ``config.resume``: the names of the fields the caller set
        (the CLI passes the options given on its command line); the others
        are the run's own. None: the fields that differ from
        :class:`FinetuneConfig`'s defaults. A field of :data:`RESULT_FIELDS`
        that differs from the run's is refused; ``steps`` may not be below
        the run's current step.

    Returns:
      A :class:`FinetuneResult`.

    Raises:
      FinetuneError, DataError, SequenceLengthError, SchemeError (including
      UnmatchedPatternError and a scheme that freezes every parameter),
      GGUFError, ShardingError (a --mesh it cannot train on), FileNotFoundError: bad
      input; raised before anything is written.
      NonFiniteError: the loss, a trained weight or its optimizer state became
        NaN or infinite, or the weights grew beyond :data:`WEIGHT_GROWTH_LIMIT`
        times their size at the start (the output directory keeps the last
        checkpoint; the failed step is never saved); or the model's weights
        are not finite to begin with.
    """
    log = log or (lambda s: print(s, flush=True))
    t_start = time.time()
    cfg = dataclasses.replace(config)
    _validate(cfg, steps_known=not cfg.resume)  # a resumed run's steps: below, once its own are read
    out = os.path.abspath(cfg.out) if cfg.out else None
    if out:
        _check_out_path(out)

    # -- 1. validate everything before touching the output directory ----------------
    resume_state = None
    if out:
        _recover(out)
    if cfg.resume:
        if not out:
            raise FinetuneError("--resume needs --out DIR (the directory of the run to continue)")
        if model is not None:
            raise FinetuneError(f"resume=True continues the run in {out} with the model it saved there, so a"
                                f" model passed in would be ignored: pass model=None")
        if not os.path.isfile(os.path.join(out, "run.json")):
            raise FinetuneError(f"nothing to resume: {out} holds no fine-tuning run (run.json)")
        try:
            saved_run = read_json_object(os.path.join(out, "run.json"))
            if not isinstance(saved_run.get("config"), dict):
                raise KeyError("config")
        except (OSError, KeyError, pockjax.PockjaxError) as e:
            raise FinetuneError(f"cannot resume from {out}: its run.json is unreadable"
                                f" ({type(e).__name__}: {e})") from None
        if given is None:
            defaults = FinetuneConfig()
            given = {f.name for f in dataclasses.fields(FinetuneConfig)
                     if getattr(cfg, f.name) != getattr(defaults, f.name)}
        resume_state = _read_state(out)  # first: the digests say whether run.json is the one the run wrote
        cfg = _resume_config(cfg, out, saved_run, set(given))
        _validate(cfg)
        reached = int(resume_state[0]["step"])
        if cfg.steps < reached:
            raise FinetuneError(f"--steps {cfg.steps} is below the step the run in {out} has"
                                f" reached ({reached}); its weights cannot go back: pass --steps"
                                f" >= {reached}, or none (the run's own, {saved_run['config'].get('steps')})")
        if cfg.schedule != "constant" and cfg.steps != saved_run["config"].get("steps"):
            raise FinetuneError(f"cannot resume {out} with --steps {cfg.steps}: its {cfg.schedule} schedule"
                                f" takes the learning rate to 0 at the run's own --steps"
                                f" {saved_run['config'].get('steps')}, so another --steps changes the rate of"
                                f" every step (the run would not continue exactly); leave out --steps, or"
                                f" start a new run in another --out")
        if cfg.data and saved_run.get("data_sha256") not in (None, file_sha256(cfg.data)):
            raise FinetuneError(f"cannot resume {out}: {cfg.data} changed since the run started"
                                f" (its SHA-256 differs from the one in run.json)")
    elif out and os.path.exists(out) and os.listdir(out):
        raise FinetuneError(f"{out} already exists and is not empty; pass --resume to continue"
                            f" the run in it, or choose another --out")
    tx = make_optimizer(cfg.optimizer, cfg.lr, schedule=cfg.schedule, warmup=cfg.warmup,
                        steps=cfg.steps, grad_clip=cfg.grad_clip)

    mixed = cfg.dtype != "fp32" or cfg.quantize != "none"
    if mixed and model is None:
        # a resumed run requantizes its float checkpoint into the formats it
        # trained with (a GGUF file's Q4_1 blocks stay Q4_1 under int8)
        held = saved_run.get("held_formats") if cfg.resume else None
        if held is not None and not (isinstance(held, dict) and all(
                isinstance(k, str) and v in quant.FORMATS for k, v in held.items())):
            raise FinetuneError(f"cannot resume from {out}: run.json's held_formats is not a map of"
                                f" parameter paths to {sorted(quant.FORMATS)}")
        model, tokenizer = _load_mixed(cfg, out if cfg.resume else cfg.model, held)
        if cfg.resume:
            log(f"resuming {out} at step {resume_state[0]['step']}")
    elif cfg.resume:
        model, tokenizer = llama.load_pretrained(out)
        log(f"resuming {out} at step {resume_state[0]['step']}")
    elif model is None:
        model, tokenizer = llama.load_pretrained(cfg.model)
    elif mixed and not isinstance(model, LlamaWeights):
        raise FinetuneError(f"dtype={cfg.dtype!r} / quantize={cfg.quantize!r} choose how finetune loads"
                            f" config.model, and a model passed in is already loaded: pass model=None, or"
                            f" pass the model with its frozen tensors already held (mixed.hold_frozen's params"
                            f" wrapped in pockjax.models.llama.mixed.LlamaWeights)")
    elif tokenizer is None:
        raise FinetuneError("pass a tokenizer with the model")
    else:
        cfg.model = "(given model)"
    if model.config.scan_layers:
        raise FinetuneError("finetune trains an unrolled model (scan_layers=False): pockjax"
                            " prunes the backward pass per block there")
    train, held, data_name = _examples(cfg)
    refuse_control_text(tokenizer, held, what="held-out example")  # the training ones: the Batcher
    # one optimizer update's rows: grad_accum micro-batches of batch_size
    try:
        batcher = Batcher(tokenizer, train, batch_size=cfg.batch_size * cfg.grad_accum, seq_len=cfg.seq_len,
                          seed=cfg.seed, max_seq_len=model.config.max_seq_len, bucket_limit=cfg.max_seq_len,
                          replies=cfg.train_replies)
    except SequenceLengthError as e:  # in the command's words: there is no truncate option
        raise SequenceLengthError(str(e).replace("raise seq_len to at least", "raise --seq-len to at least").replace(
            " or pass truncate=True", ", or leave --seq-len out (rows as long as the longest example)")) from None
    if cfg.resume:
        scheme = load_scheme_file(os.path.join(out, "scheme.json"))
    else:
        scheme = llama_scheme(cfg.scheme, model.config, blocks=cfg.blocks)
    graphdef, params = (model.graphdef, model.params) if isinstance(model, LlamaWeights) else llama.split(model)
    if scheme.has_lora and cfg.resume:
        if mixed:
            raise FinetuneError(f"cannot resume {out}: resuming LoRA adapters over --dtype {cfg.dtype} /"
                                f" --quantize {cfg.quantize} weights is not supported yet; start a new run")
        params = _restore_adapters(out, params, scheme)
    elif scheme.has_lora:
        params = add_adapters(params, scheme, seed=cfg.seed)
    description = scheme.describe(quant.abstract(params))  # raises UnmatchedPatternError on a mismatch
    if description.trainable == 0:
        raise SchemeError(f"the scheme {scheme.name or cfg.scheme} freezes every parameter of the"
                          f" model: fine-tuning would train nothing; give some parameters a 'full'"
                          f" or channels(...) rule")
    # QTensor values stay whole (frozen, never read); a LoRA tensor is its base and adapters
    flat_params = expand_flat(llama.flatten_params(params))
    if cfg.quantize != "none" and not any(quant.is_qtensor(x) and x.qtype != "bf16" for x in flat_params.values()):
        raise FinetuneError(f"--quantize {cfg.quantize} holds the frozen matrices block-quantized, but the scheme"
                            f" {scheme.name or cfg.scheme} freezes none that can be (each is trained, or its"
                            f" blocked axis is not a multiple of {quant.BLOCK}): it would change nothing; leave"
                            f" out --quantize")
    bad = first_non_finite(weights=params)
    if bad:
        raise NonFiniteError(f"the model {out if cfg.resume else cfg.model} holds non-finite"
                             f" weights ({bad}); fine-tuning cannot start from it")
    rules = scheme.resolve(list(flat_params), [tuple(x.shape) for x in flat_params.values()])
    trained_paths = [p for p, r in zip(flat_params, rules) if not isinstance(r, Frozen)]
    full_paths = [p for p, r in zip(flat_params, rules) if isinstance(r, Full)]
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
        # a leaf of another dtype (a float step count, float16 moments) would be cast without a
        # word, and a NaN in an integer leaf cast to garbage: check before converting
        for k, (v, ref) in enumerate(zip(leaves, opt_state.leaves)):
            if v.dtype.kind == "V" and v.dtype.itemsize == np.dtype(ref.dtype).itemsize:
                leaves[k] = v = v.view(ref.dtype)  # np.savez keeps bfloat16 as raw 2-byte records
            if np.dtype(v.dtype) != np.dtype(ref.dtype):
                raise FinetuneError(f"cannot resume from {out}: optimizer state leaf {k} in"
                                    f" state/opt_state.npz is {v.dtype}, the optimizer keeps it as"
                                    f" {np.dtype(ref.dtype).name}: the file was not written by this run")
        bad = first_non_finite(opt_state=list(leaves))
        if bad:
            raise NonFiniteError(f"cannot resume from {out}: its optimizer state is not finite ({bad})")
        opt_state = jax.tree_util.tree_unflatten(
            jax.tree.structure(opt_state),
            [jnp.asarray(v, dtype=ref.dtype) for v, ref in zip(leaves, opt_state.leaves)])
        start = int(trainer["step"])
        metrics = read_json_object(os.path.join(out, "metrics.json"), what="run metrics")
        _check_metrics(out, metrics)
        if metrics.get("step", start) != start or len(metrics.get("losses", ())) != start:
            raise FinetuneError(f"cannot resume from {out}: its metrics (step {metrics.get('step')},"
                                f" {len(metrics.get('losses', ()))} losses) disagree with its"
                                f" training state (step {start})")
    else:
        opt_state = pockjax.init_opt_state(tx, params, scheme)
        start = 0
        metrics = {"losses": [], "accuracy_before": None}
    mesh = None
    if cfg.mesh:
        from jax.sharding import PartitionSpec

        from pockjax.sharding import batch_axes, make_mesh, shard, shard_batch, shard_train_state

        mesh = make_mesh(cfg.mesh)
        params, opt_state = shard_train_state(params, opt_state, mesh)
        log(f"mesh {cfg.mesh}: {mesh.size} {mesh.devices.flat[0].platform} devices, the batch split"
            f" over {' x '.join(batch_axes(mesh))}"
            + (", parameters and optimizer state over fsdp" if "fsdp" in mesh.shape else ""))
    # The size of the fully trained weights at the start of the run (kept across resumes).
    if metrics.get("trained_weight_norm_start") is None:
        metrics["trained_weight_norm_start"] = _host_norm(flat_params, full_paths)
    norm_start = metrics["trained_weight_norm_start"]
    health_limit = (WEIGHT_GROWTH_LIMIT * norm_start) ** 2 if norm_start > 0 else math.inf

    trainable, total = description.trainable, description.total
    source = out if cfg.resume else cfg.model
    log(f"model {source}: {total / 1e6:.1f}M parameters,"
        f" {model.config.n_layers} blocks")
    log(f"scheme {scheme.name or cfg.scheme}: {trainable / 1e6:.2f}M trainable"
        f" ({100 * trainable / total:.1f}%)")
    rows = (f"{cfg.grad_accum} x {cfg.batch_size} (accumulated)" if cfg.grad_accum > 1
            else f"{cfg.batch_size}")
    lengths = (f"{batcher.seq_len}" if cfg.max_seq_len is None
               else f"{' / '.join(map(str, batcher.buckets))} (buckets)")
    log(f"data {data_name}: {len(train)} training / {len(held)} held-out examples;"
        f" batch {rows} x {lengths} tokens, answer window"
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
    release_free_heap()  # what loading and generating freed, given back before the step's block
    window = batcher.answer_window

    # The step also returns a health scalar: the squared norm of the fully
    # trained weights, not finite if the loss or one of them is not.
    step_fn = pockjax.compile(answer_train_step(graphdef, tx, window, health=scheme, accum=cfg.grad_accum),
                              scheme=scheme, xla_options=ANSWER_STEP_XLA_OPTIONS,
                              precision=_compute_precision(cfg.dtype))

    def batch_at(i, length=None):  # length: a placeholder batch of that row length
        rows = batcher.batch(i) if length is None else batcher.placeholder(length)
        batch = {k: jnp.asarray(v) for k, v in rows.items()}
        if cfg.grad_accum > 1:  # (K * B, ...) -> (K, B, ...): micro-batch k is rows k*B .. k*B + B - 1
            batch = {k: v.reshape((cfg.grad_accum, cfg.batch_size) + v.shape[1:]) for k, v in batch.items()}
        if mesh is not None:  # with --grad-accum: each micro-batch split over the devices
            batch = (shard_batch(batch, mesh) if cfg.grad_accum == 1 else
                     shard(batch, mesh, {"**": PartitionSpec(None, batch_axes(mesh))}))
        return batch

    if cfg.resume:  # the same data, options and weights must give the same rows as before
        saved_shape = saved_run.get("effective", {})
        now = {"seq_len": batcher.seq_len, "buckets": list(batcher.buckets), "answer_window": window}
        changed = [f"{k} {saved_shape[k]} -> {v}" for k, v in now.items() if k in saved_shape and saved_shape[k] != v]
        if changed:
            raise FinetuneError(f"cannot resume {out}: its examples now encode to other rows ({'; '.join(changed)}),"
                                f" so the run would not continue as it started; the tokenizer or its chat template"
                                f" changed (another pockjax, tokenizers or jinja2 version?): start a new run in"
                                f" another --out")
    t = time.time()
    # the step compiled for every row length the run pads to, before the first step (called
    # directly: a compiled function called with alternating shapes first tries its last one)
    compiled = {length: step_fn.lower(params, opt_state, batch_at(None, length)).compile()
                for length in (batcher.buckets if start < cfg.steps else ())}
    compile_s = time.time() - t
    release_free_heap()  # the compiler's working memory
    if start < cfg.steps:
        shapes = "" if len(batcher.buckets) == 1 else f" for {len(batcher.buckets)} row lengths"
        log(f"compiled the sparse train step{shapes} in {compile_s:.1f} s")

    run = {"config": cfg.to_dict(), "scheme": scheme.to_dict(),
           "effective": {"lr": cfg.lr or DEFAULT_LR[cfg.optimizer], "seq_len": batcher.seq_len,
                         "buckets": list(batcher.buckets),
                         "answer_window": window, "trainable_params": description.trainable}}
    if cfg.data:
        run["data_sha256"] = file_sha256(cfg.data)
    if isinstance(model, LlamaWeights):
        run["held_formats"] = {path: x.qtype for path, x in llama.flatten_params(params).items()
                               if quant.is_qtensor(x)}
    last_saved = [start if cfg.resume else None]
    events = EventsLog.for_run(out, start, t_start)  # this run's TensorBoard file

    def diverged(step, loss, health, new_params, new_opt_state):
        """The NonFiniteError of a step whose result is unusable (read on the host)."""
        kept = (f"{out} keeps the checkpoint of step {last_saved[0]}" if out and last_saved[0]
                is not None else "nothing was saved")
        hint = (f"start a new run with a lower --lr (this one: {cfg.lr or DEFAULT_LR[cfg.optimizer]:g})"
                f"{' or check the data' if cfg.data else ''}")
        flat_new = expand_flat(llama.flatten_params(new_params))
        bad = first_non_finite(params={p: flat_new[p] for p in trained_paths},
                               opt_state=new_opt_state.leaves)
        if bad or not math.isfinite(loss):
            what = " and ".join(([f"the loss is {loss}"] if not math.isfinite(loss) else [])
                                + ([f"{bad} is not finite"] if bad else []))
        else:
            peak, where = _host_peak(flat_new, full_paths)
            what = (f"the norm of the trained weights reached {math.sqrt(health):.3g}, over"
                    f" {WEIGHT_GROWTH_LIMIT:g} times its value at the start ({norm_start:.3g};"
                    f" largest weight {peak:.3g}, in {where}): the updates diverge")
        return NonFiniteError(f"training stopped at step {step}: {what}; this step was not saved"
                              f" and {kept}; {hint}")

    def save(step):
        # Nothing non-finite is ever written (channel-ruled tensors are not in
        # the step's health scalar: they are checked here).
        flat_now = expand_flat(llama.flatten_params(params))
        bad = first_non_finite(params={p: flat_now[p] for p in trained_paths},
                               opt_state=opt_state.leaves)
        if bad:
            raise NonFiniteError(f"not saving step {step}: {bad} is not finite; {out} keeps the"
                                 f" checkpoint of step {last_saved[0]}")
        metrics["step"] = step
        write_output(out, model=_model_of(model, graphdef, params), tokenizer=tokenizer,
                     scheme=scheme, metrics=metrics, run=run, opt_state=opt_state,
                     step=step, adapters={p: x for p, x in llama.flatten_params(params).items()
                                                   if isinstance(x, LoraTensor)}, events=events)
        last_saved[0] = step
        # What writing freed, given back: the next step's temporaries, one large block, no longer
        # fit the heap's holes, and the heap grew by that block (int4 run: 1.29 -> 1.88 GB at step 50).
        release_free_heap()

    val_loss = val_batch = None
    if cfg.eval_every:  # one batch of every held-out example, loss on what training trains of it
        held_batcher = Batcher(tokenizer, held, batch_size=len(held), seed=cfg.seed,
                               max_seq_len=model.config.max_seq_len, truncate=True, replies=cfg.train_replies)
        val_batch = {k: jnp.asarray(v) for k, v in held_batcher.batch(0).items()}

        def held_loss(p, b, window=held_batcher.answer_window):
            return llama.answer_loss(llama.merge(graphdef, p), b, window)

        from pockjax.transforms.dequantize import quantized_jit

        val_loss = quantized_jit(held_loss) if isinstance(model, LlamaWeights) else jax.jit(held_loss)
    step_times: list[float] = []
    step_tokens: list[int] = []
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=start, disable=not cfg.progress, unit="step",
               dynamic_ncols=True, file=sys.stderr)
    t_train = time.time()
    try:
        for i in range(start, cfg.steps):
            t = time.time()
            batch = batch_at(i)
            new_params, new_opt_state, loss, health = compiled[batch["tokens"].shape[-1]](params, opt_state, batch)
            loss, health = float(loss), float(health)
            if not (math.isfinite(loss) and math.isfinite(health)) or health > health_limit:
                raise diverged(i + 1, loss, health, new_params, new_opt_state)
            params, opt_state = new_params, new_opt_state
            dt = time.time() - t
            step_times.append(dt)
            step_tokens.append(int(batch["tokens"].size))
            events.wall_times[i + 1] = time.time()
            metrics["losses"].append(round(loss, 5))
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{step_tokens[-1] / dt:.0f}",
                            rss=_gb(rss_bytes()), refresh=False)
            bar.update(1)
            if val_loss is not None and (i + 1) % cfg.eval_every == 0:
                v = float(val_loss(params, val_batch))
                v = round(v, 5) if math.isfinite(v) else None  # JSON has no NaN: recorded as null, and said
                metrics.setdefault("val_losses", []).append([i + 1, v])
                line = (f"step {i + 1}: loss {loss:.4f}, held-out loss "
                        + (f"{v:.4f}" if v is not None else "not finite (recorded as null)"))
                if cfg.progress:
                    bar.write(line, file=sys.stderr)
                else:
                    log(line)
            if on_step is not None:
                on_step(i + 1, loss)
            if out and cfg.save_every and (i + 1) % cfg.save_every == 0 and i + 1 < cfg.steps:
                save(i + 1)
    finally:
        bar.close()
    train_s = time.time() - t_train

    # -- 4. evaluate after, summarise, write ----------------------------------------------
    if mesh is not None:  # generation runs on one device
        params = jax.device_put(params, jax.devices()[0])
    model = _model_of(model, graphdef, params)
    release_free_heap()  # the steps' working memory, before generation's
    t = time.time()
    after = _eval(model, tokenizer, held, cfg, max_new)
    eval_after_s = time.time() - t
    if after is not None:
        metrics["accuracy_after"] = after["accuracy"]
        metrics["predictions_after"] = after["predictions"][:max(cfg.show, 0)]
        _show("after fine-tuning", held, after, cfg.show, log)
    steady = step_times[1:] if len(step_times) > 1 else step_times
    s_per_step = float(np.mean(steady)) if steady else None  # None: no step ran (JSON has no NaN)
    tokens_per_step = float(np.mean(step_tokens[1:] if len(step_tokens) > 1 else step_tokens or [0]))
    wall = time.time() - t_start
    metrics.update({
        "model": cfg.model, "data": data_name, "scheme": scheme.name or cfg.scheme,
        "trainable_params": trainable, "total_params": total,
        "steps": cfg.steps, "steps_this_run": len(step_times), "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum, "seq_len": batcher.seq_len, "buckets": list(batcher.buckets),
        "compile_seconds": compile_s,
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
    rows = (f"{m['grad_accum']} x {m['batch_size']}" if m.get("grad_accum", 1) > 1 else f"{m['batch_size']}")
    lengths = (f"{m['seq_len']}" if len(m.get("buckets") or ()) <= 1
               else f"<= {m['seq_len']} (buckets {'/'.join(map(str, m['buckets']))})")
    lines.append(f"training   {m['steps_this_run']} steps (to step {m['steps']}) of"
                 f" {rows} x {lengths} tokens in {m['train_seconds_this_run'] / 60:.1f} min:"
                 f" {m['seconds_per_step'] or 0:.2f} s/step, {tps or 0:.0f} tokens/s"
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
        plotted = os.path.exists(os.path.join(out, PLOT_FILE))
        lines.append(f"curves     {os.path.join(out, 'metrics.csv')}"
                     + (f", {os.path.join(out, PLOT_FILE)}" if plotted
                        else " (the loss plot needs Matplotlib: pip install 'pockjax[plot]')"))
    for line in lines:
        log(line)

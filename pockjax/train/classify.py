"""Sparse fine-tuning of pretrained classifiers: MobileNetV2 on images, a BERT encoder on text.

``pockjax finetune --model mobilenetv2 --task mnist5k`` and ``pockjax finetune
--model all-minilm-l6-v2 --task tweet_polarity`` run :func:`finetune_classifier`:
load the pretrained model with a fresh head for the task's classes, resolve the
update scheme from the one registry (:mod:`pockjax.schemes`; ``paper``,
``channels``, ``bias-only``, ``last-blocks``, ``head-only``, ``full``...),
compile the user-style NNX train step below with :func:`pockjax.compile`,
train with a progress bar, and measure held-out accuracy before and after.
BatchNorm's running statistics update in train mode under every scheme, as in
PyTorch: they are state the step does not differentiate, so the scheme never
freezes them.

The output directory (``--out``) is written atomically: ``model.safetensors``
(every variable of the model: parameters and BatchNorm statistics, by path),
``scheme.json``, ``metrics.json`` and ``run.json``.

Example (a tiny random MobileNetV2 of three blocks; the real run loads ImageNet weights):
  >>> import numpy as np
  >>> from pockjax.models.mobilenetv2 import MobileNetV2, MobileNetV2Config
  >>> from flax import nnx
  >>> config = MobileNetV2Config(num_classes=3, width_mult=0.25,
  ...                            inverted_residual_setting=((1, 16, 1, 1), (6, 24, 2, 2)))
  >>> model = MobileNetV2(config, rngs=nnx.Rngs(0))
  >>> x = np.random.default_rng(0).random((8, 32, 32, 3), np.float32)
  >>> y = np.arange(8, dtype=np.int32) % 3
  >>> scheme = resolve_classifier_scheme("paper", model.config)
  >>> losses = train_classifier(model, scheme, [(x, y)] * 2, optimizer="adam", lr=1e-3)
  >>> len(losses), all(np.isfinite(losses))
  (2, True)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax
from pockjax.errors import InputError, NonFiniteError, UnknownModelError, UnknownTaskError
from pockjax.io.atomic import atomic_directory, write_json
from pockjax.io.safetensors import write_safetensors
from pockjax.paths import leaf_paths
from pockjax.schemes import check_scheme, ignores_blocks, ignores_fraction

__all__ = [
    "CLASSIFIERS",
    "ClassifierConfig",
    "ClassifierSpec",
    "classify_train_step",
    "evaluate_classifier",
    "finetune_classifier",
    "resolve_classifier_scheme",
    "train_classifier",
]


# -- the models -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClassifierSpec:
    """A pretrained model ``pockjax finetune`` fine-tunes as a classifier.

    Attributes:
      name: the ``--model`` name.
      kind: ``"vision"`` (tasks of :data:`pockjax.data.vision.VISION_TASKS`)
        or ``"text"`` (:data:`pockjax.data.text_classification.TEXT_TASKS`).
      default_task: the task ``--task`` defaults to for this model.
      summary: one line for ``--help``.
      family: the scheme family of its config (:func:`pockjax.schemes.family_of`),
        also the name of its package under ``pockjax.models``.
    """

    name: str
    kind: str
    default_task: str
    summary: str
    family: str

    def scheme_family(self) -> str:
        """:attr:`family`, its named schemes registered (its package imported): what
        :mod:`pockjax.schemes`' lookups take. Without the import they know only the
        schemes of every family, and refuse nothing of the others.

        Example:
          >>> from pockjax.schemes import ignores_fraction
          >>> ignores_fraction("paper", CLASSIFIERS["all-minilm-l6-v2"].scheme_family())
          True
        """
        import importlib

        importlib.import_module(f"pockjax.models.{self.family}")
        return self.family


#: ``--model`` names of the classifiers, by name.
CLASSIFIERS: dict[str, ClassifierSpec] = {
    "mobilenetv2": ClassifierSpec("mobilenetv2", "vision", "mnist5k",
                                  "MobileNetV2 with torchvision's ImageNet weights", "mobilenetv2"),
    "all-minilm-l6-v2": ClassifierSpec("all-minilm-l6-v2", "text", "tweet_polarity",
                                       "sentence-transformers' all-MiniLM-L6-v2 BERT encoder", "bert"),
}


def tasks_for(kind: str) -> dict[str, str]:
    """The task registry (name -> description) of a model kind."""
    if kind == "vision":
        from pockjax.data.vision import VISION_TASKS

        return dict(VISION_TASKS)
    from pockjax.data.text_classification import TEXT_TASKS

    return dict(TEXT_TASKS)


def _load(spec: ClassifierSpec, num_classes: int, seed: int):
    """``(model, encode)``: the pretrained model with a fresh head; ``encode(split part)``."""
    from flax import nnx

    rngs = nnx.Rngs(seed, dropout=seed + 1)
    if spec.name == "mobilenetv2":
        from pockjax.models import mobilenetv2

        model = mobilenetv2.load_pretrained(num_classes=num_classes, rngs=rngs)
        return model, None
    from pockjax.models import bert

    model, tokenizer = bert.load_pretrained(spec.name, num_classes=num_classes, rngs=rngs)
    return model, tokenizer


# -- the step ---------------------------------------------------------------------------


def classify_train_step(model, optimizer, *inputs_and_labels):
    """An ordinary NNX classification step: cross-entropy, ``nnx.value_and_grad``, update.

    ``inputs_and_labels`` is the model's inputs followed by the int labels.
    pockjax compiles it with a scheme; nothing here knows about sparsity.
    """
    from flax import nnx

    *inputs, labels = inputs_and_labels

    def loss_fn(model):
        logits = model(*inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def resolve_classifier_scheme(name: str, config: Any, *, blocks: int | None = None,
                              fraction: float = 0.5) -> pockjax.UpdateScheme:
    """The registry's scheme ``name`` (or a scheme file) for a classifier's config."""
    from pockjax.schemes import resolve_scheme

    return resolve_scheme(name, config, blocks=blocks, fraction=fraction)


def _optimizer(name: str, lr: float) -> optax.GradientTransformation:
    from pockjax.train.finetune import make_optimizer

    return make_optimizer(name, lr)


def train_classifier(model, scheme: pockjax.UpdateScheme, batches: Iterable[Sequence[np.ndarray]], *,
                     optimizer: str = "adam", lr: float = 1e-3, step=None,
                     on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Trains ``model`` in place on ``batches`` (each: inputs..., labels); returns the losses.

    The model is put in train mode (BatchNorm batch statistics, dropout on);
    ``step`` is a compiled step to reuse (default: :func:`classify_train_step`
    compiled with ``scheme``). Raises :class:`NonFiniteError` on a non-finite
    loss, before the bad step's result is kept.
    """
    from flax import nnx

    model.train()
    opt = nnx.Optimizer(model, _optimizer(optimizer, lr), wrt=scheme.nnx_wrt())
    step = step or pockjax.compile(classify_train_step, scheme=scheme)
    losses = []
    for i, batch in enumerate(batches):
        *inputs, labels = batch
        _check_labels(model, inputs, labels, f"training batch {i + 1}")
        loss = float(step(model, opt, *[jnp.asarray(b) for b in batch]))
        if not math.isfinite(loss):
            raise NonFiniteError(f"training stopped at step {i + 1}: the loss is {loss};"
                                 " lower the learning rate")
        losses.append(loss)
        if on_step is not None:
            on_step(i + 1, loss)
    return losses


@functools.lru_cache(maxsize=1)
def _predictor():
    """One ``nnx.jit`` of the argmax prediction, so that its compilations are cached across calls."""
    from flax import nnx

    @nnx.jit
    def predict(m, *x):
        return jnp.argmax(m(*x), axis=-1)

    return predict


def evaluate_classifier(model, inputs: Sequence[np.ndarray], labels: np.ndarray, *,
                        batch_size: int = 128) -> float:
    """Accuracy of ``model`` in eval mode on ``inputs``/``labels``, in batches; the model is
    left in the mode it came in. Labels are checked (one per example, in ``[0, classes)``).

    Example:
      >>> from flax import nnx
      >>> m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> 0.0 <= evaluate_classifier(m, [np.ones((5, 2), np.float32)], np.zeros(5, np.int32)) <= 1.0
      True
    """
    n = len(labels)
    if n == 0:
        raise InputError("no held-out examples to evaluate on")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise InputError(f"batch_size must be a whole number >= 1, got {batch_size!r}")  # (-1 gave 0.0)
    _check_labels(model, inputs, labels, "the held-out examples")
    modes = _modes(model)
    if hasattr(model, "eval"):
        model.eval()
    predict = _predictor()
    right = 0
    try:
        for s in range(0, n, batch_size):
            part = [jnp.asarray(x[s:s + batch_size]) for x in inputs]
            right += int(jnp.sum(predict(model, *part) == jnp.asarray(labels[s:s + batch_size])))
    finally:
        for module, attr, value in modes:  # the mode it came in (train or eval), as it was
            setattr(module, attr, value)
        if not modes and hasattr(model, "train"):  # a model whose mode cannot be read: train mode
            model.train()
    return right / n


def _modes(model) -> list:
    """``(module, attribute, value)`` of the train/eval switches of ``model``'s modules."""
    from flax import nnx

    if not isinstance(model, nnx.Module):
        return []
    return [(m, attr, getattr(m, attr)) for _, m in nnx.iter_modules(model)
            for attr in ("deterministic", "use_running_average") if hasattr(m, attr)]


def _check_labels(model, inputs, labels, where: str) -> None:
    """Labels one per example (1-D, as long as every input), whole numbers in ``[0, classes)``:
    a shorter label array was broadcast against the predictions (an accuracy above 1), and a
    label of -1 trained as the last class."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise InputError(f"{where}: labels must be one per example (1-D), got shape {labels.shape}")
    for k, x in enumerate(inputs):
        if len(x) != len(labels):
            raise InputError(f"{where}: input {k} has {len(x)} examples, the labels {len(labels)}")
    if labels.size and not np.all(np.equal(np.mod(labels, 1), 0)):
        raise InputError(f"{where}: labels must be whole numbers (class indices)")
    classes = getattr(getattr(model, "config", None), "num_classes", None)
    low, high = (labels.min(), labels.max()) if labels.size else (0, 0)
    if low < 0 or (classes is not None and high >= classes):
        raise InputError(f"{where}: labels must be class indices in [0, {classes if classes else 'classes'}),"
                         f" got {int(low) if low < 0 else int(high)}")


# -- the command ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """The options of ``pockjax finetune`` for a classifier (see :data:`CLASSIFIERS`)."""

    model: str = "mobilenetv2"
    task: str | None = None          # None: the model's default task
    scheme: str = "paper"
    blocks: int | None = None
    fraction: float = 0.5
    optimizer: str = "adam"
    lr: float | None = None          # None: 1e-3 (adam/adamw), 0.01 (sgd)
    steps: int = 150
    batch_size: int = 32
    image_size: int = 64
    seq_len: int = 64
    seed: int = 0
    train_per_class: int | None = 400
    eval_examples: int = 500
    out: str | None = None
    progress: bool = True

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _spec(name: str) -> ClassifierSpec:
    spec = CLASSIFIERS.get(name)
    if spec is None:
        raise UnknownModelError(f"unknown classifier model {name!r}; known: {', '.join(CLASSIFIERS)}")
    return spec


def _lr(cfg: ClassifierConfig) -> float:
    return cfg.lr if cfg.lr is not None else (0.01 if cfg.optimizer == "sgd" else 1e-3)


def _splits(spec: ClassifierSpec, cfg: ClassifierConfig, task: str):
    """The task's seeded held-out split (images at ``cfg.image_size``, or texts)."""
    if spec.kind == "vision":
        from pockjax.data.vision import load_vision_task

        return load_vision_task(task, seed=cfg.seed, image_size=cfg.image_size)
    from pockjax.data.text_classification import load_text_task

    return load_text_task(task, seed=cfg.seed)


def _data(spec: ClassifierSpec, cfg: ClassifierConfig, s, tokenizer):
    """``(train inputs, train labels, test inputs, test labels)`` of split ``s`` as model inputs."""
    if spec.kind == "vision":
        from pockjax.models.mobilenetv2 import normalize

        tr_x, tr_y, te_x, te_y = s.train_images, s.train_labels, s.test_images, s.test_labels
        enc = lambda x: [np.asarray(normalize(x))]  # noqa: E731
    else:
        tr_x, tr_y, te_x, te_y = s.train_texts, s.train_labels, s.test_texts, s.test_labels
        enc = lambda x: list(tokenizer.encode_batch(list(x), cfg.seq_len, pad_to_max=True))  # noqa: E731
    rng = np.random.default_rng(cfg.seed)
    if cfg.train_per_class:
        keep = np.concatenate([rng.permutation(np.flatnonzero(tr_y == c))[:cfg.train_per_class]
                               for c in range(len(s.class_names))])
        keep = rng.permutation(keep)
    else:
        keep = rng.permutation(len(tr_y))
    te_keep = np.random.default_rng(cfg.seed + 1).permutation(len(te_y))[:cfg.eval_examples]
    take = lambda xs, idx: (xs[idx] if isinstance(xs, np.ndarray) else [xs[i] for i in idx])  # noqa: E731
    train_inputs = enc(take(tr_x, keep))
    test_inputs = enc(take(te_x, te_keep)) if len(te_keep) else None
    return train_inputs, tr_y[keep], test_inputs, te_y[te_keep]


def _batches(inputs: list[np.ndarray], labels: np.ndarray, batch_size: int, steps: int, seed: int):
    """``steps`` shuffled batches (epochs reshuffled), each ``(*inputs, labels)``."""
    n = len(labels)
    if n < batch_size:
        raise InputError(f"--batch-size {batch_size} is larger than the {n} training examples")
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    pos = 0
    for _ in range(steps):
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        idx = order[pos:pos + batch_size]
        pos += batch_size
        yield (*[x[idx] for x in inputs], labels[idx])


def _validate(cfg: ClassifierConfig, spec: ClassifierSpec, task: str) -> None:
    tasks = tasks_for(spec.kind)
    if task.replace("-", "_") not in tasks:
        raise UnknownTaskError(f"unknown {spec.kind} task {task!r} for --model {spec.name};"
                               f" known: {', '.join(sorted(tasks))}")
    for name in ("steps", "batch_size", "image_size", "seq_len"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    for name in ("eval_examples", "seed") + (("train_per_class",) if cfg.train_per_class is not None else ()):
        v = getattr(cfg, name)  # (a negative train_per_class dropped that many examples of each class)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InputError(f"--{name.replace('_', '-')} must be a whole number >= 0, got {v!r}")
    if cfg.out is not None and not str(cfg.out).strip():  # (the run trained and saved nothing)
        raise InputError("--out is empty: give the directory the run goes to, or leave it out")
    if not (0 < cfg.fraction <= 1):
        raise InputError(f"--fraction must be in (0, 1], got {cfg.fraction}")
    # what is refused by name is refused before the model loads
    family = spec.scheme_family()
    check_scheme(cfg.scheme, family)
    if cfg.blocks is not None and ignores_blocks(cfg.scheme, family):  # (it trained as if not given)
        raise InputError(f"--blocks: --scheme {cfg.scheme} trains no number of last blocks; leave --blocks out")
    if cfg.fraction != ClassifierConfig.fraction and ignores_fraction(cfg.scheme, family):
        raise InputError(f"--fraction is the 'channels' scheme's; --scheme {cfg.scheme} does not take it")
    _optimizer(cfg.optimizer, _lr(cfg))  # an unknown optimizer or a bad learning rate


def _variables(model) -> dict[str, np.ndarray]:
    """Every array variable of an NNX model (parameters, BatchNorm statistics) by path."""
    from flax import nnx

    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    paths = leaf_paths(state)
    return {p: np.asarray(x) for p, x in zip(paths, jax.tree.leaves(state))}


def finetune_classifier(config: ClassifierConfig, *, log: Callable[[str], None] | None = None
                        ) -> dict:
    """Fine-tunes a pretrained classifier on a shipped task; returns the metrics dict.

    Raises:
      UnknownModelError, UnknownTaskError, InputError, SchemeError: bad input
        (an ``out`` that exists and is not empty among it), before anything is
        loaded or written.
      NonFiniteError: the loss became NaN or infinite (nothing is written).
    """
    log = log or (lambda s: print(s, flush=True))
    spec = _spec(config.model)
    task = (config.task or spec.default_task).replace("-", "_")
    cfg = dataclasses.replace(config, task=task)
    _validate(cfg, spec, task)
    t_start = time.time()

    from pockjax.io.atomic import remove_stale_temporaries

    if cfg.out:
        remove_stale_temporaries(os.path.dirname(os.path.abspath(cfg.out)))
        if os.path.exists(cfg.out) and (not os.path.isdir(cfg.out) or os.listdir(cfg.out)):
            # the run's directory takes the place of --out whole: never over a user's files or another run
            raise InputError(f"{cfg.out} already exists and is not an empty directory; a classifier run"
                             f" replaces --out whole, so choose another --out (or remove it yourself)")
    tasks = tasks_for(spec.kind)
    splits = _splits(spec, cfg, task)  # its classes decide the head
    classes = splits.class_names
    model, tokenizer = _load(spec, len(classes), cfg.seed)
    scheme = resolve_classifier_scheme(cfg.scheme, model.config, blocks=cfg.blocks, fraction=cfg.fraction)
    from flax import nnx

    description = scheme.describe(nnx.state(model, nnx.Param))
    trainable, total = description.trainable, description.total
    log(f"model {spec.name} ({total / 1e6:.2f}M parameters), task {task} ({len(classes)} classes:"
        f" {tasks[task]}), scheme {scheme.name or cfg.scheme}: {trainable / 1e6:.3f}M trainable"
        f" ({100 * trainable / max(total, 1):.1f}%)")
    train_x, train_y, test_x, test_y = _data(spec, cfg, splits, tokenizer)
    log(f"data: {len(train_y)} training examples, {len(test_y)} held out")

    t = time.time()
    before = evaluate_classifier(model, test_x, test_y) if test_x is not None else None
    eval_s = time.time() - t
    if before is not None:
        log(f"held-out accuracy before fine-tuning: {100 * before:.1f}% ({eval_s:.1f} s)")

    step = pockjax.compile(classify_train_step, scheme=scheme)
    model.train()
    opt = nnx.Optimizer(model, _optimizer(cfg.optimizer, _lr(cfg)), wrt=scheme.nnx_wrt())
    batches = _batches(train_x, train_y, cfg.batch_size, cfg.steps, cfg.seed)
    first = next(batches)
    t = time.time()
    step.lower(model, opt, *[jnp.asarray(b) for b in first]).compile()
    compile_s = time.time() - t
    log(f"compiled the sparse train step in {compile_s:.1f} s")

    from tqdm.auto import tqdm

    from pockjax.train.finetune import peak_rss_bytes, rss_bytes

    unit = "images" if spec.kind == "vision" else "texts"
    bar = tqdm(total=cfg.steps, disable=not cfg.progress, unit="step", dynamic_ncols=True,
               file=sys.stderr)
    losses, times = [], []
    try:
        for i, batch in enumerate(itertools.chain([first], batches)):
            t = time.time()
            loss = float(step(model, opt, *[jnp.asarray(b) for b in batch]))
            if not math.isfinite(loss):
                raise NonFiniteError(f"training stopped at step {i + 1}: the loss is {loss}; nothing"
                                     f" was saved; start again with a lower --lr (this one:"
                                     f" {_lr(cfg):g})")
            dt = time.time() - t
            times.append(dt)
            losses.append(round(loss, 5))
            bar.set_postfix(loss=f"{loss:.3f}", **{f"{unit}_s": f"{cfg.batch_size / dt:.0f}"},
                            rss=f"{rss_bytes() / 2**30:.2f} GB", refresh=False)
            bar.update(1)
    finally:
        bar.close()
    train_s = sum(times)

    t = time.time()
    after = evaluate_classifier(model, test_x, test_y) if test_x is not None else None
    eval_after_s = time.time() - t
    steady = times[1:] if len(times) > 1 else times
    s_per_step = float(np.median(steady)) if steady else float("nan")
    metrics = {
        "model": spec.name, "task": task, "classes": list(classes),
        "scheme": scheme.name or cfg.scheme, "trainable_params": trainable, "total_params": total,
        "steps": cfg.steps, "batch_size": cfg.batch_size,
        "image_size": cfg.image_size if spec.kind == "vision" else None,
        "seq_len": cfg.seq_len if spec.kind == "text" else None,
        "train_examples": int(len(train_y)), "eval_examples": int(len(test_y)),
        "accuracy_before": before, "accuracy_after": after, "losses": losses,
        "final_loss": losses[-1] if losses else None, "compile_seconds": compile_s,
        "train_seconds": train_s, "seconds_per_step": s_per_step,
        f"{unit}_per_second": cfg.batch_size / s_per_step if steady else None,
        "eval_seconds_after": eval_after_s, "wall_seconds": time.time() - t_start,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if cfg.out:
        from pockjax.schemes import save_scheme_file

        out = os.path.abspath(cfg.out)
        with atomic_directory(out) as tmp:
            write_safetensors(os.path.join(tmp, "model.safetensors"), _variables(model))
            save_scheme_file(os.path.join(tmp, "scheme.json"), scheme)
            write_json(os.path.join(tmp, "metrics.json"), metrics, indent=1)
            write_json(os.path.join(tmp, "run.json"), {"config": cfg.to_dict(),
                                                       "scheme": scheme.to_dict()}, indent=1)
    _summary(metrics, cfg, log)
    return metrics


def _summary(m: dict, cfg: ClassifierConfig, log) -> None:
    pct = 100 * m["trainable_params"] / max(m["total_params"], 1)
    unit = "images" if m["image_size"] else "texts"
    log("")
    log("=== pockjax finetune: summary ===")
    log(f"model      {m['model']}, scheme {m['scheme']}: {m['trainable_params'] / 1e6:.3f}M of"
        f" {m['total_params'] / 1e6:.2f}M parameters trainable ({pct:.1f}%)")
    log(f"training   {m['steps']} steps of {m['batch_size']} {unit} in {m['train_seconds']:.1f} s:"
        f" {1e3 * m['seconds_per_step']:.0f} ms/step, {m[f'{unit}_per_second'] or 0:.0f} {unit}/s"
        f" (+ {m['compile_seconds']:.0f} s compile); final loss {m['final_loss']}")
    if m["accuracy_after"] is not None:
        b = "n/a" if m["accuracy_before"] is None else f"{100 * m['accuracy_before']:.1f}%"
        log(f"held-out   accuracy {b} -> {100 * m['accuracy_after']:.1f}% on {m['eval_examples']}"
            f" {m['task']} examples")
    log(f"time       {m['wall_seconds'] / 60:.1f} min wall; peak RSS {m['peak_rss_bytes'] / 2**30:.2f} GB")
    if cfg.out:
        log(f"output     {os.path.abspath(cfg.out)}")

"""Sensitivity analysis of the classifiers: which blocks, and which tensors of a block, matter.

PockEngine's analysis for MobileNetV2 and a BERT encoder: a *unit* is one block
x one tensor kind (MobileNetV2: the ``expand``, ``depthwise`` or ``project``
conv kernel of block ``i``; BERT: the ``q``, ``k``, ``v``, ``o``, ``up`` or
``down`` projection of layer ``i``, kernel and bias). For each unit,
:func:`sensitivity` fine-tunes that unit and the head for a few steps from the
model's weights and measures the held-out accuracy (and loss) against the same
run with the head alone. Its cost is read off the sparse step that
:func:`pockjax.compile` builds for that scheme: :func:`pockjax.count_flops` of
the pruned graph (backward FLOPs: the step's minus the step that trains
nothing) and the trainable parameters. :func:`greedy_scheme` then picks units
by gain per cost under a FLOPs and/or parameter budget, checking each set's
exact cost, and :func:`run` writes the table, ``report.json``, ``units.tsv``,
``gain_by_block.png`` and ``scheme.json`` (``pockjax finetune --scheme``).

The step is traced once; each unit's cost applies the compiler's passes
(``sparse_grad`` + ``dce``) to that trace, which is the graph ``pockjax.compile``
builds for the unit's scheme, without tracing it again. The fine-tunes share one
compiled step over every candidate unit whose gradients are masked to the unit
being trained, as :func:`pockjax.search.contribution.short_finetunes` does:
Adam, AdamW (no decay), SGD and Lion move an entry whose gradient is always zero
by exactly zero, so each run's updates are those of a one-unit fine-tune.

Example (a tiny random MobileNetV2 on random images):
  >>> import numpy as np
  >>> from flax import nnx
  >>> from pockjax.models.mobilenetv2 import MobileNetV2, MobileNetV2Config
  >>> config = MobileNetV2Config(width_mult=0.25, num_classes=2, inverted_residual_setting=((1, 16, 1, 1),
  ...                                                                                  (6, 24, 1, 2)))
  >>> model = MobileNetV2(config, rngs=nnx.Rngs(0))  # two blocks
  >>> rng = np.random.default_rng(0)
  >>> x, y = rng.random((8, 16, 16, 3), np.float32), np.arange(8, dtype=np.int32) % 2
  >>> units = classifier_units(model.config, kinds=["expand", "project"])
  >>> [u.name for u in units], units[-1].path  # block 0 (expansion 1) has no expand conv
  (['B0.project', 'B1.expand', 'B1.project'], 'blocks.1.project.conv.kernel')
  >>> s = sensitivity(model, ([x], y, [x], y), units, steps=1, batch_size=4)
  >>> [r["unit"] for r in s.rows], all(r["backward_flops"] > s.head["backward_flops"] > 0 for r in s.rows)
  (['B0.project', 'B1.expand', 'B1.project'], True)
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax
from pockjax.errors import NonFiniteError, SchemeError
from pockjax.search.units import Unit, scheme_for

__all__ = ["CLASSIFIER_KINDS", "ClassifierSearchConfig", "ClassifierUnit", "Sensitivity", "classifier_scheme",
           "classifier_units", "greedy_scheme", "n_blocks", "run", "sensitivity"]

#: The tensor kinds of a block, by scheme family, in forward order.
CLASSIFIER_KINDS = {"mobilenetv2": ("expand", "depthwise", "project"),
                    "bert": ("q", "k", "v", "o", "up", "down")}


@dataclasses.dataclass(frozen=True, order=True)
class ClassifierUnit(Unit):
    """One tensor kind of one block of a classifier (``B7.expand``, ``L3.q``)."""

    family: str = "mobilenetv2"

    @property
    def path(self) -> str:
        """The scheme pattern of the unit (``blocks.7.expand.conv.kernel``, ``layers.3.attn.q.*``)."""
        if self.family == "mobilenetv2":
            return f"blocks.{self.block}.{self.kind}.conv.kernel"
        return f"layers.{self.block}.{'mlp' if self.kind in ('up', 'down') else 'attn'}.{self.kind}.*"

    @property
    def name(self) -> str:
        return f"{'B' if self.family == 'mobilenetv2' else 'L'}{self.block}.{self.kind}"


def _family(config: Any) -> str:
    from pockjax.schemes import family_of

    family = family_of(config)
    if family not in CLASSIFIER_KINDS:
        raise SchemeError(f"the classifier search knows {', '.join(CLASSIFIER_KINDS)}, not {family!r} models")
    return family


def n_blocks(config: Any) -> int:
    """Blocks (MobileNetV2) or layers (BERT) of a classifier's config."""
    return config.n_blocks if _family(config) == "mobilenetv2" else config.layers


def classifier_units(config: Any, kinds: Sequence[str] | None = None,
                     blocks: Sequence[int] | None = None) -> list[ClassifierUnit]:
    """Every unit of ``blocks`` x ``kinds`` the model has (block-major; MobileNetV2's
    blocks with expansion 1 have no ``expand``)."""
    family = _family(config)
    known = CLASSIFIER_KINDS[family]
    kinds = list(known if kinds is None else kinds)
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        raise SchemeError(f"unknown tensor kind(s) {bad or kinds}; {family} has {', '.join(known)}")
    n = n_blocks(config)
    blocks = range(n) if blocks is None else sorted(set(blocks))
    for b in blocks:
        if not 0 <= b < n:
            raise SchemeError(f"block {b} out of range: the model has {n} blocks")
    expand = set(config.expand_blocks()) if family == "mobilenetv2" else None
    return [ClassifierUnit(b, k, family) for b in blocks for k in known
            if k in kinds and (k != "expand" or expand is None or b in expand)]


def classifier_scheme(units: Sequence[ClassifierUnit], config: Any, name: str | None = None) -> pockjax.UpdateScheme:
    """The scheme training ``units`` and the classifier head (the registry's ``head-only`` rules)."""
    from pockjax.schemes import get_scheme

    head = get_scheme("head-only", config).rules
    units = list(units)
    return pockjax.UpdateScheme(list(scheme_for(units).rules) + list(head),
                                name=name or (f"{' + '.join(u.name for u in sorted(units))} + head" if units
                                              else "head-only"))


# -- cost: the compiler's passes on one trace ---------------------------------------------


class _Costs:
    """FLOPs and trainable parameters of the sparse step of any scheme (cached)."""

    def __init__(self, model: Any, tx: Any, batch: Sequence[Any]):
        from flax import nnx

        from pockjax.train.classify import classify_train_step

        from pockjax.transforms.base import chain

        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        # the step as traced (no passes: flops() applies each scheme's)
        step = pockjax.compile(classify_train_step, passes=chain(), donate=False)
        self.traced = step.lower(model, opt, *batch).traced
        self.params = nnx.state(model, nnx.Param)
        self._cache: dict = {}
        self.forward = self.flops(pockjax.UpdateScheme([]))

    def flops(self, scheme: pockjax.UpdateScheme) -> float:
        """:func:`pockjax.count_flops` of the step ``pockjax.compile`` builds for ``scheme``."""
        from pockjax.compiler import default_passes
        from pockjax.transforms.strip_tags import strip_tags

        key = (tuple(scheme.rules), str(scheme.default))
        if key not in self._cache:
            # only counted, never compiled: the passes skip their check_jaxpr
            passes = default_passes(scheme, sparse_opt_state=True, allow_nothing_trained=True, check=False)
            self._cache[key] = float(pockjax.count_flops(strip_tags()(passes(self.traced)).closed_jaxpr))
        return self._cache[key]

    def trainable(self, scheme: pockjax.UpdateScheme) -> int:
        return int(scheme.describe(self.params).trainable)


# -- the short fine-tunes -------------------------------------------------------------------


class _Masked:
    """An ``nnx.Optimizer`` whose ``update`` first multiplies each gradient by its mask entry."""

    def __init__(self, opt: Any, mask: jax.Array):
        self.opt, self.mask = opt, mask

    def update(self, model, grads):
        leaves, tree = jax.tree.flatten(grads)
        self.opt.update(model, jax.tree.unflatten(tree, [g * self.mask[i] for i, g in enumerate(leaves)]))


def _masked_step(model, optimizer, mask, *inputs_and_labels):
    from pockjax.train.classify import classify_train_step

    return classify_train_step(model, _Masked(optimizer, mask), *inputs_and_labels)


def _held_out(model, inputs: Sequence[np.ndarray], labels: np.ndarray, batch_size: int) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` in eval mode (one compiled function for every run)."""
    right, loss = 0, 0.0
    model.eval()
    for s in range(0, len(labels), batch_size):
        r, l = _eval_batch(model, jnp.asarray(labels[s:s + batch_size]), *[jnp.asarray(x[s:s + batch_size])
                                                                            for x in inputs])
        right, loss = right + int(r), loss + float(l)
    model.train()
    return right / len(labels), loss / len(labels)


def _eval_batch(model, labels, *inputs):
    """``(right answers, summed cross-entropy)`` of one batch (compiled once per model and shape)."""
    global _eval_batch_jit
    if _eval_batch_jit is None:  # built on first use: importing the module compiles nothing
        from flax import nnx

        def f(m, y, *x):
            logits = m(*x)
            return (jnp.sum(jnp.argmax(logits, -1) == y),
                    jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y)))

        _eval_batch_jit = nnx.jit(f)
    return _eval_batch_jit(model, labels, *inputs)


_eval_batch_jit = None


@dataclasses.dataclass
class Sensitivity:
    """What :func:`sensitivity` measured.

    Attributes:
      rows: one dict per unit: ``unit``, ``path``, ``block``, ``kind``, ``accuracy``,
        ``loss``, ``gain`` (accuracy gain over head-only), ``loss_gain`` (held-out loss
        decrease over head-only), ``step_flops``, ``backward_flops`` (the step's
        FLOPs less the step that trains nothing), ``flops_alone`` (the same, for the
        plot), ``extra_flops`` (over head-only), ``params`` (trainable, head included).
      head: the head-only run (same fields but the unit's).
      before: held-out accuracy and loss of the model as given.
      forward_flops: FLOPs of the step that trains nothing.
      costs: the cost evaluator (exact FLOPs and parameters of any scheme).
      seconds: wall time.
    """

    rows: list
    head: dict
    before: dict
    forward_flops: float
    costs: Any = dataclasses.field(repr=False)
    seconds: float = 0.0


def sensitivity(model: Any, data: tuple, units: Sequence[ClassifierUnit], *, steps: int = 20,
                batch_size: int = 32, optimizer: str = "adam", lr: float = 1e-3, seed: int = 0,
                eval_batch_size: int = 128, progress: Callable[[int], None] | None = None,
                describe: Callable[[str], None] | None = None) -> Sensitivity:
    """Fine-tunes each unit + the head, and the head alone, from ``model``'s weights.

    Args:
      model: a :class:`~pockjax.models.mobilenetv2.MobileNetV2` or
        :class:`~pockjax.models.bert.BertClassifier` (left as it was given).
      data: ``(train inputs, train labels, held-out inputs, held-out labels)``: lists
        of arrays (the model's inputs) and int labels, as ``pockjax finetune`` encodes them.
      units: the units (:func:`classifier_units`).
      steps, batch_size, optimizer, lr, seed: each run's training (every run sees the
        same batches).
      progress: called with 1 after each run (a progress bar's ``update``).
      describe: called with the name of each run before it starts.

    Raises:
      NonFiniteError: a run's loss became NaN or infinite.
    """
    from flax import nnx

    from pockjax.train.classify import _batches
    from pockjax.train.finetune import make_optimizer

    t0 = time.perf_counter()
    train_x, train_y, test_x, test_y = data
    batches = [tuple(jnp.asarray(b) for b in batch)
               for batch in _batches(list(train_x), np.asarray(train_y), batch_size, steps, seed)]
    tx = make_optimizer(optimizer, lr)
    config = model.config
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # the caller's model stays as it was
    model.train()
    costs = _Costs(model, tx, batches[0])
    before = dict(zip(("accuracy", "loss"), _held_out(model, test_x, test_y, eval_batch_size)))

    union = classifier_scheme(units, config, name="all candidates")
    paths = pockjax.leaf_paths(nnx.state(model, nnx.Param))
    opt = nnx.Optimizer(model, tx, wrt=union.nnx_wrt())
    start = jax.tree.map(lambda a: a, nnx.state((model, opt)))
    step = pockjax.compile(_masked_step, scheme=union, donate=False)

    def one(us: Sequence[ClassifierUnit]) -> dict:
        scheme = classifier_scheme(us, config)
        if describe:
            describe(scheme.name)
        nnx.update((model, opt), jax.tree.map(lambda a: a, start))
        mask = jnp.asarray([str(scheme.rule_for(p)[0]) != "frozen" for p in paths], jnp.float32)
        t = time.perf_counter()
        for i, batch in enumerate(batches):
            loss = float(step(model, opt, mask, *batch))
            if not math.isfinite(loss):
                raise NonFiniteError(f"{scheme.name}: the loss is {loss} at step {i + 1}; lower the learning rate")
        acc, held = _held_out(model, test_x, test_y, eval_batch_size)
        flops = costs.flops(scheme)
        if progress:
            progress(1)
        return {"accuracy": acc, "loss": held, "train_loss": loss, "step_flops": flops,
                "backward_flops": flops - costs.forward, "params": costs.trainable(scheme),
                "seconds": time.perf_counter() - t}

    head = one([])
    rows = []
    for u in units:
        r = one([u])
        rows.append({"unit": u.name, "path": u.path, "block": u.block, "kind": u.kind, **r,
                     "gain": r["accuracy"] - head["accuracy"], "loss_gain": head["loss"] - r["loss"],
                     "flops_alone": r["backward_flops"], "extra_flops": r["step_flops"] - head["step_flops"]})
    return Sensitivity(rows, head, before, costs.forward, costs, time.perf_counter() - t0)


# -- the budgeted greedy scheme ---------------------------------------------------------------


def greedy_scheme(s: Sensitivity, units: Sequence[ClassifierUnit], config: Any, *,
                  flops_budget: float | None = None, params_budget: float | None = None) -> dict:
    """Adds units by accuracy gain (then loss gain) per share of the budget while the
    exact step FLOPs and trainable parameters of the set (head included) fit.

    Units that did not beat head-only are left out. Raises :class:`~pockjax.search.search.BudgetError`
    when the head alone does not fit. Returns ``{"units", "scheme",
    "step_flops", "backward_flops", "params", "gain_sum"}``.
    """
    if flops_budget is None and params_budget is None:
        raise SchemeError("give a FLOPs budget, a parameter budget, or both")
    by_name = {u.name: u for u in units}

    def share(r):
        c = 0.0
        if flops_budget:
            c += max(r["extra_flops"], 0.0) / flops_budget
        if params_budget:
            c += r["params"] / params_budget
        return c or 1e-12

    def fits(flops, params):
        return (flops_budget is None or flops <= flops_budget) and (params_budget is None or params <= params_budget)

    if not fits(s.head["step_flops"], s.head["params"]):
        from pockjax.search.search import BudgetError

        raise BudgetError(f"the head alone does not fit the budget: {s.head['step_flops']:.4g} FLOPs and"
                          f" {s.head['params']} parameters (budget: {flops_budget or '-'} FLOPs,"
                          f" {params_budget or '-'} parameters)")
    good = [r for r in s.rows if (r["gain"], r["loss_gain"]) > (0.0, 0.0)]
    order = sorted(good, key=lambda r: (-r["gain"] / share(r), -r["loss_gain"] / share(r)))
    chosen: list = []
    for r in order:
        if not fits(r["step_flops"], r["params"]):  # a set costs at least what each unit does alone
            continue
        trial = classifier_scheme(chosen + [by_name[r["unit"]]], config)
        # the exact FLOPs (a pass over the trace) only where a FLOPs budget needs them
        if fits(s.costs.flops(trial) if flops_budget else None, s.costs.trainable(trial)):
            chosen.append(by_name[r["unit"]])
    final = classifier_scheme(chosen, config)
    cost = (s.costs.flops(final), s.costs.trainable(final))
    gain = {r["unit"]: r["gain"] for r in s.rows}
    scheme = classifier_scheme(chosen, config, name=f"searched ({len(chosen)} tensors + head)")
    return {"units": sorted(chosen), "scheme": scheme, "step_flops": cost[0],
            "backward_flops": cost[0] - s.forward_flops, "params": cost[1],
            "gain_sum": sum(gain[u.name] for u in chosen)}


# -- the command ------------------------------------------------------------------------------


@dataclasses.dataclass
class ClassifierSearchConfig:
    """The flags of ``pockjax search`` for a classifier (``--model mobilenetv2|all-minilm-l6-v2``)."""

    model: str = "mobilenetv2"
    task: str | None = None          # None: the model's default task
    kinds: str | None = None         # None: every kind of the family
    blocks: str | None = None        # None: every block
    steps: int = 20
    batch_size: int = 32
    image_size: int = 32
    seq_len: int = 64
    train_per_class: int | None = 100
    eval_examples: int = 500
    optimizer: str = "adam"
    lr: float | None = None          # None: 1e-3 (0.01 for sgd), as pockjax finetune
    seed: int = 0
    budget: str = "paper"
    out: str | None = None
    plot: bool = True
    top: int = 20
    progress: bool = True


def _budgets(spec: str, reference: dict, full: Callable[[], dict]) -> tuple[float | None, float | None]:
    """``--budget``: comma-separated ``flops=X`` and ``params=X`` (a bare ``X`` is FLOPs).

    X is read by :func:`pockjax.search.cli.parse_budget` against the ``paper`` scheme's
    figure: ``paper``, ``0.5*paper``, ``full``, ``2GFLOP``, ``3e8``; params also take
    ``200k`` or ``1.5M``.

    Example:
      >>> _budgets("flops=0.5*paper,params=20k", {"step_flops": 1e9, "params": 5e4}, dict)
      (500000000.0, 20000.0)
    """
    from pockjax.search.cli import SearchError, parse_budget

    out = {"flops": None, "params": None}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        key, _, value = part.rpartition("=")
        key = key.strip().lower() or "flops"
        if key not in out:
            raise SearchError(f"bad --budget {spec!r}: use flops=X and/or params=X (e.g. flops=paper,params=200k)")
        field = "step_flops" if key == "flops" else "params"
        m = re.fullmatch(r"([0-9.]+)([kmg])", value.strip().lower()) if key == "params" else None
        if m:
            value = str(float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])
        out[key] = parse_budget(value, "time" if key == "flops" else "params", reference[field],
                                full()[field] if "full" in value.lower() else None)
    if out["flops"] is None and out["params"] is None:
        raise SearchError(f"--budget {spec!r} sets no budget: give flops=X and/or params=X")
    return out["flops"], out["params"]


def run(cfg: Any, *, model: Any = None, tokenizer: Any = None, data: tuple | None = None,
        log: Callable[[str], None] | None = None) -> dict:
    """``pockjax search --model mobilenetv2|all-minilm-l6-v2``: the analysis, the greedy
    scheme and the files; returns the report dict.

    ``cfg`` is a :class:`ClassifierSearchConfig`; ``model`` (with its
    ``tokenizer`` for text) and ``data`` (as :func:`sensitivity` takes it) replace the
    pretrained model and the task's data (tests pass small ones).
    """
    from tqdm.auto import tqdm

    from pockjax.io.atomic import remove_stale_temporaries
    from pockjax.schemes import get_scheme
    from pockjax.search.cli import SearchError, _parse_blocks, write_outputs
    from pockjax.train.classify import ClassifierConfig, _data, _load, _spec

    log = log or (lambda s: print(s, flush=True))
    t_start = time.perf_counter()
    spec = _spec(cfg.model)
    task = (cfg.task or spec.default_task).replace("-", "_")
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise SearchError("--steps and --batch-size must be at least 1")
    if cfg.out and os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise SearchError(f"--out {cfg.out} exists and is not a directory")
    if cfg.out:
        remove_stale_temporaries(cfg.out)
    ccfg = ClassifierConfig(model=cfg.model, task=task, batch_size=cfg.batch_size, image_size=cfg.image_size,
                            seq_len=cfg.seq_len, seed=cfg.seed, train_per_class=cfg.train_per_class,
                            eval_examples=cfg.eval_examples)
    if model is None:
        if spec.kind == "vision":
            from pockjax.data.vision import load_vision_task as load
        else:
            from pockjax.data.text_classification import load_text_task as load
        classes = load(task, seed=cfg.seed, max_per_class=1).class_names
        model, tokenizer = _load(spec, len(classes), cfg.seed)
    if data is None:
        data = _data(spec, ccfg, task, tokenizer)[:4]
        if data[2] is None:
            raise SearchError("--eval-examples must be at least 1: the gains are held-out accuracies")
    config = model.config
    family = _family(config)
    kinds = [k.strip() for k in (cfg.kinds or "").split(",") if k.strip()] or None
    units = classifier_units(config, kinds, _parse_blocks(cfg.blocks, n_blocks(config)))
    if not units:
        raise SearchError("no candidate unit: --blocks and --kinds select nothing this model has")
    log(f"model {cfg.model} ({family}): {n_blocks(config)} blocks, {len(units)} candidate units"
        f" ({','.join(dict.fromkeys(u.kind for u in units))}); task {task}: {len(data[1])} training,"
        f" {len(data[3])} held-out examples; {cfg.steps} steps of {cfg.batch_size} per run")

    bar = tqdm(total=len(units) + 1, disable=not cfg.progress, unit="run", dynamic_ncols=True, file=sys.stderr)
    try:
        s = sensitivity(model, data, units, steps=cfg.steps, batch_size=cfg.batch_size, optimizer=cfg.optimizer,
                        lr=cfg.lr if cfg.lr is not None else (0.01 if cfg.optimizer == "sgd" else 1e-3),
                        seed=cfg.seed, progress=bar.update, describe=lambda n: bar.set_description(n[:28]))
    finally:
        bar.close()
    paper = get_scheme("paper", config)
    reference = {"scheme": paper.name, "step_flops": s.costs.flops(paper), "params": s.costs.trainable(paper)}
    full_cost = {}

    def full():
        if not full_cost:
            f = pockjax.UpdateScheme.full()
            full_cost.update(step_flops=s.costs.flops(f), params=s.costs.trainable(f))
        return full_cost

    flops_budget, params_budget = _budgets(cfg.budget, reference, full)
    result = greedy_scheme(s, units, config, flops_budget=flops_budget, params_budget=params_budget)
    ref_units = {u.name for u in units if str(paper.rule_for(u.path.replace("*", "kernel"))[0]) != "frozen"}
    chosen = {u.name for u in result["units"]}
    rows = sorted(({**r, "chosen": r["unit"] in chosen, "reference": r["unit"] in ref_units} for r in s.rows),
                  key=lambda r: (-r["gain"], -r["loss_gain"]))
    by_kind = {}
    for k in dict.fromkeys(u.kind for u in units):
        g = [r for r in rows if r["kind"] == k]
        by_kind[k] = {"mean_gain": float(np.mean([r["gain"] for r in g])),
                      "mean_loss_gain": float(np.mean([r["loss_gain"] for r in g])),
                      "best": max(g, key=lambda r: (r["gain"], r["loss_gain"]))["unit"],
                      "chosen": sum(r["chosen"] for r in g)}
    kind_rank = sorted(by_kind, key=lambda k: (-by_kind[k]["mean_gain"], -by_kind[k]["mean_loss_gain"]))
    first = CLASSIFIER_KINDS[family][0]
    finding = None
    if family == "mobilenetv2" and len(by_kind) > 1 and first in by_kind:
        finding = {"claim": "the first point-wise (expand) conv matters most", "holds": kind_rank[0] == first}
    report = {
        "config": dataclasses.asdict(cfg), "task": task, "family": family, "n_blocks": n_blocks(config),
        "candidates": len(units), "before": s.before, "head_only": s.head, "forward_flops": s.forward_flops,
        "reference": {**reference, "units": sorted(ref_units)},
        "budget": {"spec": cfg.budget, "flops": flops_budget, "params": params_budget},
        "searched": {"units": [u.name for u in result["units"]], "gain_sum": result["gain_sum"],
                     "step_flops": result["step_flops"], "backward_flops": result["backward_flops"],
                     "params": result["params"], "scheme": result["scheme"].to_dict()},
        "by_kind": by_kind, "kind_ranking": kind_rank, "paper_finding": finding,
        "timings": {"sensitivity_seconds": s.seconds, "wall_seconds": time.perf_counter() - t_start},
        "units": rows,
    }

    h = s.head
    log(f"held-out accuracy: as loaded {100 * s.before['accuracy']:.1f}%, head-only {100 * h['accuracy']:.1f}%"
        f" (loss {h['loss']:.4f}, backward {h['backward_flops'] / 1e6:.1f} MFLOP, {h['params']} params)")
    if cfg.top:
        log(f"{'unit':<10} {'accuracy':>8} {'gain':>7} {'loss gain':>9} {'bwd MFLOP':>10} {'params':>9}  chosen ref")
        for r in rows[:cfg.top]:
            log(f"{r['unit']:<10} {100 * r['accuracy']:7.1f}% {100 * r['gain']:+6.1f}% {r['loss_gain']:+9.4f}"
                f" {r['backward_flops'] / 1e6:10.1f} {r['params']:9d}  {'*' if r['chosen'] else ' ':^6}"
                f" {'*' if r['reference'] else ' '}")
    log("kinds by mean accuracy gain: " + " > ".join(f"{k} ({100 * by_kind[k]['mean_gain']:+.2f}%)"
                                                     for k in kind_rank))
    if finding is not None:
        log(f"paper's finding ({finding['claim']}): {'holds' if finding['holds'] else 'does NOT hold'}")
    log(f"reference {paper.name}: {reference['step_flops'] / 1e6:.1f} MFLOP step, {reference['params']} params")
    log(f"searched: {len(result['units'])} tensors + head ({', '.join(u.name for u in result['units']) or '-'}),"
        f" {result['step_flops'] / 1e6:.1f} MFLOP step, {result['params']} params")

    if cfg.out:
        write_outputs(cfg.out, result["scheme"], report,
                      ["unit", "block", "kind", "accuracy", "gain", "loss", "loss_gain", "step_flops",
                       "backward_flops", "extra_flops", "params", "chosen", "reference"])
        if cfg.plot:
            from pockjax.search.plot import plot_gain_vs_cost

            plot_gain_vs_cost(report, os.path.join(cfg.out, "gain_by_block.png"), log_scale=False,
                              gain_label="held-out accuracy gain over head-only")
        log(f"wrote {cfg.out}/scheme.json (pockjax finetune --model {cfg.model} --scheme {cfg.out}/scheme.json),"
            f" report.json, units.tsv" + (", gain_by_block.png" if cfg.plot else ""))
    return report

"""What training a set of units costs: backward FLOPs and peak memory, with the depth coupling.

Training any tensor of block ``i`` makes the backward pass run from the loss
down to that tensor: the activation gradients of every block above it are
computed whether or not their weights are trained. So costs are not additive
over units. For a set ``S`` of units (the blocks below the last alike, as in
LLaMA)::

    flops(S) = F_fwd + max_{u in S} depth(u) + sum_{u in S} W(u)
    depth(u) = D_last(kind(u))                              u in the last block
             = (L - 2 - block(u)) * A + D_body(kind(u))     any other block

``F_fwd`` is the step without any backward pass; ``A`` the activation-gradient
FLOPs of one whole block; ``D_last(k)`` those from the top of the model down to
the input of kind ``k`` in the last block (head included), ``D_body(k)`` the
same down to kind ``k`` of the second-to-last block (the whole last block's
backward included); ``W(u)`` the weight gradient and optimizer update of one
tensor. The last block has its own constants because the answer-window loss
runs its queries and MLP on the window rows only
(:meth:`pockjax.models.llama.Llama.hidden_states` with ``rows``): there the
weight gradients of ``wq``, ``wo`` and the MLP see those rows, not all of them.
Every constant is read from the FLOP counts (:func:`pockjax.count_flops`) of
the real pruned step graph (``sparse_grad`` + ``dce`` of the traced step) for a
few dozen small schemes: :func:`calibrate`. Peak memory is fitted the same way as
``M0 + M_depth * depth(S)/A + M_param * (bytes of trained tensors)`` against
the liveness planner (:func:`pockjax.memory.analyze`) on those graphs, and any
scheme can be measured exactly with :meth:`StepGraph.evaluate`.

Example:
  >>> from flax import nnx
  >>> from pockjax.models import llama
  >>> from pockjax.search.units import Unit
  >>> model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  >>> sg = StepGraph.for_model(model, batch=2, seq=16, window=4)
  >>> cm = calibrate(sg)
  >>> s = [Unit(0, "wq"), Unit(1, "w2")]
  >>> exact = sg.evaluate(s)
  >>> abs(cm.flops(s) - exact.flops) / exact.flops < 0.02
  True
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax
from pockjax.search.units import KINDS, Unit, scheme_for

__all__ = ["CostModel", "Exact", "StepGraph", "calibrate", "measure_step_seconds"]


@dataclasses.dataclass(frozen=True)
class Exact:
    """Exact figures of one scheme's pruned step graph.

    Attributes:
      flops: FLOPs of the pruned step (:func:`pockjax.count_flops`).
      peak_bytes: the planner's peak (parameters and optimizer state donated).
      trainable: trained parameters.
      seconds: time to build and analyse the graph.
    """

    flops: float
    peak_bytes: int
    trainable: int
    seconds: float


def _step_for(graphdef: Any, tx: Any, window: int | None) -> Callable:
    from pockjax.models import llama

    def loss_fn(params, batch):
        model = llama.merge(graphdef, params)
        if window is None:
            return llama.next_token_loss(model(batch["tokens"]), batch["targets"], batch["loss_mask"])
        return llama.answer_loss(model, batch, window)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


class StepGraph:
    """The fine-tuning step of one model and batch shape, traced once (abstractly).

    :meth:`graph` prunes it for a set of units exactly as ``pockjax.compile``
    with that scheme and a sparse optimizer state would (``sparse_grad`` + ``dce``),
    without compiling; :meth:`evaluate` counts its FLOPs and plans its memory.
    """

    def __init__(self, step: Callable, params: Any, opt_state: Any, batch: dict, config: Any, tx: Any):
        self.config = config
        self.tx = tx
        self.step = step
        self.abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (params, opt_state, batch))
        self.traced = pockjax.trace_step(step, self.abstract)
        self._shapes = {p: a.shape for p, a, r in zip(self.traced.in_paths, self.traced.in_avals, self.traced.in_roles)
                        if r == "param"}
        self._cache: dict = {}

    @classmethod
    def for_model(cls, model: Any, *, batch: int, seq: int, window: int | None = None,
                  tx: Any = None, batch_arrays: dict | None = None) -> "StepGraph":
        """The step ``finetune`` runs (AdamW, answer-window loss when ``window`` is set).

        Args:
          model: an unrolled :class:`pockjax.models.llama.Llama` (only shapes are used).
          batch, seq: rows and row length.
          window: answer window of :func:`pockjax.models.llama.answer_loss` (None:
            the plain next-token loss over every position).
          tx: the optimizer (default ``optax.adamw(3e-4, weight_decay=0)``).
          batch_arrays: a real batch to take the shapes from instead.
        """
        from pockjax.models import llama

        tx = tx or optax.adamw(3e-4, weight_decay=0.0)
        graphdef, params = llama.split(model)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        opt_state = jax.eval_shape(tx.init, params)
        if batch_arrays is None:
            tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
            batch_arrays = {"tokens": tok, "targets": tok,
                            "loss_mask": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
            if window is not None:
                batch_arrays["loss_start"] = jax.ShapeDtypeStruct((batch,), jnp.int32)
        return cls(_step_for(graphdef, tx, window), params, opt_state, batch_arrays, model.config, tx)

    def param_bytes(self, unit: Unit) -> int:
        """Bytes of one unit's tensor."""
        shape = self._shapes[unit.path]
        return int(np.prod(shape)) * 4

    def param_count(self, unit: Unit) -> int:
        return int(np.prod(self._shapes[unit.path]))

    def graph(self, units: Iterable[Unit], *, check: bool = True):
        """The pruned :class:`~pockjax.graph.TrainGraph` for ``units``.

        ``check=False`` skips the passes' ``check_jaxpr`` (see
        :func:`pockjax.default_passes`): :meth:`evaluate` only analyses the graph.
        """
        from pockjax.compiler import default_passes
        from pockjax.transforms.strip_tags import strip_tags

        units = list(units)
        scheme = scheme_for(units)
        # no units: the baseline step that trains nothing, on purpose
        passes = default_passes(scheme, sparse_opt_state=True, allow_nothing_trained=not units, check=check)
        return strip_tags()(passes(self.traced))

    def evaluate(self, units: Iterable[Unit]) -> Exact:
        """Exact FLOPs and planned peak memory of the pruned step for ``units``."""
        from pockjax.memory import analyze

        key = tuple(sorted(set(units)))
        if key in self._cache:
            return self._cache[key]
        t = time.perf_counter()
        g = self.graph(key, check=False)  # only analysed, never compiled (a third of calibrate's time)
        flops = float(pockjax.count_flops(g.closed_jaxpr))
        index = {v: i for i, v in enumerate(g.jaxpr.invars)}
        forwarded = {index[v] for v in g.jaxpr.outvars if not hasattr(v, "val") and v in index}
        mask = [r in ("param", "opt_state", "model_state") and i not in forwarded for i, r in enumerate(g.in_roles)]
        peak = analyze(g, donate=mask, fusion="xla").peak_bytes
        ex = Exact(flops, int(peak), sum(self.param_count(u) for u in key), time.perf_counter() - t)
        self._cache[key] = ex
        return ex


@dataclasses.dataclass
class CostModel:
    """Predicted FLOPs and peak memory of any set of units (see the module docstring).

    Attributes:
      n_layers: blocks of the model.
      fwd_flops: ``F_fwd``, the step with nothing trained.
      block_flops: ``A``, activation-gradient FLOPs of one block.
      depth_flops: ``D_last(kind)``, activation-gradient FLOPs from the top to a last-block tensor.
      weight_flops: ``W(kind)`` of a last-block tensor: weight gradient + update FLOPs.
      param_bytes: bytes of one tensor of each kind.
      mem_coef: ``(M0, M_depth, M_param)`` of the fitted peak-memory model.
      pair_extra: ``{(j, k): FLOPs}``: activation-gradient FLOPs that tensor ``k`` adds
        to ``j`` of the same (last) block (``D(j) >= D(k)``) when its path branches off ``j``'s.
      body_depth_flops, body_weight_flops, body_pair_extra: the same for the
        blocks below the last (``D_body``, measured on the second-to-last block);
        ``None`` for a one-block model.
      calibration: ``[(units, exact)]`` the constants were read from.
    """

    n_layers: int
    fwd_flops: float
    block_flops: float
    depth_flops: dict
    weight_flops: dict
    param_bytes: dict
    mem_coef: tuple
    pair_extra: dict = dataclasses.field(default_factory=dict)
    body_depth_flops: dict | None = None
    body_weight_flops: dict | None = None
    body_pair_extra: dict | None = None
    calibration: list = dataclasses.field(default_factory=list, repr=False)

    def _body(self, block: int) -> bool:
        return block < self.n_layers - 1 and self.body_depth_flops is not None

    def kind_depth(self, block: int, kind: str) -> float:
        """Activation-gradient FLOPs needed to reach tensor ``kind`` of ``block``."""
        if self._body(block):
            return (self.n_layers - 2 - block) * self.block_flops + self.body_depth_flops[kind]
        return (self.n_layers - 1 - block) * self.block_flops + self.depth_flops[kind]

    def depth(self, unit: Unit) -> float:
        """Activation-gradient FLOPs needed to reach ``unit``."""
        return self.kind_depth(unit.block, unit.kind)

    def weight(self, unit: Unit) -> float:
        """Weight-gradient and optimizer-update FLOPs of ``unit``'s tensor."""
        return (self.body_weight_flops if self._body(unit.block) else self.weight_flops)[unit.kind]

    def extra(self, block: int, j: str, k: str) -> float:
        """Activation-gradient FLOPs that kind ``k`` adds to kind ``j`` in ``block`` (see ``pair_extra``)."""
        return (self.body_pair_extra if self._body(block) else self.pair_extra).get((j, k), 0.0)

    def set_depth(self, units: Iterable[Unit]) -> float:
        """Activation-gradient FLOPs of a set: all blocks above its deepest block, and in
        that block the union of its tensors' paths (sibling branches, such as wq and wk
        off the attention scores, each add their own part: :attr:`pair_extra`)."""
        units = list(units)
        if not units:
            return 0.0
        d = min(u.block for u in units)
        kinds = sorted({u.kind for u in units if u.block == d}, key=lambda k: -self.kind_depth(d, k))
        total = self.kind_depth(d, kinds[0])
        for i, k in enumerate(kinds[1:], 1):
            total += min(self.extra(d, j, k) for j in kinds[:i])
        return total

    def flops(self, units: Iterable[Unit]) -> float:
        """Predicted FLOPs of the pruned step training ``units``."""
        units = list(units)
        return self.fwd_flops + self.set_depth(units) + sum(self.weight(u) for u in units)

    def memory(self, units: Iterable[Unit]) -> float:
        """Predicted planner peak (bytes) of the step training ``units``."""
        units = list(units)
        m0, md, mp = self.mem_coef
        return m0 + md * self.set_depth(units) / self.block_flops + mp * sum(self.param_bytes[u.kind] for u in units)

    def marginal_flops(self, unit: Unit) -> float:
        """FLOPs of ``unit`` on its own (depth included)."""
        return self.depth(unit) + self.weight(unit)

    def to_dict(self) -> dict:
        def pairs(d):
            return None if d is None else {f"{j}+{k}": v for (j, k), v in d.items()}

        return {"n_layers": self.n_layers, "fwd_flops": self.fwd_flops, "block_flops": self.block_flops,
                "depth_flops": self.depth_flops, "weight_flops": self.weight_flops,
                "param_bytes": self.param_bytes, "mem_coef": list(self.mem_coef),
                "pair_extra": pairs(self.pair_extra), "body_depth_flops": self.body_depth_flops,
                "body_weight_flops": self.body_weight_flops, "body_pair_extra": pairs(self.body_pair_extra)}


def calibrate(sg: StepGraph, *, kinds: Sequence[str] = KINDS, progress: Callable[[str], None] | None = None
              ) -> CostModel:
    """Reads the :class:`CostModel` constants off exact pruned graphs of a few schemes.

    Schemes: nothing trained; each kind alone in the last block and in the
    second-to-last; ``wo`` + ``w1`` of the second-to-last block (the update
    cost per entry); each kind of the last block on top of a tensor of the
    block below (its exact weight cost); the sibling pairs (``wq``/``wk``/``wv``,
    ``w1``/``w3``) in both blocks; the first kind three blocks from the top (the
    per-block cost); and three spread sets for the memory fit. About
    ``4 * len(kinds) + 14`` graph evaluations.
    """
    L = sg.config.n_layers
    last = L - 1
    done: list = []

    def ev(units):
        if progress:
            progress(",".join(u.name for u in units) or "(nothing)")
        ex = sg.evaluate(units)
        done.append((list(units), ex))
        return ex

    f0 = ev([]).flops
    tok = sg.abstract[2]["tokens"].shape
    rows = tok[0] * tok[1]
    k0 = kinds[0]

    def per_entry_weights(block: int, single: dict) -> dict:
        # W(k) below the last block: the weight-gradient matmul (2 * rows * entries; every
        # kernel sees all batch x seq rows) plus the optimizer update, a fixed count per
        # entry read off wo + w1 (w1's path is part of wo's, so the pair adds exactly W(w1)).
        per_entry = 2.0 * rows
        if "wo" in kinds and "w1" in kinds:
            pair = ev([Unit(block, "wo"), Unit(block, "w1")]).flops
            per_entry = max(per_entry, (pair - single["wo"]) / sg.param_count(Unit(block, "w1")))
        return {k: per_entry * sg.param_count(Unit(block, k)) for k in kinds}

    def sibling_extras(block: int, single: dict, depth: dict, weight: dict) -> dict:
        # sibling branches: q, k, v off the attention, w1 (gate) and w3 (up) off the FFN
        extra = {}
        for group in (("wq", "wk", "wv"), ("w1", "w3")):
            g = [k for k in group if k in kinds]
            for i, a in enumerate(g):
                for b in g[i + 1:]:
                    j, k = (a, b) if depth[a] >= depth[b] else (b, a)
                    both = ev([Unit(block, j), Unit(block, k)]).flops
                    extra[(j, k)] = max(0.0, both - single[j] - weight[k])
        return extra

    single = {k: ev([Unit(last, k)]).flops for k in kinds}
    body_depth = body_weight = body_extra = None
    if L > 1:
        prev = last - 1
        single_prev = {k: ev([Unit(prev, k)]).flops for k in kinds}
        body_weight = per_entry_weights(prev, single_prev)
        body_depth = {k: single_prev[k] - f0 - body_weight[k] for k in kinds}
        # W(k) of the last block, exactly: on top of a tensor of the block below, whose
        # backward already runs through the whole last block, a last-block tensor adds
        # only its weight gradient and update (fewer rows for those the window feeds).
        weight = {k: ev([Unit(prev, k0), Unit(last, k)]).flops - single_prev[k0] for k in kinds}
        depth = {k: single[k] - f0 - weight[k] for k in kinds}
        body_extra = sibling_extras(prev, single_prev, body_depth, body_weight)
        if L > 2:
            block = ev([Unit(prev - 1, k0)]).flops - single_prev[k0]
        else:  # no third block: one block's backward, as the step from the last block to the one below
            block = body_depth[k0] - depth[k0]
    else:
        weight = per_entry_weights(last, single)
        depth = {k: single[k] - f0 - weight[k] for k in kinds}
        block = max(depth.values())
    extra = sibling_extras(last, single, depth, weight)
    # memory: least squares over the calibration graphs plus a few spread sets
    ev([Unit(last, k) for k in kinds])
    if L > 2:
        ev([Unit(L // 2, kinds[0]), Unit(last, kinds[-1])])
        ev([Unit(0, kinds[-1])])
    cm = CostModel(L, f0, float(block), depth, weight, {k: sg.param_bytes(Unit(last, k)) for k in kinds},
                   (0.0, 0.0, 0.0), extra, body_depth, body_weight, body_extra, done)
    X = np.array([[1.0, cm.set_depth(u) / cm.block_flops, sum(cm.param_bytes[x.kind] for x in u)]
                  for u, _ in done])
    y = np.array([ex.peak_bytes for _, ex in done], float)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    cm.mem_coef = tuple(float(c) for c in coef)
    return cm


def measure_step_seconds(model: Any, tokenizer: Any, units_or_scheme: Any, batches: Sequence[dict],
                         window: int, *, steps: int = 3, lr: float = 3e-4) -> dict:
    """Compiles and runs the real sparse step; returns compile and per-step seconds.

    ``units_or_scheme``: a list of :class:`Unit` or a :class:`pockjax.UpdateScheme`.
    The first step after compiling is not timed; the median of the next ``steps`` is.
    """
    from pockjax.models import llama

    scheme = units_or_scheme if isinstance(units_or_scheme, pockjax.UpdateScheme) else scheme_for(units_or_scheme)
    tx = optax.adamw(lr, weight_decay=0.0)
    graphdef, params = llama.split(model)
    params = jax.tree.map(jnp.copy, params)  # the step donates its inputs
    step = pockjax.compile(_step_for(graphdef, tx, window), scheme=scheme)
    opt_state = pockjax.init_opt_state(tx, params, scheme)
    b0 = {k: jnp.asarray(v) for k, v in batches[0].items()}
    t = time.perf_counter()
    step.lower(params, opt_state, b0).compile()
    compile_s = time.perf_counter() - t
    times = []
    for i in range(steps + 1):
        b = {k: jnp.asarray(v) for k, v in batches[i % len(batches)].items()}
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, b)
        float(loss)
        if i:
            times.append(time.perf_counter() - t)
    return {"compile_seconds": compile_s, "seconds_per_step": float(np.median(times)), "times": times}

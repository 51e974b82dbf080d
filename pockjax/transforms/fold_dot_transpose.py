"""Fold ``transpose(dot_general(a, b))`` into ``dot_general(b, a)``.

JAX's transpose rule for a matmul's right operand computes the weight
gradient the other way round and transposes it: for ``y = x @ w`` the jaxpr
of the backward pass holds ``transpose(dot_general(dy, x), (1, 0))``. The
transpose itself is cheap, but it makes XLA's CPU backend put ``dy`` (not
``x``) on the left of the matmul with its token axes last, so ``dy`` is
transposed in memory. ``dy`` is usually the output of an elementwise
backward (SwiGLU's, RMSNorm's), and XLA fuses that elementwise computation
into the transposing copy: a loop that writes in one order and reads four
operands in another. On SmolLM2-135M's full fine-tuning step those fusions
took a sixth of the step, each many times slower than a plain copy of the same
bytes (the measurements are in docs/benchmarks.md).

The pass rewrites each such pair into one ``dot_general`` with the operands
swapped, which computes the transposed result directly (the output dimension
order of ``dot_general`` is batch, left-free, right-free; swapping the
operands swaps the two free groups). It applies when:

* the transpose keeps the batch dimensions in place and swaps the two free
  groups, each kept in its order (the weight-gradient case), and
* the transpose is the ``dot_general``'s only consumer (otherwise the matmul
  would be computed twice) and the ``dot_general`` has no output sharding;
* ``x`` is not larger than ``dy``: XLA copies the left operand transposed
  either way, so the swap pays only when it puts the smaller operand there.
  MobileNetV2's projection convolutions (``x`` 4-6x wider than ``dy``) lose
  by it: with every such pair folded, their transposing copies took 651 ms of
  thread time per full step at 224x224, batch 32; with only the pairs that
  make the copy smaller folded, 188 ms. SmolLM2's full step did not slow.

The result is the same computation (every output element is the same sum of
products), so losses, parameters and optimizer state agree with the unfolded
step to rounding. With bfloat16 operands the rounding can differ more: XLA
may keep a folded bf16 product in float32 when a convert to float32 follows
it, where the transposed form rounds it to bf16 first (XLA's default
``xla_allow_excess_precision``); a probe saw weights differ from ``jax.jit``'s
by up to 4e-5 (3e-3 relative, within bf16's rounding), and by 0 with that
option off. Nested jaxprs (``jit``, ``scan``, ``remat``, custom
derivatives) are rewritten too. :func:`pockjax.compile` runs this pass after
``sparse_grad`` and ``dce`` by default.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from pockjax import _compat as C
from pockjax._src.jaxpr import is_var, producers, subjaxprs
from pockjax.graph import PassRecord, TrainGraph
from pockjax.transforms.base import Pass

__all__ = ["FoldDotTransposeRecord", "fold_dot_transpose", "fold_dot_transpose_jaxpr"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoldDotTransposeRecord(PassRecord):
    """What :func:`fold_dot_transpose` did.

    Attributes:
      folded: how many ``transpose(dot_general)`` pairs became one ``dot_general``
        (nested jaxprs included).
    """

    name: str = "fold_dot_transpose"
    folded: int


def _swapped_dot_params(dot: C.JaxprEqn, transpose: C.JaxprEqn) -> dict | None:
    """The params of ``dot_general(b, a)`` equal to ``transpose(dot)``, or None."""
    if dot.params.get("out_sharding") is not None:
        return None
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    a, b = dot.invars
    nbatch = len(lb)
    na = a.aval.ndim - len(lc) - nbatch
    nb = b.aval.ndim - len(rc) - len(rb)
    batch = tuple(range(nbatch))
    swap = batch + tuple(range(nbatch + na, nbatch + na + nb)) + tuple(range(nbatch, nbatch + na))
    if tuple(transpose.params["permutation"]) != swap:
        return None
    return dict(dot.params, dimension_numbers=((tuple(rc), tuple(lc)), (tuple(rb), tuple(lb))))


def _size(v) -> int:
    return math.prod(v.aval.shape) * v.aval.dtype.itemsize


def _rewrite_nested(value: Any) -> tuple[Any, int]:
    if isinstance(value, C.ClosedJaxpr):
        inner, n = fold_dot_transpose_jaxpr(value.jaxpr)
        return (C.ClosedJaxpr(inner, value.consts) if n else value), n
    if isinstance(value, C.Jaxpr):
        inner, n = fold_dot_transpose_jaxpr(value)
        return (inner if n else value), n
    parts = [_rewrite_nested(v) for v in value]
    n = sum(k for _, k in parts)
    return (type(value)(p for p, _ in parts) if n else value), n


def fold_dot_transpose_jaxpr(jaxpr: C.Jaxpr) -> tuple[C.Jaxpr, int]:
    """Fold every eligible ``transpose(dot_general)`` pair of ``jaxpr``.

    Returns the new jaxpr (same inputs and outputs) and the number of pairs
    folded, nested jaxprs included.
    """
    eqns = list(jaxpr.eqns)
    made_by = producers(eqns)
    uses: dict = {}
    for e in eqns:
        for v in e.invars:
            if is_var(v):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if is_var(v):
            uses[v] = uses.get(v, 0) + 1
    folded, dead = 0, set()
    for i, e in enumerate(eqns):
        subs = subjaxprs(e, strict=False)
        if subs:
            params = dict(e.params)
            for name, value in subs:
                params[name], n = _rewrite_nested(value)
                folded += n
            eqns[i] = e.replace(params=params)
            continue
        if e.primitive is not C.primitives.transpose_p or not is_var(e.invars[0]):
            continue
        k = made_by.get(e.invars[0])
        if k is None or k in dead or eqns[k].primitive is not C.primitives.dot_general_p or uses[e.invars[0]] != 1:
            continue
        dot = eqns[k]
        if _size(dot.invars[1]) > _size(dot.invars[0]):
            continue  # the swap would put the larger operand where XLA copies it transposed
        params = _swapped_dot_params(dot, e)
        if params is None:
            continue
        eqns[i] = C.new_jaxpr_eqn(list(reversed(dot.invars)), e.outvars, dot.primitive, params,
                                  dot.effects, dot.source_info, dot.ctx)
        dead.add(k)
        folded += 1
    if not folded:
        return jaxpr, 0
    return jaxpr.replace(eqns=[e for i, e in enumerate(eqns) if i not in dead]), folded


def _fold_graph(graph: TrainGraph, check: bool = True) -> TrainGraph:
    new_jaxpr, n = fold_dot_transpose_jaxpr(graph.jaxpr)
    if n and check:
        C.check_jaxpr(new_jaxpr)
    return graph.recorded(FoldDotTransposeRecord(folded=n),
                          closed_jaxpr=C.ClosedJaxpr(new_jaxpr, graph.closed_jaxpr.consts))


def fold_dot_transpose(*, check: bool = True) -> Pass:
    """The pass that folds ``transpose(dot_general(a, b))`` into ``dot_general(b, a)``.

    It records a :class:`FoldDotTransposeRecord` with how many pairs were folded.

    Args:
      check: type-check the rewritten program with JAX's ``check_jaxpr`` when a
        pair was folded (the swapped ``dot_general``'s output type must match that of
        the transpose it replaces). With ``False`` that check is skipped: safe when
        the graph is only analysed (FLOPs, liveness), not run or compiled, as the
        architecture search does for each candidate; a graph that will be
        compiled should be checked.

    Example:
        >>> import jax, jax.numpy as jnp, pockjax
        >>> def step(params, opt_state, x):
        ...     loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(params)
        ...     return params - 0.1 * g, opt_state, loss
        >>> g = pockjax.trace_step(step, (jnp.ones((2, 3)), (), jnp.ones((4, 2))))
        >>> folded = pockjax.chain(pockjax.strip_tags(), pockjax.fold_dot_transpose())(g)
        >>> folded.record(pockjax.transforms.FoldDotTransposeRecord).folded
        1
        >>> [e.primitive.name for e in folded.jaxpr.eqns].count("transpose")
        0
    """
    return Pass("fold_dot_transpose", _fold_graph if check else functools.partial(_fold_graph, check=False))

"""Remove pockjax's parameter and gradient tags (identity ops) from a graph.

Tags exist so that passes can find parameters' gradients; the compiled
program does not need them. This pass runs last in :func:`pockjax.compile`.
"""

from __future__ import annotations

from pockjax import tags
from pockjax._src import jaxpr as _interp
from pockjax.graph import PassRecord, TrainGraph
from pockjax.transforms.base import Pass


def _is_tag(eqn) -> bool:
    return eqn.primitive in tags.TAG_PRIMITIVES


def _rule(eqn, invals):
    if _is_tag(eqn):
        return [invals[0]]
    return _interp.rewrite_nested(eqn, invals, _rule, _is_tag)


def _strip_tags_graph(graph: TrainGraph) -> TrainGraph:
    if not _interp.contains(graph.jaxpr, _is_tag):
        return graph
    closed = _interp.retrace(graph.closed_jaxpr, _rule)
    return graph.recorded(PassRecord("strip_tags"), closed_jaxpr=closed)


def strip_tags() -> Pass:
    """The pass that drops every ``pockjax_*_tag`` equation.

    A graph without tags comes back unchanged (the same object).

    Example:
        >>> import jax, jax.numpy as jnp, optax, pockjax
        >>> def step(p, s, x):
        ...     g = jax.grad(lambda p: jnp.sum(p * x))(p)
        ...     return p - 0.1 * g, s, None
        >>> g = pockjax.trace_step(step, (jnp.ones(3), (), jnp.ones(3)))
        >>> sorted(pockjax.count_primitives(pockjax.strip_tags()(g)))
        ['broadcast_in_dim', 'mul', 'reduce_sum', 'sub']
    """
    return Pass("strip_tags", _strip_tags_graph)

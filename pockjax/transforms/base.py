"""The one shape every pass has, and :func:`chain` to compose passes.

A pass is a :class:`Pass`: a small frozen record of a name and a rewrite
``TrainGraph -> TrainGraph``. Every pass in :mod:`pockjax.transforms` is made
by a factory, so they are all called the same way, options or not::

    pockjax.chain(pockjax.sparse_grad(scheme), pockjax.dce(), pockjax.fold_dot_transpose())

What a pass did (the scheme it applied, how many pairs it folded, the peaks
it measured) is a typed :class:`~pockjax.graph.PassRecord` it appends to the
graph's ``history``, found again with ``graph.record(RecordType)``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from pockjax.graph import TrainGraph

__all__ = ["Pass", "chain"]


@dataclasses.dataclass(frozen=True)
class Pass:
    """A graph rewrite: ``TrainGraph -> TrainGraph``, with a name.

    Attributes:
      name: what the pass is called (``"dce"``, ``"chain(sparse_grad, dce)"``).
      rewrite: the function that rewrites a graph. It must be pure: it
        returns a new graph and leaves its argument as it was.

    Calling a pass runs ``rewrite`` and checks that it returned a graph.
    A function of your own becomes a pass with ``Pass("name", fn)``.

    Example:
        >>> import jax.numpy as jnp, pockjax
        >>> noop = pockjax.Pass("noop", lambda graph: graph)
        >>> g = pockjax.trace_step(lambda p, s, x: (p, s, x @ p), (jnp.ones((2, 2)), (), jnp.ones(2)))
        >>> noop(g) is g, noop
        (True, Pass('noop'))
    """

    name: str
    rewrite: Callable[[TrainGraph], TrainGraph]

    def __call__(self, graph: TrainGraph) -> TrainGraph:
        if not isinstance(graph, TrainGraph):
            raise TypeError(
                f"pass {self.name!r} rewrites a pockjax.TrainGraph (from pockjax.trace_step); "
                f"got {type(graph).__name__}"
            )
        out = self.rewrite(graph)
        if not isinstance(out, TrainGraph):
            raise TypeError(f"pass {self.name!r} returned {type(out).__name__}, not a TrainGraph")
        return out

    def __repr__(self) -> str:
        return f"Pass({self.name!r})"


def _check_pass(p, position: int) -> Pass:
    if isinstance(p, Pass):
        return p
    if callable(p):
        name = getattr(p, "__name__", type(p).__name__)
        if getattr(p, "__module__", "").startswith("pockjax."):
            raise TypeError(
                f"chain: argument {position} is the pass factory {name}, not a pass: call it "
                f"(pockjax.{name}(), or with its options)"
            )
        raise TypeError(
            f"chain: argument {position} ({name}) is a function, not a pockjax.Pass; "
            f"wrap it: pockjax.Pass({name!r}, {name})"
        )
    raise TypeError(f"chain: argument {position} is a {type(p).__name__}, not a pockjax.Pass")


def chain(*passes: Pass) -> Pass:
    """Compose passes left to right into one pass, like ``optax.chain``.

    Args:
      *passes: :class:`Pass` objects, run in the order given.

    Returns:
      A :class:`Pass` named ``chain(<names>)``.

    Raises:
      TypeError: an argument is not a :class:`Pass` (for example a factory
        that was not called: ``pockjax.dce`` instead of ``pockjax.dce()``).

    Example:
        >>> import pockjax
        >>> pipeline = pockjax.chain(pockjax.sparse_grad(pockjax.UpdateScheme.full()), pockjax.dce())
        >>> pipeline.name
        'chain(sparse_grad, dce)'
    """
    checked = tuple(_check_pass(p, k) for k, p in enumerate(passes))

    def run_in_order(graph: TrainGraph) -> TrainGraph:
        for p in checked:
            graph = p(graph)
        return graph

    return Pass("chain(" + ", ".join(p.name for p in checked) + ")", run_in_order)

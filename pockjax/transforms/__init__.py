"""Passes over a :class:`~pockjax.graph.TrainGraph`, one module each.

Every pass is a pure function ``TrainGraph -> TrainGraph`` (or a factory that
returns one), composable with :func:`pockjax.chain`.
"""

from pockjax.transforms.dce import dce
from pockjax.transforms.sparse_grad import sparse_grad
from pockjax.transforms.strip_tags import strip_tags

__all__ = ["dce", "sparse_grad", "strip_tags"]

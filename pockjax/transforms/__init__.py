"""Passes over a :class:`~pockjax.graph.TrainGraph`, one module each.

Every pass is a pure function ``TrainGraph -> TrainGraph`` (or a factory that
returns one), composable with :func:`pockjax.chain`.
"""

from pockjax.transforms.dce import dce
from pockjax.transforms.fold_dot_transpose import fold_dot_transpose
from pockjax.transforms.inplace_update import inplace_update
from pockjax.transforms.reorder_for_memory import reorder_for_memory
from pockjax.transforms.sparse_grad import sparse_grad
from pockjax.transforms.strip_tags import strip_tags

__all__ = ["dce", "fold_dot_transpose", "inplace_update", "reorder_for_memory", "sparse_grad", "strip_tags"]

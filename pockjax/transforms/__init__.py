"""Passes over a :class:`~pockjax.graph.TrainGraph`, one module each.

Every pass has one shape, a :class:`Pass` (a name and a rewrite
``TrainGraph -> TrainGraph``), made by a factory and composed with
:func:`chain`: ``chain(sparse_grad(scheme), dce(), fold_dot_transpose())``.
What a pass did is a typed record on the graph's ``history``.
"""

from pockjax.transforms.base import Pass, chain
from pockjax.transforms.dce import dce
from pockjax.transforms.fold_dot_transpose import FoldDotTransposeRecord, fold_dot_transpose
from pockjax.transforms.inplace_update import InplaceUpdateRecord, inplace_update
from pockjax.transforms.reorder_for_memory import ReorderForMemoryRecord, reorder_for_memory
from pockjax.transforms.sparse_grad import SparseGradRecord, sparse_grad
from pockjax.transforms.strip_tags import strip_tags

__all__ = [
    "FoldDotTransposeRecord",
    "InplaceUpdateRecord",
    "Pass",
    "ReorderForMemoryRecord",
    "SparseGradRecord",
    "chain",
    "dce",
    "fold_dot_transpose",
    "inplace_update",
    "reorder_for_memory",
    "sparse_grad",
    "strip_tags",
]

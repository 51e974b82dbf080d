"""pockjax: sparse, efficient, compile-first fine-tuning in JAX.

PockEngine (Zhu et al., MICRO 2023) for JAX: trace the whole train step,
rewrite it with composable passes (``sparse_grad``, ``dce``, ...), compile it.
"""

from pockjax.analysis import PruneSummary, count_flops, count_primitives, summarize
from pockjax.compile import CompiledFunction, CompiledStep, chain, compile, default_passes
from pockjax.errors import (
    BackendError,
    ChannelRuleError,
    PockjaxError,
    SchemeError,
    StepSignatureError,
    UnknownRuleError,
    UnmatchedPatternError,
    UnsupportedPrimitiveError,
)
from pockjax.graph import TrainGraph, trace_step
from pockjax.optim.state import SparseOptState, init_opt_state
from pockjax.paths import leaf_paths
from pockjax.scheme import Channels, Frozen, Full, UpdateScheme, channels
from pockjax.transforms import dce, sparse_grad, strip_tags

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "ChannelRuleError",
    "Channels",
    "CompiledFunction",
    "CompiledStep",
    "Frozen",
    "Full",
    "PockjaxError",
    "PruneSummary",
    "SchemeError",
    "SparseOptState",
    "StepSignatureError",
    "TrainGraph",
    "UnknownRuleError",
    "UnmatchedPatternError",
    "UnsupportedPrimitiveError",
    "UpdateScheme",
    "chain",
    "channels",
    "compile",
    "count_flops",
    "count_primitives",
    "dce",
    "default_passes",
    "init_opt_state",
    "leaf_paths",
    "sparse_grad",
    "strip_tags",
    "summarize",
    "trace_step",
]

"""pockjax: sparse, efficient, compile-first fine-tuning in JAX.

PockEngine (Zhu et al., MICRO 2023) for JAX: trace the whole train step,
rewrite it with composable passes (``sparse_grad``, ``dce``, ...), compile it.

Names are imported lazily, so that ``from pockjax import runtime`` works on a
device where JAX is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "PruneSummary": "pockjax.analysis",
    "count_flops": "pockjax.analysis",
    "count_primitives": "pockjax.analysis",
    "summarize": "pockjax.analysis",
    "CompiledFunction": "pockjax.compiler",
    "CompiledStep": "pockjax.compiler",
    "Lowered": "pockjax.compiler",
    "compile": "pockjax.compiler",
    "default_passes": "pockjax.compiler",
    "BackendError": "pockjax.errors",
    "ChannelRuleError": "pockjax.errors",
    "CheckpointError": "pockjax.errors",
    "DataError": "pockjax.errors",
    "FileFormatError": "pockjax.errors",
    "FileMissingError": "pockjax.errors",
    "GGUFError": "pockjax.errors",
    "ModelFileError": "pockjax.errors",
    "NonFiniteError": "pockjax.errors",
    "PockjaxError": "pockjax.errors",
    "SafetensorsError": "pockjax.errors",
    "TorchCheckpointError": "pockjax.errors",
    "SchemeError": "pockjax.errors",
    "SchemeFileError": "pockjax.errors",
    "StepSignatureError": "pockjax.errors",
    "TokenizerFileError": "pockjax.errors",
    "UnknownModelError": "pockjax.errors",
    "UnknownRuleError": "pockjax.errors",
    "UnmatchedPatternError": "pockjax.errors",
    "UnsupportedModelError": "pockjax.errors",
    "UnsupportedPrimitiveError": "pockjax.errors",
    "PassRecord": "pockjax.graph",
    "TrainGraph": "pockjax.graph",
    "trace_step": "pockjax.graph",
    "keep_step_memory": "pockjax.host",
    "step_memory_kept": "pockjax.host",
    "SparseOptState": "pockjax.optim.state",
    "init_opt_state": "pockjax.optim.state",
    "leaf_paths": "pockjax.paths",
    "ShardingError": "pockjax.sharding",
    "partition_specs": "pockjax.sharding",
    "shard": "pockjax.sharding",
    "shard_batch": "pockjax.sharding",
    "shard_like": "pockjax.sharding",
    "shard_train_state": "pockjax.sharding",
    "Channels": "pockjax.scheme",
    "Frozen": "pockjax.scheme",
    "Full": "pockjax.scheme",
    "UpdateScheme": "pockjax.scheme",
    "channels": "pockjax.scheme",
    "Lora": "pockjax.scheme",
    "lora": "pockjax.scheme",
    "LoraTensor": "pockjax.adapters",
    "add_adapters": "pockjax.adapters",
    "low_rank": "pockjax.transforms.low_rank",
    "LowRankRecord": "pockjax.transforms.low_rank",
    "Pass": "pockjax.transforms.base",
    "chain": "pockjax.transforms.base",
    "dce": "pockjax.transforms.dce",
    "fold_dot_transpose": "pockjax.transforms.fold_dot_transpose",
    "inplace_update": "pockjax.transforms.inplace_update",
    "mixed_precision": "pockjax.transforms.precision",
    "QTensor": "pockjax.quant",
    "reorder_for_memory": "pockjax.transforms.reorder_for_memory",
    "sparse_grad": "pockjax.transforms.sparse_grad",
    "strip_tags": "pockjax.transforms.strip_tags",
}
_SUBMODULES = ("adapters", "analysis", "backends", "data", "memory", "models", "optim", "quant", "runtime", "scheme", "sharding",
               "transforms")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"pockjax.{name}")
    raise AttributeError(f"module 'pockjax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))

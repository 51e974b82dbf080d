"""Fine-tuning LLaMA models with sparse update schemes: ``pockjax finetune`` / ``generate``.

Example (not run: loads SmolLM2-135M)::

    from pockjax.train import FinetuneConfig, finetune
    result = finetune(FinetuneConfig(scheme="paper", steps=100, out="/tmp/ft"))
    result.metrics["accuracy_after"]
"""

from pockjax.train.finetune import (
    FinetuneConfig,
    FinetuneError,
    FinetuneResult,
    finetune,
    make_optimizer,
    write_output,
)
from pockjax.train.schemes import (
    DEFAULT_BLOCKS,
    SCHEMES,
    llama_scheme,
    load_scheme_file,
    save_scheme_file,
)

__all__ = [
    "DEFAULT_BLOCKS",
    "FinetuneConfig",
    "FinetuneError",
    "FinetuneResult",
    "SCHEMES",
    "finetune",
    "llama_scheme",
    "load_scheme_file",
    "make_optimizer",
    "save_scheme_file",
    "write_output",
]

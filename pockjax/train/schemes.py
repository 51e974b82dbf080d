"""Named update schemes for LLaMA models, and scheme files.

The schemes themselves are defined once, in :mod:`pockjax.schemes` (the
registry every command takes ``paper`` from); this module is the LLaMA-facing
name for them that ``pockjax finetune``, the benchmarks and older code use:

* ``full``, ``paper``, ``norm-only``, ``channels``: see :mod:`pockjax.schemes`
  (``paper``: attention ``wq``/``wk``/``wv``/``wo`` and FFN ``w1``/``w3`` of
  the last :func:`~pockjax.schemes.paper_blocks` blocks);
* a path to a JSON file written from :meth:`UpdateScheme.to_dict`.

Example:
  >>> from flax import nnx
  >>> from pockjax.models import llama
  >>> model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  >>> scheme = llama_scheme("paper", model.config, blocks=1)
  >>> [p for p, _ in scheme.rules][:2]
  ['layers.1.attn.wq.kernel', 'layers.1.attn.wk.kernel']
  >>> scheme.describe(llama.split(model)[1]).trainable
  24576
"""

from __future__ import annotations

from typing import Any

import pockjax
from pockjax.schemes import (
    DEFAULT_BLOCKS,
    load_scheme_file,
    paper_blocks,
    resolve_scheme,
    save_scheme_file,
    schemes,
)

__all__ = ["DEFAULT_BLOCKS", "SCHEMES", "llama_scheme", "load_scheme_file", "paper_blocks",
           "save_scheme_file"]

#: The named LLaMA schemes and a one-line summary of each (from the registry).
SCHEMES = {name: s.summary for name, s in schemes("llama").items()}


def llama_scheme(name: str, config: Any, *, blocks: int | None = None,
                 fraction: float = 0.5) -> pockjax.UpdateScheme:
    """A named scheme (:mod:`pockjax.schemes`) or a scheme file, for a LLaMA config.

    The same lookup as :func:`pockjax.schemes.resolve_scheme`.

    Args:
      name: ``full``, ``paper``, ``norm-only``, ``channels``, or a path to a
        JSON scheme file.
      config: The model's :class:`~pockjax.models.llama.LlamaConfig`.
      blocks: Last blocks trained by ``paper``/``channels`` (default
        :func:`~pockjax.schemes.paper_blocks`; more than the model has is an error).
      fraction: Channel fraction of ``channels``.

    Raises:
      SchemeError: unknown name, or an unreadable scheme file.

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> str(llama_scheme("channels", LlamaConfig.tiny(), blocks=1).rules[0][1])
      'channels(0.5, axis=-1)'
    """
    return resolve_scheme(name, config, blocks=blocks, fraction=fraction)

"""Named update schemes for LLaMA models, and scheme files.

Every scheme is an ordinary :class:`pockjax.UpdateScheme` over the dotted
parameter paths of an unrolled :class:`pockjax.models.llama.Llama`
(``layers.27.attn.wq.kernel``, ``layers.27.mlp.w1.kernel``, ...):

* ``full``: every parameter.
* ``paper``: PockEngine's sparse scheme for LLaMA: the attention projections
  (``wq``, ``wk``, ``wv``, ``wo``) and the first FFN projections (``w1`` gate,
  ``w3`` up; not the down projection ``w2``) of the last ``blocks`` blocks.
* ``norm-only``: the RMSNorm scales.
* ``channels``: ``paper`` with :func:`pockjax.channels` (half the output
  channels by default) on the same tensors.
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

import json
import os
from typing import Any

import pockjax
from pockjax.errors import SchemeError

__all__ = ["DEFAULT_BLOCKS", "SCHEMES", "llama_scheme", "load_scheme_file", "save_scheme_file"]

#: ``paper`` trains this many last blocks unless told otherwise.
DEFAULT_BLOCKS = 10

SCHEMES = {
    "full": "every parameter",
    "paper": "attention wq/wk/wv/wo + FFN w1/w3 of the last N blocks (PockEngine)",
    "norm-only": "RMSNorm scales only",
    "channels": "the paper scheme on half of each tensor's output channels",
}

_PAPER_TENSORS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w3")


def _last_blocks(config: Any, blocks: int | None) -> range:
    n_layers = config.n_layers
    blocks = DEFAULT_BLOCKS if blocks is None else int(blocks)
    if blocks < 1:
        raise SchemeError(f"--blocks must be at least 1, got {blocks}")
    blocks = min(blocks, n_layers)
    return range(n_layers - blocks, n_layers)


def llama_scheme(name: str, config: Any, *, blocks: int | None = None,
                 fraction: float = 0.5) -> pockjax.UpdateScheme:
    """A named scheme (see the module docstring) or a scheme file, for a LLaMA config.

    Args:
      name: ``full``, ``paper``, ``norm-only``, ``channels``, or a path to a
        JSON scheme file.
      config: The model's :class:`~pockjax.models.llama.LlamaConfig` (must
        have unrolled layers for the block-wise schemes).
      blocks: Last blocks trained by ``paper``/``channels`` (default
        :data:`DEFAULT_BLOCKS`, capped at the model's depth).
      fraction: Channel fraction of ``channels``.

    Raises:
      SchemeError: unknown name, or an unreadable scheme file.

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> str(llama_scheme("channels", LlamaConfig.tiny(), blocks=1).rules[0][1])
      'channels(0.5, axis=-1)'
    """
    key = name.lower().replace("_", "-")
    if key == "full":
        return pockjax.UpdateScheme.full()
    if key in ("norm-only", "norm"):
        return pockjax.UpdateScheme.norm_only()
    if key == "paper" and getattr(config, "scan_layers", False):
        # stacked blocks: the same tensors, as rows of the leading layer axis;
        # the backward scan then runs over the trained blocks only
        last = list(_last_blocks(config, blocks))
        rows = pockjax.channels(indices=last, axis=0)
        n = len(last)
        return pockjax.UpdateScheme([(f"layers.{t}.kernel", rows) for t in _PAPER_TENSORS],
                                    name=f"paper (last {n} block{'s' if n > 1 else ''}, stacked)")
    if key in ("paper", "channels"):
        if getattr(config, "scan_layers", False):
            raise SchemeError(f"the {key!r} scheme selects channels within each block; load the"
                              f" model with unrolled layers (scan_layers=False)")
        rule = "full" if key == "paper" else pockjax.channels(float(fraction))
        rules = [(f"layers.{i}.{t}.kernel", rule)
                 for i in _last_blocks(config, blocks) for t in _PAPER_TENSORS]
        n = len(_last_blocks(config, blocks))
        return pockjax.UpdateScheme(rules, name=f"{key} (last {n} block{'s' if n > 1 else ''})")
    if os.path.exists(name) or name.endswith(".json"):
        return load_scheme_file(name)
    raise SchemeError(f"unknown scheme {name!r}; use one of {', '.join(SCHEMES)}"
                      f" or a path to a JSON scheme file")


def load_scheme_file(path: str | os.PathLike) -> pockjax.UpdateScheme:
    """Reads a scheme file (JSON of :meth:`pockjax.UpdateScheme.to_dict`).

    Raises:
      SchemeError: missing file, invalid JSON or not a scheme.

    Example:
      >>> import tempfile
      >>> p = os.path.join(tempfile.mkdtemp(), "s.json")
      >>> save_scheme_file(p, pockjax.UpdateScheme({"norm.scale": "full"}))
      >>> load_scheme_file(p).rules[0][0]
      'norm.scale'
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SchemeError(f"scheme file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SchemeError(f"{path} is not valid JSON ({e})") from None
    try:
        return pockjax.UpdateScheme.from_dict(data)
    except SchemeError as e:
        raise SchemeError(f"{path}: {e}") from None


def save_scheme_file(path: str | os.PathLike, scheme: pockjax.UpdateScheme) -> None:
    """Writes ``scheme.to_dict()`` as JSON (atomically)."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(scheme.to_dict(), f, indent=1)
    os.replace(tmp, path)

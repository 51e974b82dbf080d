"""Named update schemes for BERT encoders (family ``bert``).

Registered with :mod:`pockjax.schemes` when :mod:`pockjax.models.bert` is
imported; they match the paths of :class:`~pockjax.models.bert.BertModel` and
:class:`~pockjax.models.bert.BertClassifier` (``layers.5.attn.q.kernel``,
``layers.5.mlp.up.bias``, ``head.kernel``, ...). ``head.*`` is trained by every
scheme when the config has ``num_classes`` (a classifier's config), and is
absent otherwise.

* ``paper``: PockEngine's sparse scheme carried over to encoders: the attention
  projections ``q``, ``k``, ``v``, ``o`` and the first FFN projection ``up``
  (kernels and biases; not ``down``) of the last N layers, plus the head.
  N defaults to the last half of the layers, rounded up (:func:`encoder_blocks`;
  MiniLM-L6: 3 of 6, BERT-base: 6 of 12): LLaMA's default of at least 10
  blocks (:func:`pockjax.schemes.paper_blocks`) would train every layer of
  these shallow encoders. ``--blocks`` sets N (at most the depth).
* ``channels``: ``paper`` with :func:`pockjax.channels` (half the output
  channels by default) on the same kernels and biases; the head stays full.
* ``bias-only``: every bias, the LayerNorm scales and the head (BitFit).
* ``last-blocks``: every parameter of the last N layers (same N), plus the head.
* ``head-only``: the classification head only (needs ``num_classes``).
* ``full`` and ``norm-only`` (every LayerNorm scale and bias) exist for every family.

Example:
    >>> from pockjax.schemes import get_scheme, scheme_names
    >>> from pockjax.models.bert import BertConfig
    >>> scheme_names("bert")
    ('full', 'norm-only', 'paper', 'channels', 'bias-only', 'last-blocks', 'head-only')
    >>> s = get_scheme("paper", BertConfig.minilm_l6(num_classes=2))
    >>> s.name, s.rules[0][0], s.rules[-1][0]
    ('paper (last 3 of 6 layers, head)', 'layers.3.attn.q.*', 'head.*')
"""

from __future__ import annotations

import math
from typing import Any

from pockjax.errors import SchemeError
from pockjax.models.bert.config import BertConfig
from pockjax.scheme import UpdateScheme, channels
from pockjax.schemes import paper_blocks, register_family, register_scheme

__all__ = ["PAPER_TENSORS", "encoder_blocks"]

#: The tensors of each trained layer in ``paper``: attention and the first FFN
#: projection (kernel and bias of each).
PAPER_TENSORS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up")

FAMILY = "bert"


def encoder_blocks(n_layers: int, blocks: int | None = None) -> int:
    """How many of the last layers ``paper``, ``channels`` and ``last-blocks`` train.

    By default the last half of the layers (rounded up); an explicit ``blocks``
    is checked by :func:`pockjax.schemes.paper_blocks`.

    Raises:
        SchemeError: ``blocks`` below 1 or above the depth.

    Example:
        >>> [encoder_blocks(n) for n in (1, 2, 6, 12, 24)], encoder_blocks(6, 4)
        ([1, 1, 3, 6, 12], 4)
    """
    if blocks is None:
        return max(1, math.ceil(n_layers / 2))
    return paper_blocks(n_layers, blocks)


def _is_bert(config: Any) -> bool:
    return isinstance(config, BertConfig)


register_family(FAMILY, _is_bert)


def _head(config: BertConfig) -> list[tuple[str, str]]:
    return [("head.*", "full")] if config.num_classes is not None else []


def _label(kind: str, n: int, config: BertConfig) -> str:
    head = ", head" if config.num_classes is not None else ""
    return f"{kind} (last {n} of {config.layers} layer{'s' if config.layers > 1 else ''}{head})"


@register_scheme("paper", FAMILY,
                 "attention q/k/v/o + FFN up (kernels and biases) of the last N layers, and the"
                 " head (PockEngine; N = half the layers)", options=("blocks",))
def _paper(config: BertConfig, *, blocks: int | None = None, fraction: float = 0.5
           ) -> UpdateScheme:
    n = encoder_blocks(config.layers, blocks)
    rules = [(f"layers.{i}.{t}.*", "full")
             for i in range(config.layers - n, config.layers) for t in PAPER_TENSORS]
    return UpdateScheme(rules + _head(config), name=_label("paper", n, config))


@register_scheme("channels", FAMILY,
                 "the paper scheme on a fraction (half) of each tensor's output channels",
                 options=("blocks", "fraction"))
def _channels(config: BertConfig, *, blocks: int | None = None, fraction: float = 0.5
              ) -> UpdateScheme:
    n = encoder_blocks(config.layers, blocks)
    rule = channels(float(fraction))
    rules = [(f"layers.{i}.{t}.*", rule)
             for i in range(config.layers - n, config.layers) for t in PAPER_TENSORS]
    return UpdateScheme(rules + _head(config), name=_label("channels", n, config))


@register_scheme("bias-only", FAMILY, "every bias, the LayerNorm scales and the head (BitFit)")
def _bias_only(config: BertConfig, *, blocks: int | None = None, fraction: float = 0.5
               ) -> UpdateScheme:
    rules = [("**.bias", "full"), ("**.*norm*.scale", "full")]
    return UpdateScheme(rules + _head(config), name="bias-only")


@register_scheme("last-blocks", FAMILY, "every parameter of the last N layers, and the head", options=("blocks",))
def _last_blocks(config: BertConfig, *, blocks: int | None = None, fraction: float = 0.5
                 ) -> UpdateScheme:
    n = encoder_blocks(config.layers, blocks)
    rules = [(f"layers.{i}.**", "full") for i in range(config.layers - n, config.layers)]
    return UpdateScheme(rules + _head(config), name=_label("last-blocks", n, config))


@register_scheme("head-only", FAMILY, "the classification head only")
def _head_only(config: BertConfig, *, blocks: int | None = None, fraction: float = 0.5
               ) -> UpdateScheme:
    if config.num_classes is None:
        raise SchemeError("the 'head-only' scheme needs a classifier: this BertConfig has no"
                          " num_classes (use BertClassifier's config)")
    return UpdateScheme(_head(config), name="head-only")

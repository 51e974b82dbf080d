"""MobileNetV2's named update schemes (registered on import of :mod:`pockjax.models.mobilenetv2`).

Blocks are ``blocks.0`` ... ``blocks.16``; every block but ``blocks.0``
(expansion t = 1) starts with a point-wise *expand* conv. N, the number of
last blocks a block-wise scheme trains, follows :func:`pockjax.schemes.paper_blocks`
over the blocks concerned: a third of them, at least 10, at most all (``paper``
and ``channels``: 10 of the 16 blocks with an expand conv, ``blocks.7`` ...
``blocks.16``; ``last-blocks``: 10 of 17); ``blocks=`` overrides it.

* ``paper``: PockEngine's MobileNetV2 scheme: the expand (first point-wise)
  conv kernel of the last N blocks that have one, the BatchNorm biases of
  those blocks and of the last 1x1 conv, and the classifier head. The
  backward pass stops at the first trained block (biases of the early blocks
  would carry it down to the stem: at 64x64, batch 32, the step then took
  155 ms instead of 85 ms, with full fine-tuning at 237 ms).
* ``channels``: ``paper`` with :func:`pockjax.channels` (``fraction`` of the
  output channels, half by default) on those expand kernels.
* ``bias-only``: every BatchNorm bias and the head.
* ``last-blocks``: every parameter of the last N blocks, the last 1x1 conv
  (and its BatchNorm) and the head.
* ``head-only``: the classifier head.
* ``full`` and ``norm-only`` (every BatchNorm scale and bias, through the
  ``*norm*`` segment of ``<conv>.norm.scale``) are registered for every family.

Example:
    >>> from pockjax.schemes import get_scheme, scheme_names
    >>> from pockjax.models.mobilenetv2 import MobileNetV2Config
    >>> scheme_names("mobilenetv2")
    ('full', 'norm-only', 'paper', 'channels', 'bias-only', 'last-blocks', 'head-only')
    >>> s = get_scheme("paper", MobileNetV2Config())
    >>> s.name, s.rules[0][0], len(s.rules)
    ('paper (last 10 blocks)', 'blocks.7.expand.conv.kernel', 23)
"""

from __future__ import annotations

from typing import Any

from pockjax.errors import SchemeError
from pockjax.scheme import UpdateScheme, channels
from pockjax.schemes import paper_blocks, register_family, register_scheme
from pockjax.models.mobilenetv2.model import MobileNetV2Config

__all__ = ["FAMILY", "expand_paper_blocks"]

FAMILY = "mobilenetv2"

register_family(FAMILY, lambda c: isinstance(c, MobileNetV2Config))

#: Every BatchNorm bias and the head (bias-only, and part of paper / channels).
_BIASES_AND_HEAD = [("**.norm.bias", "full"), ("head.kernel", "full"), ("head.bias", "full")]


def _plural(n: int) -> str:
    return f"{n} block{'s' if n > 1 else ''}"


def expand_paper_blocks(config: MobileNetV2Config, blocks: int | None = None) -> list[int]:
    """The blocks whose expand conv ``paper`` and ``channels`` train: those of the last N
    blocks that have one (N = ``blocks``, or :func:`~pockjax.schemes.paper_blocks`' default).

    Raises:
        SchemeError: ``blocks`` outside 1..the block count, or no expand conv among
          the last N blocks.

    Example:
        >>> expand_paper_blocks(MobileNetV2Config(), 3)
        [14, 15, 16]
        >>> len(expand_paper_blocks(MobileNetV2Config(), 17))  # every block: the first has no expand conv
        16
    """
    n = paper_blocks(config.n_blocks, blocks)
    chosen = [i for i in config.expand_blocks() if i >= config.n_blocks - n]
    if not chosen:
        raise SchemeError(f"none of the last {_plural(n)} of this MobileNetV2 has an expand conv (t is 1):"
                          f" give a larger --blocks (at most {config.n_blocks})")
    return chosen


def _paper_rules(chosen: list[int], rule: Any) -> list[tuple[str, Any]]:
    return ([(f"blocks.{i}.expand.conv.kernel", rule) for i in chosen]
            + [(f"blocks.{i}.*.norm.bias", "full") for i in chosen]
            + [("last.norm.bias", "full"), ("head.kernel", "full"), ("head.bias", "full")])


@register_scheme("paper", FAMILY,
                 "expand (first point-wise) conv + BatchNorm biases of the last N blocks (those with"
                 " an expand conv), last conv's bias, head (PockEngine; N = a third of the blocks, at least 10)",
                 options=("blocks",))
def _paper(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    chosen = expand_paper_blocks(config, blocks)
    return UpdateScheme(_paper_rules(chosen, "full"), name=f"paper (last {_plural(len(chosen))})")


@register_scheme("channels", FAMILY,
                 "paper with a fraction (half) of the expand convs' output channels", options=("blocks", "fraction"))
def _channels(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    chosen = expand_paper_blocks(config, blocks)
    return UpdateScheme(_paper_rules(chosen, channels(float(fraction))),
                        name=f"channels (last {_plural(len(chosen))})")


@register_scheme("bias-only", FAMILY, "every BatchNorm bias + head")
def _bias_only(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    return UpdateScheme(_BIASES_AND_HEAD, name="bias-only")


@register_scheme("last-blocks", FAMILY, "every parameter of the last N blocks + last conv + head", options=("blocks",))
def _last_blocks(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    n = paper_blocks(config.n_blocks, blocks)
    return UpdateScheme([(f"blocks.{i}.**", "full") for i in range(config.n_blocks - n, config.n_blocks)]
                        + [("last.**", "full"), ("head.kernel", "full"), ("head.bias", "full")],
                        name=f"last-blocks (last {_plural(n)})")


@register_scheme("head-only", FAMILY, "the classifier head only")
def _head_only(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    return UpdateScheme([("head.kernel", "full"), ("head.bias", "full")], name="head-only")

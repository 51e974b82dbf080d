"""Search units: one LLaMA block x one projection kind (``layers.27.mlp.w1.kernel``).

Example:
  >>> from pockjax.models.llama import LlamaConfig
  >>> units = all_units(LlamaConfig.tiny())
  >>> len(units), units[0].name, units[0].path
  (14, 'L0.wq', 'layers.0.attn.wq.kernel')
  >>> scheme_for([Unit(1, "w1")]).rules[0][0]
  'layers.1.mlp.w1.kernel'
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Sequence

import pockjax
from pockjax.errors import SchemeError

__all__ = ["KINDS", "Unit", "all_units", "scheme_for", "units_of_scheme", "parse_unit"]

#: Tensor kinds of a LLaMA block, in the order the forward pass uses them.
KINDS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
_PREFIX = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "attn", "w1": "mlp", "w2": "mlp", "w3": "mlp"}


@dataclasses.dataclass(frozen=True, order=True)
class Unit:
    """One trainable tensor: ``kind`` (``wq`` ... ``w3``) of block ``block``."""

    block: int
    kind: str

    @property
    def path(self) -> str:
        """The dotted parameter path (``layers.3.attn.wq.kernel``)."""
        return f"layers.{self.block}.{_PREFIX[self.kind]}.{self.kind}.kernel"

    @property
    def name(self) -> str:
        """Short name, ``L3.wq``."""
        return f"L{self.block}.{self.kind}"

    def __str__(self) -> str:
        return self.name


def parse_unit(text: str) -> Unit:
    """``"L3.wq"`` or ``"layers.3.attn.wq.kernel"`` -> :class:`Unit`.

    Example:
      >>> parse_unit("L3.w2"), parse_unit("layers.0.attn.wk.kernel").name
      (Unit(block=3, kind='w2'), 'L0.wk')
    """
    m = re.fullmatch(r"L(\d+)\.(\w+)", text) or re.fullmatch(r"layers\.(\d+)\.(?:attn|mlp)\.(\w+)\.kernel", text)
    if not m or m.group(2) not in _PREFIX:
        raise SchemeError(f"not a search unit: {text!r} (expected e.g. L3.wq or layers.3.attn.wq.kernel)")
    return Unit(int(m.group(1)), m.group(2))


def all_units(config: Any, kinds: Sequence[str] = KINDS, blocks: Iterable[int] | None = None) -> list[Unit]:
    """Every unit of a config (blocks ascending, kinds in :data:`KINDS` order)."""
    bad = [k for k in kinds if k not in _PREFIX]
    if bad:
        raise SchemeError(f"unknown tensor kind(s) {bad}; use some of {', '.join(KINDS)}")
    blocks = range(config.n_layers) if blocks is None else sorted(set(blocks))
    for b in blocks:
        if not 0 <= b < config.n_layers:
            raise SchemeError(f"block {b} out of range: the model has {config.n_layers} blocks")
    order = [k for k in KINDS if k in kinds]
    return [Unit(b, k) for b in blocks for k in order]


def scheme_for(units: Iterable[Unit], name: str | None = None) -> pockjax.UpdateScheme:
    """The :class:`pockjax.UpdateScheme` training exactly ``units`` (everything else frozen)."""
    units = sorted(set(units))
    return pockjax.UpdateScheme([(u.path, "full") for u in units], name=name or f"searched ({len(units)} tensors)")


def units_of_scheme(scheme: pockjax.UpdateScheme, config: Any) -> list[Unit]:
    """The units a scheme trains fully (a channel rule counts as trained too).

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> from pockjax.train.schemes import llama_scheme
      >>> [u.name for u in units_of_scheme(llama_scheme("paper", LlamaConfig.tiny(), blocks=1), LlamaConfig.tiny())]
      ['L1.wq', 'L1.wk', 'L1.wv', 'L1.wo', 'L1.w1', 'L1.w3']
    """
    out = []
    for u in all_units(config):
        rule, _ = scheme.rule_for(u.path)
        if str(rule) != "frozen":
            out.append(u)
    return out

"""Scheme search: which tensors to fine-tune under a memory and step-time budget.

PockEngine measures each layer's contribution to fine-tuning quality and its
cost, and picks the best set under a budget. :mod:`pockjax.search` does that
for LLaMA models, one unit per block x projection kind:

* :mod:`~pockjax.search.cost`: exact FLOPs and planned memory of a pruned step
  for any set of units, and a calibrated model of them with the depth coupling;
* :mod:`~pockjax.search.contribution`: a first-order gain proxy from a few
  gradients, and short real fine-tunes to validate it;
* :mod:`~pockjax.search.search`: the budgeted search and the scheme file;
* :mod:`~pockjax.search.cli`: ``pockjax search``;
* :mod:`~pockjax.search.classifier`: the same question for MobileNetV2 and BERT
  classifiers, answered by real short fine-tunes of each block x tensor kind
  (``pockjax search --model mobilenetv2``).
"""

from pockjax.search.units import KINDS, Unit, all_units, parse_unit, scheme_for, units_of_scheme

__all__ = ["KINDS", "Unit", "all_units", "parse_unit", "scheme_for", "units_of_scheme"]

"""Argparse ``type=`` functions that refuse bad numbers before any work starts.

Each returns the parsed value or raises :class:`argparse.ArgumentTypeError`,
which argparse prints as one line naming the option
(``pockjax finetune: error: argument --lr: must be a finite number > 0, got 'inf'``)
and exits with status 2. ``nan`` and ``inf`` are refused by every float type.

Example:
  >>> import argparse
  >>> p = argparse.ArgumentParser()
  >>> _ = p.add_argument("--steps", type=positive_int)
  >>> _ = p.add_argument("--lr", type=positive_finite_float)
  >>> p.parse_args(["--steps", "3", "--lr", "1e-3"])
  Namespace(steps=3, lr=0.001)
  >>> positive_finite_float("inf")
  Traceback (most recent call last):
  ...
  argparse.ArgumentTypeError: must be a finite number > 0, got 'inf'
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["int_at_least", "positive_int", "non_negative_int", "finite_float",
           "float_in", "positive_finite_float", "non_negative_finite_float", "probability",
           "StoreGiven", "given_options"]


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """A ``type=`` for whole numbers ``>= low``."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


#: Whole numbers >= 1 (steps, batch sizes, counts).
positive_int = int_at_least(1)
#: Whole numbers >= 0.
non_negative_int = int_at_least(0)


def finite_float(text: str) -> float:
    """Any finite number (no ``nan``, ``inf``)."""
    return _float(text)


def float_in(low: float | None = None, high: float | None = None, *, low_open: bool = False,
             high_open: bool = False) -> Callable[[str], float]:
    """A ``type=`` for finite numbers in ``[low, high]`` (``(`` / ``)`` with ``*_open``)."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    want = "a finite number" + (" " + " and ".join(parts) if parts else "")

    def parse(text: str) -> float:
        try:
            value = _float(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        if high is not None and (value >= high if high_open else value > high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = want
    return parse


#: Finite numbers > 0 (learning rates, sizes in GB).
positive_finite_float = float_in(0.0, low_open=True)
#: Finite numbers >= 0.
non_negative_finite_float = float_in(0.0)
#: Numbers in (0, 1] (top-p, fractions).
probability = float_in(0.0, 1.0, low_open=True)


class StoreGiven(argparse.Action):
    """``action=StoreGiven``: store the value and remember that the option was given.

    :func:`given_options` then tells an option set on the command line from one
    left at its default, even when both have the same value (``--resume``
    needs this: only the options given may differ from the run's own).

    Example:
      >>> p = argparse.ArgumentParser()
      >>> _ = p.add_argument("--steps", type=positive_int, default=100, action=StoreGiven)
      >>> _ = p.add_argument("--lr", type=positive_finite_float, default=0.1, action=StoreGiven)
      >>> sorted(given_options(p.parse_args(["--lr", "0.1"])))
      ['lr']
    """

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, "_given_options", set(getattr(namespace, "_given_options", ())) | {self.dest})


def given_options(args: argparse.Namespace) -> set:
    """The destinations of the :class:`StoreGiven` options set on the command line."""
    return set(getattr(args, "_given_options", ()))

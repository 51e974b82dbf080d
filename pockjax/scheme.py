"""Sparse update schemes: which parameters (and which channels) are trained.

A scheme is declarative: an ordered list of ``(pattern, rule)`` pairs over
dotted parameter paths plus a default rule. The first pattern that matches a
path decides its rule. Patterns are globs over path segments:

* ``*`` matches within one segment (``layers.*.attn.wq.kernel``),
* ``**`` matches any number of whole segments, including none
  (``**.bias`` matches ``bias`` and ``layers.0.mlp.bias``),
* ``?`` and ``[abc]`` as in shell globs.

Rules are ``"full"``, ``"frozen"``, :func:`channels` or :func:`lora`.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import math
import re
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from pockjax.errors import (
    ChannelRuleError,
    SchemeError,
    UnknownRuleError,
    UnmatchedPatternError,
)
from pockjax.paths import leaf_paths


@dataclasses.dataclass(frozen=True)
class Full:
    """Train every entry of the tensor."""

    def __str__(self) -> str:
        return "full"


@dataclasses.dataclass(frozen=True)
class Frozen:
    """Train nothing: the tensor keeps its value, its gradient is never computed."""

    def __str__(self) -> str:
        return "frozen"


@dataclasses.dataclass(frozen=True)
class Channels:
    """Train a subset of channels along one axis (PockEngine's sparse tensor BP).

    Exactly one of ``count`` (an int k, or a fraction in (0, 1)) and ``indices``
    is set. Build it with :func:`channels`.
    """

    count: Union[int, float, None] = None
    axis: int = -1
    indices: Union[tuple[int, ...], None] = None

    def resolve(self, path: str, shape: Sequence[int]) -> "ChannelSelect":
        """The concrete channel selection for a tensor of ``shape``."""
        if len(shape) == 0:
            raise ChannelRuleError(f"{path}: a channel rule needs a tensor with at least one axis, got a scalar")
        ndim = len(shape)
        if not -ndim <= self.axis < ndim:
            raise ChannelRuleError(
                f"{path}: channel axis {self.axis} is out of range for shape {tuple(shape)}"
            )
        axis = self.axis % ndim
        size = int(shape[axis])
        if self.indices is not None:
            # negative indices count from the end, as in Python: indices=[-2, -1]
            # on axis 0 of layers stacked for lax.scan trains the last two layers
            given = [int(i) + size if -size <= int(i) < 0 else int(i) for i in self.indices]
            idx = tuple(sorted(set(given)))
            twice = sorted(i for i, n in collections.Counter(given).items() if n > 1)
            if twice:  # a typo that would train fewer channels than listed
                raise ChannelRuleError(f"{path}: channel indices {list(self.indices)} name channel(s) {twice} of"
                                       f" axis {axis} more than once (negative indices count from the end)")
            bad = [i for i in idx if not 0 <= i < size]
            if bad:
                raise ChannelRuleError(
                    f"{path}: channel indices {bad} are outside axis {axis} of size {size}"
                )
            if not idx:
                raise ChannelRuleError(f"{path}: empty channel index set; use 'frozen' instead")
            return ChannelSelect(axis=axis, size=size, indices=idx)
        if isinstance(self.count, float):
            if not 0 < self.count <= 1:
                raise ChannelRuleError(f"{path}: channel fraction must be in (0, 1], got {self.count}")
            k = max(1, int(round(self.count * size)))
        else:
            k = int(self.count)
        if k < 1:
            raise ChannelRuleError(f"{path}: channel count must be at least 1, got {k}")
        if k > size:
            raise ChannelRuleError(
                f"{path}: channel count {k} is larger than axis {axis} of shape {tuple(shape)} "
                f"(size {size}); use at most {size}, or a fraction in (0, 1]"
            )
        return ChannelSelect(axis=axis, size=size, indices=tuple(range(k)))

    def __str__(self) -> str:
        what = f"indices={list(self.indices)}" if self.indices is not None else f"{self.count}"
        return f"channels({what}, axis={self.axis})"


@dataclasses.dataclass(frozen=True)
class Lora:
    """Train a low-rank adapter ``W + (alpha / rank) * A @ B`` instead of the tensor (LoRA).

    The tensor itself is frozen; :func:`pockjax.add_adapters` puts the factors
    ``A`` (``(..., m, rank)``) and ``B`` (``(..., rank, n)``, zeros) beside it
    in the params tree, under ``<path>.lora_a`` and ``<path>.lora_b`` (the
    tensor moves to ``<path>.base``). Build it with :func:`lora`.
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    stacked: bool = False

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)

    def __str__(self) -> str:
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        return f"lora({self.rank}, alpha={alpha}{', stacked=True' if self.stacked else ''})"


#: Leaf names of a LoRA-ruled tensor's parts in the params tree.
LORA_PARTS = ("base", "lora_a", "lora_b")


def lora(rank: int, alpha: float | None = None, dropout: float = 0.0, *, stacked: bool = False) -> Lora:
    """A rule that trains a rank-``rank`` adapter of a matrix instead of the matrix (LoRA).

    Args:
      rank: the adapter's rank r (a positive int).
      alpha: the adapter's scale numerator; the update is ``alpha / rank * A @ B``
        (default: ``rank``, a scale of 1).
      dropout: dropout on the adapter's input; only 0.0 is supported so far.
      stacked: the tensor's leading axes index a stack of matrices (layers
        under ``lax.scan``): each matrix of its last two axes gets an adapter
        of its own. Without it a tensor of more than two dimensions is
        refused: a Flax ``DenseGeneral`` kernel ``(features, heads, head_dim)``
        is one matrix, not a stack, and adapters per leading index would not
        be the low-rank update LoRA means.

    Example:
        >>> import pockjax
        >>> pockjax.lora(8, alpha=16)
        Lora(rank=8, alpha=16.0, dropout=0.0, stacked=False)
        >>> str(pockjax.lora(4)), pockjax.lora(4, alpha=8).scale
        ('lora(4, alpha=4)', 2.0)
    """
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise SchemeError(f"lora(rank): rank must be a positive int, got {rank!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating))):
        raise SchemeError(f"lora(alpha=...): alpha must be a finite number > 0, got {alpha!r}")
    alpha = float(rank if alpha is None else alpha)
    if not math.isfinite(alpha) or alpha <= 0:
        raise SchemeError(f"lora(alpha=...): alpha must be a finite number > 0, got {alpha!r}")
    if dropout != 0.0:
        raise SchemeError(
            f"lora(dropout={dropout!r}): adapter dropout is not supported yet; use dropout=0.0")
    if not isinstance(stacked, bool):
        raise SchemeError(f"lora(stacked=...): stacked must be True or False, got {stacked!r}")
    return Lora(rank=int(rank), alpha=alpha, dropout=0.0, stacked=stacked)


Rule = Union[Full, Frozen, Channels, Lora]
RuleLike = Union[Rule, str]


def channels(k: Union[int, float, None] = None, axis: int = -1, *, indices: Iterable[int] | None = None) -> Channels:
    """A rule that trains only some channels of a tensor along ``axis``.

    Args:
      k: the number of leading channels to train (int), or the fraction of them
        (float in (0, 1]).
      axis: the channel axis; ``-1`` is the output axis of a Flax ``Dense`` kernel.
      indices: an explicit set of channels to train instead of the first ``k``.

    Example:
        >>> import pockjax
        >>> pockjax.channels(16)
        Channels(count=16, axis=-1, indices=None)
        >>> pockjax.channels(0.25, axis=0).resolve("w", (8, 3)).indices
        (0, 1)
    """
    if (k is None) == (indices is None):
        raise SchemeError("channels() takes exactly one of k (count or fraction) and indices=")
    if not _is_int(axis):
        raise SchemeError(f"channels(axis=...) must be a whole number, got {axis!r}")
    if indices is not None:
        idx = None if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable) else list(indices)
        if idx is None or not all(_is_int(i) for i in idx):
            # (1.5 was truncated to 1, and the string "12" read as [1, 2])
            raise SchemeError(f"channels(indices=...) must be a list of whole numbers, got {indices!r}")
        return Channels(count=None, axis=int(axis), indices=tuple(int(i) for i in idx))
    if isinstance(k, bool) or not isinstance(k, (int, float, np.integer, np.floating)):
        raise SchemeError(f"channels(k): k must be an int or a float fraction, got {k!r}")
    if isinstance(k, (float, np.floating)):
        k = float(k)  # (a numpy float once went through int(): channels(np.float32(1.0)) trained 1 channel)
        if not 0 < k <= 1:
            if k.is_integer():
                k = int(k)
            else:
                raise SchemeError(f"channels(k): a fractional k must be in (0, 1], got {k}")
    else:
        k = int(k)
    if isinstance(k, int) and k < 1:
        raise SchemeError(f"channels(k): a channel count must be at least 1, got {k}")
    return Channels(count=k, axis=int(axis))


@dataclasses.dataclass(frozen=True)
class ChannelSelect:
    """A resolved channel selection: ``indices`` of ``axis`` (length ``size``)."""

    axis: int
    size: int
    indices: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.indices)

    @property
    def is_contiguous(self) -> bool:
        return self.indices == tuple(range(self.indices[0], self.indices[0] + len(self.indices)))

    @property
    def start(self) -> int:
        return self.indices[0]

    def on_axis(self, axis: int) -> "ChannelSelect":
        """The same selection applied on another axis (for pushing through ops)."""
        return dataclasses.replace(self, axis=axis)


_RULE_NAMES = {"full": Full(), "frozen": Frozen()}


def as_rule(rule: RuleLike) -> Rule:
    """Turn ``"full"`` / ``"frozen"`` / a rule object into a rule object."""
    if isinstance(rule, (Full, Frozen, Channels, Lora)):
        return rule
    if isinstance(rule, str):
        key = rule.strip().lower()
        if key in _RULE_NAMES:
            return _RULE_NAMES[key]
        number = r"(\d+(?:\.\d*)?|\.\d+)"  # one number: "1.2.3" and "." are no rule
        m = re.fullmatch(r"channels\(\s*" + number + r"\s*(?:,\s*(?:axis\s*=\s*)?(-?\d+)\s*)?\)", key)
        if m:
            k = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
            return channels(k, axis=int(m.group(2)) if m.group(2) else -1)
        m = re.fullmatch(r"lora\(\s*([0-9]+)\s*(?:,\s*alpha\s*=\s*" + number + r"\s*)?"
                         r"(,\s*stacked\s*=\s*true\s*)?\)", key)
        if m:
            return lora(int(m.group(1)), alpha=float(m.group(2)) if m.group(2) else None, stacked=bool(m.group(3)))
        close = difflib.get_close_matches(key, list(_RULE_NAMES) + ["channels(k, axis=-1)", "lora(rank)"], n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownRuleError(
            f"unknown rule {rule!r}: use 'full', 'frozen', pockjax.channels(k, axis=-1) or"
            f" pockjax.lora(rank, alpha=...).{hint}"
        )
    raise UnknownRuleError(
        f"unknown rule {rule!r} of type {type(rule).__name__}: use 'full', 'frozen', pockjax.channels(...)"
        " or pockjax.lora(...)"
    )


def _glob_to_regex(pattern: str) -> re.Pattern:
    segments = pattern.split(".")
    segments = [seg for i, seg in enumerate(segments) if not (seg == "**" and i and segments[i - 1] == "**")]
    out = []
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            if not last:
                out.append(r"(?:[^.]+\.)*")
            elif out:  # "a.**" matches "a" too: the separator goes with what follows it
                out[-1] = out[-1][:-len(r"\.")] + r"(?:\..+)?"
            else:
                out.append(".*")
            continue
        piece = ""
        j = 0
        while j < len(seg):
            c = seg[j]
            if c == "*":
                piece += "[^.]*"
            elif c == "?":
                piece += "[^.]"
            elif c == "[":
                end = seg.find("]", j + 1)
                if end == -1:
                    piece += re.escape(c)
                else:
                    body = seg[j + 1 : end]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    piece += f"[{body}]"
                    j = end
            else:
                piece += re.escape(c)
            j += 1
        out.append(piece + ("" if last else r"\."))
    try:
        return re.compile("".join(out) + r"\Z")
    except re.error as e:  # e.g. a range "[z-a]"
        raise SchemeError(f"scheme pattern {pattern!r} is not a valid glob ({e}); see UpdateScheme's"
                          f" pattern syntax") from None


def glob_match(pattern: str, path: str) -> bool:
    """Whether dotted ``path`` matches the segment glob ``pattern``.

    Example:
        >>> glob_match("layers.*.attn.*", "layers.3.attn.wq")
        True
        >>> glob_match("**.bias", "bias"), glob_match("**.bias", "mlp.0.bias")
        (True, True)
        >>> glob_match("layers.1*.w", "layers.12.w"), glob_match("layers.*", "layers.1.w")
        (True, False)
        >>> glob_match("head.**", "head"), glob_match("head.**", "head.w.b"), glob_match("head.**", "headx")
        (True, True, False)
    """
    return _glob_to_regex(pattern).match(path) is not None


def _json_kind(x: Any) -> str:
    """``x`` as a JSON reader would name it, for error messages."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(x))
    if kind is None:
        kind = "an object" if isinstance(x, Mapping) else f"a {type(x).__name__}"
    text = repr(x)
    return f"{kind} ({text[:60]}{'...' if len(text) > 60 else ''})"


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _decode_rule(rule: Any, where: str) -> Rule:
    """One rule of a scheme file (see :meth:`UpdateScheme.from_dict`), checked."""
    if isinstance(rule, str):
        try:
            return as_rule(rule)
        except SchemeError as e:
            raise type(e)(f"{where}: {e}") from None
    if not isinstance(rule, Mapping):
        raise UnknownRuleError(f"{where}: a rule is 'full', 'frozen', 'channels(k, axis=-1)', 'lora(r)' or an"
                               f" object {{\"channels\": k, \"axis\": a}} / {{\"indices\": [...], \"axis\": a}}"
                               f" / {{\"lora\": r, \"alpha\": a}}, got {_json_kind(rule)}")
    keys = set(rule)
    if "lora" in keys:
        if not keys <= {"lora", "alpha", "dropout", "stacked"}:
            raise UnknownRuleError(f"{where}: cannot read rule {dict(rule)!r}: a LoRA rule has the keys"
                                   f" 'lora' (the rank) and optionally 'alpha', 'dropout' and 'stacked'")
        rank, alpha, dropout = rule["lora"], rule.get("alpha"), rule.get("dropout", 0.0)
        if not isinstance(rule.get("stacked", False), bool):
            raise SchemeError(f"{where}: 'stacked' must be true or false, got {_json_kind(rule['stacked'])}")
        if not _is_int(rank):
            raise SchemeError(f"{where}: 'lora' (the rank) must be an integer, got {_json_kind(rank)}")
        for name, x in (("alpha", alpha), ("dropout", dropout)):
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
                raise SchemeError(f"{where}: {name!r} must be a number, got {_json_kind(x)}")
        try:
            return lora(int(rank), alpha=alpha, dropout=dropout, stacked=rule.get("stacked", False))
        except SchemeError as e:
            raise type(e)(f"{where}: {e}") from None
    if keys not in ({"channels"}, {"channels", "axis"}, {"indices"}, {"indices", "axis"}):
        raise UnknownRuleError(f"{where}: cannot read rule {dict(rule)!r}: expected the keys 'channels'"
                               f" or 'indices', and optionally 'axis'")
    axis = rule.get("axis", -1)
    if not _is_int(axis):
        raise SchemeError(f"{where}: 'axis' must be an integer, got {_json_kind(axis)}")
    try:
        if "indices" in rule:
            idx = rule["indices"]
            if not isinstance(idx, list) or not idx or not all(_is_int(i) for i in idx):
                raise SchemeError(f"'indices' must be a non-empty list of integers, got {_json_kind(idx)}")
            return channels(indices=idx, axis=int(axis))
        k = rule["channels"]
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not k > 0:
            raise SchemeError(f"'channels' must be a positive count or a fraction in (0, 1],"
                              f" got {_json_kind(k)}")
        return channels(k, axis=int(axis))
    except SchemeError as e:
        raise type(e)(f"{where}: {e}") from None


class UpdateScheme:
    """Which parameters, and which of their channels, a fine-tuning step updates.

    Args:
      rules: ``{pattern: rule}`` (insertion order kept) or a sequence of
        ``(pattern, rule)`` pairs. The first matching pattern wins.
      default: the rule for paths no pattern matches (``"frozen"`` unless said).
      name: an optional label shown by :meth:`describe`.
      strict: ``True`` (default): every pattern must match at least one
        parameter, else :class:`~pockjax.UnmatchedPatternError` lists the
        closest paths. ``False``: patterns may match nothing (a scheme meant
        for several model families, like :meth:`norm_only`, whose
        ``*norm*.bias`` pattern finds nothing in LLaMA), as long as at least
        one pattern matches something. Scheme files keep the setting.

    Example:
        >>> import numpy as np, pockjax
        >>> params = {"dense1": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)},
        ...           "dense2": {"kernel": np.zeros((8, 2)), "bias": np.zeros(2)}}
        >>> scheme = pockjax.UpdateScheme({"dense2.*": "full", "dense1.kernel": pockjax.channels(2)})
        >>> print(scheme.describe(params))  # doctest: +NORMALIZE_WHITESPACE
        parameter      shape   rule                     trainable  total
        dense1.bias    (8,)    frozen                           0      8
        dense1.kernel  (4, 8)  channels(2, axis=-1)             8     32
        dense2.bias    (2,)    full                             2      2
        dense2.kernel  (8, 2)  full                            16     16
        total                                                  26     58  (44.8%)
    """

    def __init__(
        self,
        rules: Union[Mapping[str, RuleLike], Sequence[tuple[str, RuleLike]], None] = None,
        default: RuleLike = "frozen",
        name: str | None = None,
        strict: bool = True,
    ):
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise SchemeError(f"scheme rules must be (pattern, rule) pairs, got {item!r}")
        seen = set()
        for pattern, _ in items:  # (a repeat's rule never applied: the first one wins every path)
            if pattern in seen:
                raise SchemeError(f"scheme pattern {pattern!r} is given twice; give each pattern once, with"
                                  f" the one rule it should have")
            seen.add(pattern)
        if not isinstance(strict, bool):
            raise SchemeError(f"strict must be True or False, got {strict!r}")
        self.rules: tuple[tuple[str, Rule], ...] = tuple((p, as_rule(r)) for p, r in items)
        self.default: Rule = as_rule(default)
        self.name = name
        self.strict = strict
        self._compiled = tuple((_glob_to_regex(p), p, r) for p, r in self.rules)

    # -- constructors for the common schemes ---------------------------------
    @classmethod
    def full(cls) -> "UpdateScheme":
        """Every parameter trained (full fine-tuning)."""
        return cls({}, default="full", name="full")

    @classmethod
    def bias_only(cls) -> "UpdateScheme":
        """Only biases (PockEngine's bias-only update for CNNs)."""
        return cls({"**.bias": "full"}, name="bias-only")

    @classmethod
    def norm_only(cls) -> "UpdateScheme":
        """Only normalisation scales and biases (for LLaMA: RMSNorm scales)."""
        return cls({"**.*norm*.scale": "full", "**.*norm*.bias": "full"}, name="norm-only", strict=False)

    def nnx_wrt(self):
        """An NNX filter for ``nnx.Optimizer(model, tx, wrt=scheme.nnx_wrt())``.

        It selects the ``nnx.Param`` variables this scheme trains (fully or by
        channels), so the optimizer allocates state only for them and its
        ``update`` ignores the gradients of frozen parameters, which
        :func:`pockjax.compile` then never computes.

        Example:
            >>> import optax, pockjax
            >>> from flax import nnx
            >>> model = nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
            >>> scheme = pockjax.UpdateScheme({"layers.1.*": "full"})
            >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=scheme.nnx_wrt())
            >>> sorted(pockjax.leaf_paths(nnx.state(optimizer.opt_state)))
            ['0.count', '0.mu.layers.1.bias', '0.mu.layers.1.kernel', '0.nu.layers.1.bias', '0.nu.layers.1.kernel']
        """
        from flax import nnx

        def trained(path, _value) -> bool:
            rule, _ = self.rule_for(".".join(str(p) for p in path))
            return not isinstance(rule, Frozen)

        return nnx.All(nnx.Param, trained)

    # -- resolution ------------------------------------------------------------
    def rule_for(self, path: str) -> tuple[Rule, str | None]:
        """The rule for one path and the pattern that chose it (None: default)."""
        for regex, pattern, rule in self._compiled:
            if regex.match(path):
                return rule, pattern
        return self.default, None

    @property
    def has_lora(self) -> bool:
        """Whether any rule (or the default) is a :func:`lora` rule."""
        return any(isinstance(r, Lora) for _, r in self.rules) or isinstance(self.default, Lora)

    def lora_part(self, path: str) -> tuple[Lora, str | None, str] | None:
        """``(rule, pattern, part)`` when ``path`` is a part of a LoRA-ruled tensor, else None.

        The parts are ``<tensor path>.base`` (frozen) and ``.lora_a``/``.lora_b``
        (trained), as :func:`pockjax.add_adapters` lays them out.

        Example:
            >>> import pockjax
            >>> s = pockjax.UpdateScheme({"attn.wq": pockjax.lora(4)})
            >>> s.lora_part("attn.wq.lora_a")[2], s.lora_part("attn.wq"), s.lora_part("mlp.lora_a")
            ('lora_a', None, None)
        """
        parent, _, part = path.rpartition(".")
        if part not in LORA_PARTS or not parent:
            return None
        rule, pattern = self.rule_for(parent)
        return (rule, pattern, part) if isinstance(rule, Lora) else None

    def merge(self, params: Any) -> Any:
        """``params`` with every LoRA adapter folded into its tensor (``W + alpha/r A @ B``).

        See :func:`pockjax.adapters.merge`; the result has the model's own tree
        (no adapters) and runs with the model unchanged.
        """
        from pockjax.adapters import merge

        return merge(params)

    def resolve(
        self,
        paths: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        non_gradient: Sequence[str] = (),
        lora_bases: bool = False,
    ) -> list[Union[Full, Frozen, ChannelSelect]]:
        """Resolve the rule of every leaf; raises on patterns matching nothing.

        Args:
          paths, shapes: the parameters the step differentiates.
          non_gradient: paths of state the step updates without a gradient
            (BatchNorm statistics, counters); a pattern that names only those
            is an error, since a scheme cannot freeze or train them.
          lora_bases: the tensors are the model's own, before
            :func:`pockjax.add_adapters`: a LoRA-ruled one resolves to
            ``Frozen()`` (its base) instead of raising.

        Returns, per path, ``Full()``, ``Frozen()`` or a :class:`ChannelSelect`.
        """
        used = set()
        out = []
        present = set(paths)
        for path, shape in zip(paths, shapes):
            part = self.lora_part(path)
            if part is not None:
                rule, pattern, name = part
                parent = path.rpartition(".")[0]
                missing = [f"{parent}.{q}" for q in LORA_PARTS if f"{parent}.{q}" not in present]
                if missing:  # a parameter of the model that happens to be named "base" (it was frozen silently)
                    raise SchemeError(f"{parent} has the rule {rule}, but holds no adapter: {path} is a parameter"
                                      f" of the model, not an adapter's part ({', '.join(missing)} missing); rule"
                                      f" {path} itself, or add the adapters with pockjax.add_adapters")
                if pattern is not None:
                    used.add(pattern)
                out.append(Frozen() if name == "base" else Full())
                continue
            rule, pattern = self.rule_for(path)
            if pattern is not None:
                used.add(pattern)
            if isinstance(rule, Lora) and lora_bases:
                out.append(Frozen())
                continue
            if isinstance(rule, Lora):
                raise SchemeError(
                    f"{path} has the rule {rule}, but holds no adapter: add the adapters with"
                    " pockjax.add_adapters(params, scheme) and pass its result to the step and to"
                    " pockjax.init_opt_state")
            if isinstance(rule, Channels):
                sel = rule.resolve(path, shape)
                out.append(Full() if sel.count == sel.size else sel)
            else:
                out.append(rule)
        unmatched = [p for p, _ in self.rules if p not in used]
        for regex, pattern, _ in self._compiled:
            state = [q for q in non_gradient if regex.match(q)]
            if pattern in unmatched and state:
                raise SchemeError(
                    f"scheme pattern {pattern!r} names {state[:3]}, which the step updates without a "
                    "gradient (model state such as BatchNorm statistics or counters): it is updated "
                    "exactly as the step computes it, and a scheme cannot freeze or train it. "
                    "Remove the pattern from the scheme."
                )
        if unmatched and (self.strict or len(unmatched) == len(self.rules)):
            lines = []
            regexes = {pattern: regex for regex, pattern, _ in self._compiled}
            for p in unmatched:
                shadowed = [q for q in paths if regexes[p].match(q)]
                lora_owned = [q for q in shadowed if self.lora_part(q) is not None]
                if lora_owned:  # (it once named itself as the earlier pattern that shadowed it)
                    owners = sorted({self.lora_part(q)[1] for q in lora_owned} - {None})
                    lines.append(f"  {p!r} matches {lora_owned[:5]}, parts of LoRA adapters: the LoRA rule of their"
                                 f" tensor ({', '.join(map(repr, owners))}) rules them (lora_a and lora_b"
                                 f" trained, base frozen); remove {p!r}")
                    continue
                if shadowed:
                    # the pattern names parameters, but an earlier pattern rules each of them
                    earlier = sorted({self.rule_for(q)[1] for q in shadowed} - {None})
                    lines.append(f"  {p!r} matches {shadowed[:5]}, but an earlier pattern ({', '.join(map(repr, earlier))})"
                                 " rules each of them (the first matching pattern wins): put it before that one")
                    continue
                close = difflib.get_close_matches(p, list(paths), n=5, cutoff=0.3)
                lines.append(f"  {p!r} matches no parameter; closest paths: {close or list(paths)[:5]}")
            raise UnmatchedPatternError(
                "scheme patterns that rule no parameter:\n" + "\n".join(lines)
                + "\n(`*` matches within one path segment, `**` across segments)"
            )
        return out

    def frozen_paths(self, flat: Mapping[str, Any], *, lora_bases: bool = False) -> set[str]:
        """The paths of ``flat`` (``{path: array or ShapeDtypeStruct}``, as
        :func:`pockjax.paths.flatten_params` gives) that :meth:`resolve` freezes:
        the tensors a run may hold quantized or in bfloat16.

        Example:
            >>> import numpy as np
            >>> scheme = UpdateScheme({"head.w": "full"})
            >>> sorted(scheme.frozen_paths({"body.w": np.zeros((4, 4)), "head.w": np.zeros((4, 2))}))
            ['body.w']
        """
        rules = self.resolve(list(flat), [tuple(np.shape(x)) for x in flat.values()], lora_bases=lora_bases)
        return {p for p, r in zip(flat, rules) if isinstance(r, Frozen)}

    def resolve_tree(self, params: Any) -> list[Union[Full, Frozen, ChannelSelect]]:
        """:meth:`resolve` over the leaves of a params pytree."""
        import jax

        leaves = jax.tree.leaves(params)
        return self.resolve(leaf_paths(params), [np.shape(x) for x in leaves])

    def describe(self, params: Any) -> "SchemeDescription":
        """A table of each parameter, its rule, and trainable elements, with totals."""
        import jax

        leaves = jax.tree.leaves(params)
        paths = leaf_paths(params)
        shapes = [tuple(np.shape(x)) for x in leaves]
        resolved = self.resolve(paths, shapes)
        rows = []
        for path, shape, res in zip(paths, shapes, resolved):
            total = int(math.prod(shape))
            part = self.lora_part(path)
            rule = f"{part[0]} {part[2]}" if part else self.rule_for(path)[0]
            if isinstance(res, Full):
                trainable = total
            elif isinstance(res, Frozen):
                trainable = 0
            else:
                trainable = total // res.size * res.count
            rows.append(DescriptionRow(path, shape, str(rule), trainable, total))
        return SchemeDescription(tuple(rows), self.name)

    def to_dict(self) -> dict:
        """A JSON-friendly form (what scheme files hold)."""

        def enc(rule: Rule):
            if isinstance(rule, Channels):
                d = {"channels": rule.count if rule.indices is None else list(rule.indices), "axis": rule.axis}
                if rule.indices is not None:
                    d = {"indices": list(rule.indices), "axis": rule.axis}
                return d
            if isinstance(rule, Lora):
                return {"lora": rule.rank, "alpha": rule.alpha, **({"stacked": True} if rule.stacked else {})}
            return str(rule)

        return {
            "name": self.name,
            "default": enc(self.default),
            "rules": [[p, enc(r)] for p, r in self.rules],
            **({} if self.strict else {"strict": False}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "UpdateScheme":
        """Inverse of :meth:`to_dict`; every field is checked.

        ``data`` is ``{"rules": [[pattern, rule], ...], "default": rule,
        "name": str, "strict": bool}`` (only ``rules`` is required; ``rules``
        may also be a ``{pattern: rule}`` object). A rule is ``"full"``,
        ``"frozen"``, ``"channels(k, axis=a)"``, ``{"channels": k, "axis": a}``
        or ``{"indices": [i, ...], "axis": a}``.

        Raises:
          SchemeError: anything else, naming the field that is wrong
          (``rules[2][0]: a pattern must be a string, got 3``).

        Example:
            >>> import pockjax
            >>> s = pockjax.UpdateScheme({"a.*": pockjax.channels(4)}, default="full")
            >>> pockjax.UpdateScheme.from_dict(s.to_dict()) == s
            True
            >>> pockjax.UpdateScheme.from_dict({"rules": [[3, "full"]]})
            Traceback (most recent call last):
            ...
            pockjax.errors.SchemeError: rules[0][0]: a pattern must be a non-empty string, got a number (3)
        """
        if not isinstance(data, Mapping):
            raise SchemeError(f"a scheme is a JSON object with 'rules' (and optional 'default', 'name',"
                              f" 'strict'), got {_json_kind(data)}")
        unknown = sorted(set(data) - {"rules", "default", "name", "strict"})
        if unknown:
            raise SchemeError(f"unknown field(s) {', '.join(map(repr, unknown))}; a scheme has"
                              f" 'rules', 'default', 'name' and 'strict'")
        if "rules" not in data:
            raise SchemeError("a scheme has no 'rules' (a list of [pattern, rule] pairs)")
        raw = data["rules"]
        if isinstance(raw, Mapping):
            pairs = [(f"rules[{p!r}]", f"rules[{p!r}]", p, r) for p, r in raw.items()]
        elif isinstance(raw, list):
            pairs = []
            for i, item in enumerate(raw):
                if not isinstance(item, (list, tuple)) or len(item) != 2:
                    raise SchemeError(f"rules[{i}]: a rule entry is a [pattern, rule] pair, got"
                                      f" {_json_kind(item)}")
                pairs.append((f"rules[{i}][0]", f"rules[{i}][1]", item[0], item[1]))
        else:
            raise SchemeError(f"'rules' must be a list of [pattern, rule] pairs, got {_json_kind(raw)}")
        rules = []
        for at_pattern, at_rule, pattern, rule in pairs:
            if not isinstance(pattern, str) or not pattern:
                raise SchemeError(f"{at_pattern}: a pattern must be a non-empty string, got {_json_kind(pattern)}")
            try:
                _glob_to_regex(pattern)
            except re.error as e:
                raise SchemeError(f"{at_pattern}: pattern {pattern!r} is not a valid glob ({e})") from None
            rules.append((pattern, _decode_rule(rule, at_rule)))
        default = _decode_rule(data.get("default", "frozen"), "default")
        name = data.get("name")
        if name is not None and not isinstance(name, str):
            raise SchemeError(f"'name' must be a string, got {_json_kind(name)}")
        strict = data.get("strict", True)
        if not isinstance(strict, bool):
            raise SchemeError(f"'strict' must be true or false, got {_json_kind(strict)}")
        return cls(rules, default=default, name=name, strict=strict)

    def __eq__(self, other) -> bool:
        return isinstance(other, UpdateScheme) and (self.rules, self.default) == (other.rules, other.default)

    def __hash__(self) -> int:
        return hash((self.rules, self.default))

    def __repr__(self) -> str:
        rules = ", ".join(f"{p!r}: {r}" for p, r in self.rules)
        return f"UpdateScheme({{{rules}}}, default={self.default})"


@dataclasses.dataclass(frozen=True)
class DescriptionRow:
    path: str
    shape: tuple[int, ...]
    rule: str
    trainable: int
    total: int


@dataclasses.dataclass(frozen=True)
class SchemeDescription:
    """What :meth:`UpdateScheme.describe` returns; ``str()`` gives the table."""

    rows: tuple[DescriptionRow, ...]
    name: str | None = None

    @property
    def trainable(self) -> int:
        return sum(r.trainable for r in self.rows)

    @property
    def total(self) -> int:
        return sum(r.total for r in self.rows)

    def __str__(self) -> str:
        header = ("parameter", "shape", "rule", "trainable", "total")
        body = [(r.path, str(r.shape), r.rule, str(r.trainable), str(r.total)) for r in self.rows]
        pct = 100.0 * self.trainable / max(self.total, 1)
        foot = ("total", "", "", str(self.trainable), str(self.total))
        widths = [max(len(row[i]) for row in [header, *body, foot]) for i in range(5)]

        def fmt(row):
            left = "  ".join(row[i].ljust(widths[i]) for i in range(3))
            right = "  ".join(row[i].rjust(widths[i]) for i in range(3, 5))
            return f"{left}  {right}".rstrip()

        lines = [fmt(header)] + [fmt(b) for b in body] + [fmt(foot) + f"  ({pct:.1f}%)"]
        return "\n".join(lines)

    __repr__ = __str__

"""The named update schemes: the one place each scheme is defined.

Every command takes its schemes from here: ``pockjax finetune``, ``pockjax
plan``, ``pockjax memory``, ``pockjax search``, the benchmarks. A named
scheme is a factory ``build(config, *, blocks, fraction) -> UpdateScheme``
over a model config, registered for one model family with
:func:`register_scheme`; :func:`get_scheme` looks one up for a config.

The LLaMA family (:class:`pockjax.models.llama.LlamaConfig`; parameter paths
of an unrolled :class:`pockjax.models.llama.Llama`, ``layers.27.attn.wq.kernel``,
``layers.27.mlp.w1.kernel``, ...):

* ``full``: every parameter.
* ``paper``: PockEngine's sparse scheme for LLaMA: the attention projections
  (``wq``, ``wk``, ``wv``, ``wo``) and the first FFN projections (``w1`` gate,
  ``w3`` up; not the down projection ``w2``) of the last N blocks. N is
  :func:`paper_blocks`: the last third of the blocks, at least
  :data:`DEFAULT_BLOCKS` (10), never more than the model has (SmolLM2-135M:
  10 of 30; LLaMA-2-7B: 11 of 32; a 2-block test model: both).
* ``norm-only``: the RMSNorm scales.
* ``channels``: ``paper`` with :func:`pockjax.channels` (half the output
  channels by default) on the same tensors.
* ``lora``: :func:`pockjax.lora` adapters of rank 8 (alpha 16) on the
  attention projections of every block (PEFT's usual targets).

Other families (vision, encoders) add their schemes with
:func:`register_family` and :func:`register_scheme`; ``full`` and
``norm-only`` need no config and are registered for every family.

Example:
  >>> from pockjax.models.llama import LlamaConfig
  >>> scheme_names()
  ('full', 'paper', 'norm-only', 'channels', 'lora')
  >>> paper_blocks(30), paper_blocks(32), paper_blocks(2)
  (10, 11, 2)
  >>> s = get_scheme("paper", LlamaConfig.smollm2_135m())
  >>> s.name, s.rules[0][0]
  ('paper (last 10 blocks)', 'layers.20.attn.wq.kernel')
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable
from typing import Any

from pockjax.errors import SchemeError, SchemeFileError
from pockjax.io.atomic import write_json
from pockjax.io.jsonfile import read_json
from pockjax.scheme import UpdateScheme, channels, lora

__all__ = [
    "DEFAULT_BLOCKS",
    "PAPER_TENSORS",
    "NamedScheme",
    "family_of",
    "check_scheme",
    "get_scheme",
    "ignores_blocks",
    "ignores_fraction",
    "load_scheme_file",
    "paper_blocks",
    "register_family",
    "register_scheme",
    "resolve_scheme",
    "save_scheme_file",
    "scheme_names",
    "schemes",
]

#: The ``paper`` scheme trains at least this many last blocks (all of them in
#: shallower models); see :func:`paper_blocks`.
DEFAULT_BLOCKS = 10

#: The tensors of each trained block in LLaMA's ``paper`` scheme: attention and
#: the first FFN projections (PockEngine: not the second, ``w2``).
PAPER_TENSORS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w3")

#: Any family: schemes that name no model-specific tensor.
ANY = "*"


@dataclasses.dataclass(frozen=True)
class NamedScheme:
    """A registered scheme.

    Attributes:
      name: what ``--scheme`` takes (``paper``).
      family: the model family it is for (``llama``), or ``"*"`` for every family.
      summary: one line for help texts.
      build: ``build(config, *, blocks, fraction) -> UpdateScheme``.
      options: which of ``blocks`` and ``fraction`` the build reads (the
        commands refuse ``--blocks`` / ``--fraction`` for the others).
    """

    name: str
    family: str
    summary: str
    build: Callable[..., UpdateScheme]
    options: tuple[str, ...] = ()


_SCHEMES: dict[tuple[str, str], NamedScheme] = {}
_ALIASES: dict[str, str] = {"norm": "norm-only"}
#: family name -> predicate on configs (the config classes are imported lazily).
_FAMILIES: dict[str, Callable[[Any], bool]] = {}


def _key(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    return _ALIASES.get(key, key)


def _ignores(scheme: str, option: str, family: str) -> bool:
    known = schemes(family).get(_key(scheme))
    if known is None:  # a scheme file fixes its own rules; an unknown name fails where it is resolved
        return os.path.isfile(scheme)
    return option not in known.options


def ignores_blocks(scheme: str, family: str = "llama") -> bool:
    """Whether ``--scheme scheme`` makes ``--blocks`` meaningless: a registered scheme of
    ``family`` that trains no number of last blocks (by any spelling the registry
    takes), or a scheme file. The commands refuse ``--blocks`` then.

    Example:
      >>> ignores_blocks("Norm"), ignores_blocks("LoRA"), ignores_blocks("paper")
      (True, True, False)
      >>> import pockjax.models.mobilenetv2  # registers its family's schemes
      >>> ignores_blocks("head-only", "mobilenetv2"), ignores_blocks("Last_Blocks", "mobilenetv2")
      (True, False)
    """
    return _ignores(scheme, "blocks", family)


def ignores_fraction(scheme: str, family: str = "llama") -> bool:
    """Whether ``--scheme scheme`` makes ``--fraction`` meaningless (all but ``channels``).

    Example:
      >>> import pockjax.models.bert  # registers its family's schemes
      >>> ignores_fraction("Channels", "bert"), ignores_fraction("paper", "bert")
      (False, True)
    """
    return _ignores(scheme, "fraction", family)


def register_family(name: str, is_config: Callable[[Any], bool]) -> None:
    """Declares a model family by a predicate on its configs.

    Example:
      >>> register_family("toy", lambda c: getattr(c, "kind", None) == "toy")
      >>> class C: kind = "toy"
      >>> family_of(C())
      'toy'
      >>> del _FAMILIES["toy"]
    """
    _FAMILIES[name] = is_config


def family_of(config: Any) -> str:
    """The family a model config belongs to (``llama`` for a :class:`LlamaConfig`).

    Raises:
      SchemeError: no registered family knows the config.
    """
    for name, is_config in _FAMILIES.items():
        if is_config(config):
            return name
    raise SchemeError(f"no named schemes for a {type(config).__name__}; known model families:"
                      f" {', '.join(_FAMILIES)} (pass an UpdateScheme or a scheme file instead)")


def register_scheme(name: str, family: str, summary: str, *, options: tuple[str, ...] = ()):
    """Decorator: registers ``build(config, *, blocks, fraction)`` as a named scheme.

    ``options`` names the arguments the build reads (``"blocks"``,
    ``"fraction"``); the commands refuse the others' flags.

    Example:
      >>> @register_scheme("last-norm", "llama", "the final RMSNorm only")
      ... def _last_norm(config, *, blocks=None, fraction=0.5):
      ...     return UpdateScheme({"norm.scale": "full"}, name="last-norm")
      >>> "last-norm" in scheme_names()
      True
      >>> del _SCHEMES[("llama", "last-norm")]
    """

    def deco(build: Callable[..., UpdateScheme]) -> Callable[..., UpdateScheme]:
        key = (family, name)
        if key in _SCHEMES:
            raise ValueError(f"scheme {name!r} is already registered for {family!r}")
        if not set(options) <= {"blocks", "fraction"}:
            raise ValueError(f"scheme options are 'blocks' and 'fraction', got {options!r}")
        _SCHEMES[key] = NamedScheme(name, family, summary, build, tuple(options))
        return build

    return deco


def schemes(family: str = "llama") -> dict[str, NamedScheme]:
    """The schemes registered for ``family`` (and every family), by name, in registration order.

    A family is known once its package registered it (:func:`register_family`);
    an unknown one is refused, not answered with the schemes of every family
    alone (a lookup then found no ``paper`` and refused nothing).

    Example:
      >>> schemes("no-such-family")
      Traceback (most recent call last):
      ...
      pockjax.errors.SchemeError: no model family 'no-such-family' is registered (known: llama...): import its package (pockjax.models.<family>) first
    """
    if family not in _FAMILIES:
        raise SchemeError(f"no model family {family!r} is registered (known: {', '.join(_FAMILIES)}): import its"
                          f" package (pockjax.models.<family>) first")
    return {s.name: s for (fam, _), s in _SCHEMES.items() if fam in (family, ANY)}


def scheme_names(family: str = "llama") -> tuple[str, ...]:
    """Names of the schemes a family has (what ``--scheme`` accepts besides a file)."""
    return tuple(schemes(family))


def get_scheme(name: str, config: Any, *, blocks: int | None = None,
               fraction: float = 0.5) -> UpdateScheme:
    """The named scheme for a model config.

    Args:
      name: a registered name (``full``, ``paper``, ``norm-only``, ``channels``
        for LLaMA); case and ``_``/``-`` do not matter.
      config: the model's config (its family picks the scheme).
      blocks: last blocks trained by block-wise schemes (default
        :func:`paper_blocks` of the model's depth).
      fraction: channel fraction of ``channels``.

    Raises:
      SchemeError: unknown name, or a config no family knows.

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> get_scheme("norm_only", LlamaConfig.tiny()).name
      'norm-only'
    """
    key = _key(name)
    family = family_of(config)
    known = schemes(family)
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < float(fraction) <= 1:
        # (2.0 was read as a count of 2 channels by channels())
        raise SchemeError(f"the channel fraction must be in (0, 1], got {fraction!r}")
    if key not in known:
        raise _unknown(name, family)
    return known[key].build(config, blocks=blocks, fraction=fraction)


def _unknown(name: str, family: str) -> SchemeError:
    return SchemeError(f"unknown scheme {name!r}; use one of {', '.join(schemes(family))}"
                       f" or a path to a JSON scheme file")


def check_scheme(name: str, family: str) -> None:
    """Refuses, before any model is loaded, a ``--scheme`` that :func:`resolve_scheme` would refuse
    by its name alone: a name ``family`` does not register, or a scheme file that is not valid.

    Example:
      >>> import pockjax.models.bert  # registers its family's schemes
      >>> check_scheme("Head_Only", "bert")
      >>> check_scheme("lora", "bert")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      pockjax.errors.SchemeError: unknown scheme 'lora'; use one of full, norm-only, paper, ... or a path to a JSON scheme file
    """
    if _key(name) in schemes(family):
        return
    if not (os.path.exists(name) or name.endswith(".json")):
        raise _unknown(name, family)
    load_scheme_file(name)


def resolve_scheme(name: str, config: Any, *, blocks: int | None = None,
                   fraction: float = 0.5) -> UpdateScheme:
    """A registered scheme (:func:`get_scheme`) or, for a path, a scheme file.

    What every command's ``--scheme`` goes through: a name the registry knows,
    else an existing file or a name ending in ``.json`` (:func:`load_scheme_file`).

    Raises:
      SchemeError: unknown name, or an unreadable or invalid scheme file.

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> resolve_scheme("nope", LlamaConfig.tiny())
      Traceback (most recent call last):
      ...
      pockjax.errors.SchemeError: unknown scheme 'nope'; use one of full, paper, norm-only, channels, lora or a path to a JSON scheme file
    """
    if _key(name) in schemes(family_of(config)) or not (os.path.exists(name) or name.endswith(".json")):
        return get_scheme(name, config, blocks=blocks, fraction=fraction)
    return load_scheme_file(name)


def load_scheme_file(path: str | os.PathLike) -> UpdateScheme:
    """Reads a scheme file (JSON of :meth:`UpdateScheme.to_dict`), checking every field.

    Raises:
      SchemeError: missing file, invalid JSON, or not a scheme; the message
        starts with the file's path and names the field that is wrong.

    Example:
      >>> import tempfile
      >>> p = os.path.join(tempfile.mkdtemp(), "s.json")
      >>> save_scheme_file(p, UpdateScheme({"norm.scale": "full"}))
      >>> load_scheme_file(p).rules[0][0]
      'norm.scale'
      >>> with open(p, "w") as f:
      ...     f.write('{"rules": {"norm.scale": "fast"}}')
      33
      >>> load_scheme_file(p)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      pockjax.errors.UnknownRuleError: .../s.json: rules['norm.scale']: unknown rule 'fast': ...
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SchemeError(f"scheme file not found: {path}")
    try:
        # any JSON value: from_dict names what a scheme must be ("a scheme is a JSON object ...")
        data = read_json(path, error=SchemeFileError, what="scheme file")
    except OSError as e:
        raise SchemeError(f"cannot read scheme file {path}: {e.strerror or e}") from None
    try:
        return UpdateScheme.from_dict(data)
    except SchemeError as e:
        raise type(e)(f"{path}: {e}") from None


def save_scheme_file(path: str | os.PathLike, scheme: UpdateScheme) -> None:
    """Writes ``scheme.to_dict()`` as JSON: to a temporary sibling, fsync'd, renamed."""
    write_json(path, scheme.to_dict(), indent=1, ensure_ascii=True)


def paper_blocks(n_layers: int, blocks: int | None = None) -> int:
    """How many of the last blocks ``paper`` (and ``channels``) train.

    By default the last third of the blocks (rounded up), at least
    :data:`DEFAULT_BLOCKS`, and never more than the model has: the backward
    pass then stops a third of the way down in a deep model, and small models
    keep the 10 blocks the fine-tuning results were measured with.

    Raises:
      SchemeError: an explicit ``blocks`` below 1, or above the model's depth
        (it would train fewer blocks than asked).

    Example:
      >>> [paper_blocks(n) for n in (2, 12, 30, 32, 80)], paper_blocks(32, 4)
      ([2, 10, 10, 11, 27], 4)
      >>> paper_blocks(30, 99)
      Traceback (most recent call last):
      ...
      pockjax.errors.SchemeError: --blocks 99 is more than the model's 30 blocks: give at most 30 (all of them), or leave --blocks out for the default (10)
    """
    default = min(max(DEFAULT_BLOCKS, math.ceil(n_layers / 3)), n_layers)
    if blocks is None:
        return default
    if int(blocks) < 1:
        raise SchemeError(f"--blocks must be at least 1, got {blocks}")
    if int(blocks) > n_layers:
        raise SchemeError(f"--blocks {blocks} is more than the model's {n_layers} blocks: give at most"
                          f" {n_layers} (all of them), or leave --blocks out for the default ({default})")
    return int(blocks)


# -- every family --------------------------------------------------------------------


@register_scheme("full", ANY, "every parameter")
def _full(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    return UpdateScheme.full()


# -- LLaMA ---------------------------------------------------------------------------


def _is_llama(config: Any) -> bool:
    from pockjax.models.llama.config import LlamaConfig

    return isinstance(config, LlamaConfig)


register_family("llama", _is_llama)


def _plural(n: int) -> str:
    return f"{n} block{'s' if n > 1 else ''}"


@register_scheme("paper", "llama",
                 "attention wq/wk/wv/wo + FFN w1/w3 of the last N blocks (PockEngine;"
                 " N = a third of the blocks, at least 10)",
                 options=("blocks",))
def _llama_paper(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    n = paper_blocks(config.n_layers, blocks)
    last = range(config.n_layers - n, config.n_layers)
    if config.scan_layers:
        # stacked blocks: the same tensors, as rows of the leading layer axis;
        # the backward scan then runs over the trained blocks only
        rows = channels(indices=list(last), axis=0)
        return UpdateScheme([(f"layers.{t}.kernel", rows) for t in PAPER_TENSORS],
                            name=f"paper (last {_plural(n)}, stacked)")
    return UpdateScheme([(f"layers.{i}.{t}.kernel", "full") for i in last for t in PAPER_TENSORS],
                        name=f"paper (last {_plural(n)})")


@register_scheme("norm-only", ANY, "normalisation scales only (RMSNorm for LLaMA)")
def _norm_only(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    return UpdateScheme.norm_only()


@register_scheme("channels", "llama", "the paper scheme on a fraction (half) of each tensor's output channels",
                 options=("blocks", "fraction"))
def _llama_channels(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    if config.scan_layers:
        raise SchemeError("the 'channels' scheme selects channels within each block; load the"
                          " model with unrolled layers (scan_layers=False)")
    n = paper_blocks(config.n_layers, blocks)
    rule = channels(float(fraction))
    return UpdateScheme([(f"layers.{i}.{t}.kernel", rule)
                         for i in range(config.n_layers - n, config.n_layers) for t in PAPER_TENSORS],
                        name=f"channels (last {_plural(n)})")


#: The ``lora`` scheme's rank and alpha (PEFT's usual rank 8, alpha twice the rank).
LORA_RANK, LORA_ALPHA = 8, 16


@register_scheme("lora", "llama", "LoRA adapters, rank 8 (alpha 16), on attention wq/wk/wv/wo of every block")
def _llama_lora(config: Any, *, blocks: int | None = None, fraction: float = 0.5) -> UpdateScheme:
    return UpdateScheme({"layers.*.attn.w[qkvo].kernel": lora(LORA_RANK, alpha=LORA_ALPHA)},
                        name=f"lora (rank {LORA_RANK}, attention of every block)")

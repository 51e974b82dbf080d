"""Configuration of a BERT-family encoder (BERT, MiniLM, sentence-transformers)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pockjax.errors import CheckpointError, UnsupportedModelError

__all__ = ["BertConfig", "SUPPORTED_ARCHITECTURES"]

#: ``architectures`` entries of a ``config.json`` that :meth:`BertConfig.from_hf`
#: accepts: a bare encoder (the pooler, if present, is not used).
SUPPORTED_ARCHITECTURES = ("BertModel",)

_INT_FIELDS = {"vocab": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers",
               "heads": "num_attention_heads", "intermediate": "intermediate_size",
               "max_position": "max_position_embeddings", "type_vocab": "type_vocab_size"}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Shape and numerics of a BERT encoder (post-LayerNorm, absolute positions, GELU).

    Attributes:
        vocab: Vocabulary size (rows of the word embedding table).
        hidden: Model width.
        layers: Number of encoder layers.
        heads: Number of attention heads (``hidden`` must be a multiple).
        intermediate: Inner width of the feed-forward block.
        max_position: Number of learned absolute positions (longest input).
        type_vocab: Number of token types (segments A/B).
        layer_norm_eps: Epsilon of every LayerNorm.
        hidden_act: Feed-forward activation; only ``"gelu"`` (the exact erf
            GELU, Hugging Face's ``"gelu"``) is supported.
        hidden_dropout: Dropout after the embeddings, the attention output and
            the feed-forward output (active only in ``.train()`` mode).
        attention_dropout: Dropout on the attention probabilities.
        pad_id: Id of the padding token.
        num_classes: Outputs of the classification head of a
            :class:`~pockjax.models.bert.BertClassifier` (set by it); ``None``
            for a bare encoder. The named schemes train ``head.*`` only when set.

    Example:
        >>> cfg = BertConfig.tiny()
        >>> cfg.hidden, cfg.layers, cfg.head_dim
        (32, 2, 8)
        >>> BertConfig.minilm_l6().num_params()
        22565376
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_position: int = 512
    type_vocab: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    pad_id: int = 0
    num_classes: int | None = None

    def __post_init__(self):
        for name in ("vocab", "hidden", "layers", "heads", "intermediate", "max_position",
                     "type_vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.hidden_act != "gelu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'gelu')")
        for name in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"{name} must be a probability in [0, 1), got {v!r}")
        if isinstance(self.layer_norm_eps, bool) or not isinstance(
                self.layer_norm_eps, (int, float)) or not 0 < self.layer_norm_eps < 1:
            raise ValueError(f"layer_norm_eps must be a small positive number,"
                             f" got {self.layer_norm_eps!r}")
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int) \
                or not 0 <= self.pad_id < self.vocab:
            raise ValueError(f"pad_id {self.pad_id!r} is not a token id below vocab={self.vocab}")
        if self.num_classes is not None and (isinstance(self.num_classes, bool) or not isinstance(
                self.num_classes, int) or self.num_classes < 1):
            raise ValueError(f"num_classes must be a positive integer or None,"
                             f" got {self.num_classes!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``hidden // heads``).

        Example:
            >>> BertConfig.minilm_l6().head_dim
            32
        """
        return self.hidden // self.heads

    def replace(self, **changes: Any) -> "BertConfig":
        """Returns a copy with some fields changed.

        Example:
            >>> BertConfig.tiny().replace(num_classes=3).num_classes
            3
        """
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain (JSON-serialisable) dict.

        Example:
            >>> BertConfig(**BertConfig.tiny().to_dict()) == BertConfig.tiny()
            True
        """
        return dataclasses.asdict(self)

    def num_params(self) -> int:
        """Parameters of the encoder (plus the head when ``num_classes`` is set).

        Example:
            >>> BertConfig.tiny().num_params()
            22464
        """
        h, f = self.hidden, self.intermediate
        emb = (self.vocab + self.max_position + self.type_vocab) * h + 2 * h
        layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        head = 0 if self.num_classes is None else h * self.num_classes + self.num_classes
        return emb + self.layers * layer + head

    @classmethod
    def from_hf(cls, config_json: dict[str, Any], source: str | os.PathLike = "config.json",
                **overrides: Any) -> "BertConfig":
        """Maps a Hugging Face BERT ``config.json`` dict to a :class:`BertConfig`.

        Args:
            config_json: The parsed ``config.json``.
            source: The file, named in error messages.
            **overrides: fields to override (e.g. ``hidden_dropout=0.0``).

        Raises:
            UnsupportedModelError: not ``model_type == "bert"``, an architecture
                other than :data:`SUPPORTED_ARCHITECTURES`, relative position
                embeddings, an activation other than ``gelu``, or a decoder.
            CheckpointError: a required field is missing or has a wrong value.

        Example:
            >>> BertConfig.from_hf({"model_type": "bert", "vocab_size": 100, "hidden_size": 32,
            ...     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}).head_dim
            8
            >>> BertConfig.from_hf({"model_type": "bert", "architectures": ["BertForMaskedLM"]})
            Traceback (most recent call last):
            ...
            pockjax.errors.UnsupportedModelError: config.json: architecture 'BertForMaskedLM' is not supported; pockjax loads ['BertModel'] (a bare encoder)
        """
        src = os.fspath(source)
        c = config_json
        if not isinstance(c, dict):
            raise CheckpointError(f"{src}: expected a JSON object")
        if c.get("model_type") != "bert":
            raise UnsupportedModelError(
                f"{src}: model_type {c.get('model_type')!r} is not supported; this loader reads"
                f" 'bert' encoders (architectures {c.get('architectures')})")
        archs = c.get("architectures", ["BertModel"])
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise CheckpointError(f"{src}: architectures must be a list of strings, got {archs!r}")
        for a in archs:
            if a not in SUPPORTED_ARCHITECTURES:
                raise UnsupportedModelError(
                    f"{src}: architecture {a!r} is not supported; pockjax loads"
                    f" {list(SUPPORTED_ARCHITECTURES)} (a bare encoder)")
        pos = c.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise UnsupportedModelError(f"{src}: position_embedding_type {pos!r} is not supported"
                                        f" (only 'absolute')")
        act = c.get("hidden_act", "gelu")
        if act != "gelu":
            raise UnsupportedModelError(f"{src}: hidden_act {act!r} is not supported (only the"
                                        f" exact 'gelu')")
        for flag in ("is_decoder", "add_cross_attention"):
            if c.get(flag):
                raise UnsupportedModelError(f"{src}: {flag} is set; only encoders are supported")
        missing = [k for k in _INT_FIELDS.values() if k not in c
                   and k not in ("max_position_embeddings", "type_vocab_size")]
        if missing:
            raise CheckpointError(f"{src}: missing {', '.join(missing)}")
        fields: dict[str, Any] = {}
        for ours, theirs in _INT_FIELDS.items():
            if theirs not in c:
                continue
            v = c[theirs]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CheckpointError(f"{src}: {theirs} must be a positive integer, got {v!r}")
            fields[ours] = v
        for ours, theirs in (("layer_norm_eps", "layer_norm_eps"),
                             ("hidden_dropout", "hidden_dropout_prob"),
                             ("attention_dropout", "attention_probs_dropout_prob")):
            if theirs in c:
                v = c[theirs]
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise CheckpointError(f"{src}: {theirs} must be a number, got {v!r}")
                fields[ours] = float(v)
        pad = c.get("pad_token_id", 0)
        fields["pad_id"] = 0 if pad is None else pad
        fields.update(overrides)
        try:
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{src}: inconsistent model config ({e})") from None

    @classmethod
    def minilm_l6(cls, **overrides: Any) -> "BertConfig":
        """all-MiniLM-L6-v2: 6 layers, width 384, 12 heads, FFN 1536, vocab 30522.

        Example:
            >>> BertConfig.minilm_l6(hidden_dropout=0.0).hidden_dropout
            0.0
        """
        base = cls(vocab=30522, hidden=384, layers=6, heads=12, intermediate=1536)
        return base.replace(**overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> "BertConfig":
        """A tiny encoder for tests: vocab 100, width 32, 2 layers, 4 heads.

        Example:
            >>> BertConfig.tiny(layers=3).layers
            3
        """
        base = cls(vocab=100, hidden=32, layers=2, heads=4, intermediate=64, max_position=64)
        return base.replace(**overrides)

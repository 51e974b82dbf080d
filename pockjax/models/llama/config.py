"""Configuration of a LLaMA-architecture model."""

from __future__ import annotations

import dataclasses
from typing import Any


def is_finite_number(x: Any) -> bool:
    """Whether ``x`` is a finite int or float (not a bool): a number read from a file (JSON, GGUF).

    Example:
        >>> [is_finite_number(v) for v in (8, -0.5, 0, 10**400, True, float("inf"), float("nan"), "8", None)]
        [True, True, True, True, False, False, False, False, False]
    """
    return isinstance(x, (int, float)) and not isinstance(x, bool) and -float("inf") < x < float("inf")


def is_positive_number(x: Any) -> bool:
    """Whether ``x`` is a finite positive int or float (not a bool): a scale, base or factor read from a file.

    Example:
        >>> [is_positive_number(v) for v in (8, 0.5, 0, True, float("inf"), float("nan"), "8")]
        [True, True, False, False, False, False, False]
    """
    return is_finite_number(x) and x > 0


#: The architectures :class:`LlamaConfig` describes.
ARCHS = ("llama", "qwen2", "gemma3")

#: The two kinds of attention layer of a Gemma 3 model (Hugging Face's ``layer_types`` names).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a LLaMA-architecture decoder.

    Attributes:
        vocab: Vocabulary size (rows of the embedding table).
        dim: Model width (embedding size).
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads.
        n_kv_heads: Number of key/value heads (grouped-query attention when smaller
            than ``n_heads``).
        hidden_dim: Inner width of the SwiGLU feed-forward block.
        rope_theta: Base of the rotary position embedding frequencies.
        rms_eps: Epsilon of RMSNorm.
        tie_embeddings: If True the output projection reuses ``embed.embedding``
            and there is no ``lm_head``.
        max_seq_len: Longest context the model supports (positions ``0 ..
            max_seq_len - 1``).
        scan_layers: If True the blocks are stacked under ``layers.<name>`` with a
            leading layer axis and run with ``jax.lax.scan``; otherwise they are a
            list ``layers.0``, ``layers.1``, ...
        head_dim: Width of one attention head; ``None`` means ``dim // n_heads``.
        qkv_bias: Whether the Q, K and V projections have biases (Qwen2).
        rope_scaling: RoPE frequency scaling: ``None``, Llama 3's
          ``("llama3", factor, low_freq_factor, high_freq_factor,
          original_max_position_embeddings)``, ``("linear", factor)`` (every
          frequency divided by ``factor``: positions interpolated; Gemma 3
          4B-27B, on their full-attention layers only), or ``("factors", f_0,
          ...)`` (each frequency divided by its f_i, as GGUF's ``rope_freqs``).
          See :func:`rope_freq_factors`.
        arch: The architecture the weights come from and export to:
          ``llama``, ``qwen2`` (LLaMA with Q/K/V biases; no row permutation
          of Q and K in GGUF) or ``gemma3`` (Gemma 3 text models: RMSNorm
          after attention and after the MLP too, RMSNorm of each query and
          key head, GeGLU with tanh-approximated GELU, embeddings scaled by
          ``sqrt(dim)``, sliding-window layers; see :mod:`.model`).
        layer_types: Gemma 3: the attention of each layer, ``"full_attention"``
          or ``"sliding_attention"`` (``n_layers`` entries); ``None``: all full.
        sliding_window: Gemma 3: a sliding-attention query at slot ``t`` sees
          the keys at slots ``t - sliding_window + 1 .. t``.
        rope_local_theta: Gemma 3: the RoPE base of the sliding-attention
          layers (``rope_theta`` is the full-attention layers' base).
        query_pre_attn_scalar: Gemma 3: attention scores are divided by its
          square root (``None``: by ``sqrt(head_dim)``, as LLaMA).
        attn_block_rows: Causal self-attention over ``t`` tokens runs in query
            blocks of at least this many rows, each attending only to the keys
            up to its end, which skips the masked part of the attention
            products (:func:`pockjax.models.llama.causal_query_blocks`);
            ``None`` attends in one piece. Results are the same either way.

    Example:
        >>> cfg = LlamaConfig.tiny()
        >>> cfg.dim, cfg.n_layers, cfg.head_dim_
        (64, 2, 16)
        >>> LlamaConfig.smollm2_135m().n_kv_heads
        3
    """

    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    scan_layers: bool = False
    head_dim: int | None = None
    attn_block_rows: int | None = 64
    qkv_bias: bool = False
    arch: str = "llama"
    rope_scaling: tuple | None = None
    layer_types: tuple | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self):
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a JSON list reads back
            if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types={self.layer_types!r}: expected {self.n_layers} entries"
                                 f" (one per layer), each one of {', '.join(LAYER_TYPES)}")
        gemma_only = {"layer_types": self.layer_types, "sliding_window": self.sliding_window,
                      "rope_local_theta": self.rope_local_theta,
                      "query_pre_attn_scalar": self.query_pre_attn_scalar}
        if self.arch != "gemma3" and any(v is not None for v in gemma_only.values()):
            given = sorted(k for k, v in gemma_only.items() if v is not None)
            raise ValueError(f"{', '.join(given)}: Gemma 3 fields, but arch={self.arch!r}")
        if self.is_sliding(*range(self.n_layers)) and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r}: sliding-attention layers need a"
                             f" window of at least 1 token")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))  # a JSON list reads back
            kind = self.rope_scaling[0] if self.rope_scaling else None
            values = self.rope_scaling[1:]
            if kind not in ("llama3", "linear", "factors") or (kind == "llama3" and len(values) != 4) \
                    or (kind == "linear" and len(values) != 1) \
                    or (kind == "factors" and len(values) != self.head_dim_ // 2) \
                    or not all(is_positive_number(v) for v in values):
                raise ValueError(f"rope_scaling={self.rope_scaling!r}: expected ('llama3', factor,"
                                 f" low_freq_factor, high_freq_factor, original_max_position_embeddings),"
                                 f" ('linear', factor) or ('factors', one divisor per frequency), all positive")
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}: pockjax builds {', '.join(ARCHS)} models")
        if self.attn_block_rows is not None and self.attn_block_rows < 1:
            raise ValueError(f"attn_block_rows={self.attn_block_rows} must be at least 1"
                             f" (or None to attend in one piece)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                    f"n_heads={self.n_heads} must be a multiple of"
                    f" n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                    f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim_ % 2:
            raise ValueError(f"head dimension {self.head_dim_} must be even for RoPE")

    @property
    def head_dim_(self) -> int:
        """Width of one attention head (``head_dim`` or ``dim // n_heads``).

        Example:
            >>> LlamaConfig.smollm2_135m().head_dim_
            64
        """
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def is_sliding(self, *layers: int) -> bool:
        """Whether any of the given layers attends in a sliding window (Gemma 3).

        Example:
            >>> cfg = LlamaConfig.tiny_gemma3()
            >>> cfg.layer_types
            ('sliding_attention', 'full_attention', 'sliding_attention', 'full_attention')
            >>> cfg.is_sliding(0), cfg.is_sliding(1), cfg.is_sliding(1, 2)
            (True, False, True)
        """
        return self.layer_types is not None and any(
            self.layer_types[i] == "sliding_attention" for i in layers)

    def slice_layers(self, start: int, stop: int) -> "LlamaConfig":
        """The config of layers ``start .. stop - 1`` alone (their layer types kept).

        Example:
            >>> LlamaConfig.tiny_gemma3().slice_layers(1, 3).layer_types
            ('full_attention', 'sliding_attention')
        """
        types = None if self.layer_types is None else self.layer_types[start:stop]
        return self.replace(n_layers=stop - start, layer_types=types)

    def replace(self, **changes: Any) -> "LlamaConfig":
        """Returns a copy with some fields changed.

        Example:
            >>> LlamaConfig.tiny().replace(scan_layers=True).scan_layers
            True
        """
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Returns the fields as a plain dict (JSON-serialisable).

        Example:
            >>> LlamaConfig.from_dict(LlamaConfig.tiny().to_dict()) == LlamaConfig.tiny()
            True
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Builds a config from :meth:`to_dict` output; unknown keys are an error.

        Example:
            >>> LlamaConfig.from_dict({**LlamaConfig.tiny().to_dict(), "n_layers": 3}).n_layers
            3
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown LlamaConfig fields: {unknown}")
        return cls(**d)

    def num_params(self) -> int:
        """Number of parameters of a model with this config.

        Example:
            >>> LlamaConfig.smollm2_135m().num_params()
            134515008
        """
        hd = self.head_dim_
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += hd * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
        mlp = 3 * self.dim * self.hidden_dim
        per_layer = attn + mlp + 2 * self.dim
        if self.arch == "gemma3":  # norms after attention and MLP, and of each query / key head
            per_layer += 2 * self.dim + 2 * hd
        head = 0 if self.tie_embeddings else self.vocab * self.dim
        return self.vocab * self.dim + self.n_layers * per_layer + self.dim + head

    @classmethod
    def smollm2_135m(cls, **overrides: Any) -> "LlamaConfig":
        """SmolLM2-135M(-Instruct): 30 layers, width 576, 9 query / 3 kv heads.

        Example:
            >>> LlamaConfig.smollm2_135m(max_seq_len=512).max_seq_len
            512
        """
        base = cls(vocab=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                              hidden_dim=1536, rope_theta=100000.0, rms_eps=1e-5,
                              tie_embeddings=True, max_seq_len=8192)
        return base.replace(**overrides)

    @classmethod
    def llama2_7b(cls, **overrides: Any) -> "LlamaConfig":
        """LLaMA-2-7B: 32 layers, width 4096, 32 heads, untied embeddings.

        Example:
            >>> round(LlamaConfig.llama2_7b().num_params() / 1e9, 2)
            6.74
        """
        base = cls(vocab=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                              hidden_dim=11008, rope_theta=10000.0, rms_eps=1e-5,
                              tie_embeddings=False, max_seq_len=4096)
        return base.replace(**overrides)

    @classmethod
    def gemma3_270m(cls, **overrides: Any) -> "LlamaConfig":
        """Gemma 3 270M: 18 layers (every 6th one full attention), width 640, head width 256.

        Example:
            >>> cfg = LlamaConfig.gemma3_270m()
            >>> cfg.num_params(), cfg.layer_types.count("full_attention")
            (268098176, 3)
        """
        types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
        base = cls(vocab=262144, dim=640, n_layers=18, n_heads=4, n_kv_heads=1, hidden_dim=2048,
                   rope_theta=1000000.0, rms_eps=1e-6, tie_embeddings=True, max_seq_len=32768,
                   head_dim=256, arch="gemma3", layer_types=types, sliding_window=512,
                   rope_local_theta=10000.0, query_pre_attn_scalar=256.0)
        return base.replace(**overrides)

    @classmethod
    def tiny_gemma3(cls, **overrides: Any) -> "LlamaConfig":
        """A tiny Gemma 3 model for tests: 4 layers alternating sliding (window 3) and full attention.

        Example:
            >>> LlamaConfig.tiny_gemma3().head_dim_
            32
        """
        base = cls(vocab=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=96,
                   rope_theta=1000000.0, rms_eps=1e-6, tie_embeddings=True, max_seq_len=64,
                   head_dim=32, arch="gemma3", sliding_window=3, rope_local_theta=10000.0,
                   query_pre_attn_scalar=24.0,
                   layer_types=("sliding_attention", "full_attention") * 2)
        return base.replace(**overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> "LlamaConfig":
        """A tiny model for tests: 2 layers, width 64, 4 query / 2 kv heads.

        Example:
            >>> LlamaConfig.tiny(vocab=50).vocab
            50
        """
        base = cls(vocab=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              hidden_dim=96, rope_theta=10000.0, rms_eps=1e-5,
                              tie_embeddings=False, max_seq_len=64)
        return base.replace(**overrides)


def rope_freq_factors(config: LlamaConfig):
    """The divisor of each RoPE frequency (``head_dim // 2`` floats), or None without scaling.

    Llama 3's scaling keeps the high frequencies, divides the low ones by
    ``factor`` and blends in between (as transformers' ``llama3`` rope type
    and llama.cpp's ``rope_freqs`` tensor compute it).

    Example:
        >>> cfg = LlamaConfig.tiny(rope_scaling=("llama3", 8.0, 1.0, 4.0, 32))  # wavelengths 6.3, 21, 69, ...
        >>> [round(float(f), 2) for f in rope_freq_factors(cfg)]  # kept below 32 / 4, divided by 8 above 32
        [1.0, 3.3, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
        >>> rope_freq_factors(LlamaConfig.tiny(rope_scaling=("linear", 8.0))).tolist()
        [8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
        >>> rope_freq_factors(LlamaConfig.tiny()) is None
        True
    """
    import math

    import numpy as np

    if config.rope_scaling is None:
        return None
    kind, *values = config.rope_scaling
    if kind == "factors":
        return np.asarray(values, np.float32)
    if kind == "linear":
        return np.full(config.head_dim_ // 2, values[0], np.float32)
    factor, low, high, old_len = (float(v) for v in values)
    hd = config.head_dim_
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)

"""Frozen weights kept block-quantized: :class:`QTensor` and its formats.

A frozen matrix needs no gradient, so it need not be held in float32. A
:class:`QTensor` holds it in one of llama.cpp's block formats, 32 values per
block along the stored rows:

==========  ======================================  ===============
format      per block of 32 values                   bytes / value
==========  ======================================  ===============
``q8_0``    32 int8 ``q``, float16 ``scale``         1.0625
``q4_0``    32 4-bit ``q`` (2 per byte), ``scale``   0.5625
``q4_1``    32 4-bit ``q``, ``scale`` and ``min``    0.625
``bf16``    the values in bfloat16 (no blocks)       2
==========  ======================================  ===============

value = ``scale * q`` (q8_0), ``scale * (q - 8)`` (q4_0), ``scale * q + min``
(q4_1). The 4-bit values are packed as GGUF packs them (value ``j`` of a block
in the low nibble of byte ``j``, value ``j + 16`` in the high nibble), so a
tensor read from a GGUF file keeps its bytes, and :func:`dequantize` gives
what ``gguf.quants.dequantize`` gives.

A ``QTensor`` is a pytree (its arrays are the leaves) that stands in the
parameters a step receives in place of the float matrix: the step itself is
written for the float matrix, and :func:`pockjax.compile` traces it with the
float value's shape, then dequantizes block-wise right before each use in
the compiled program (never as a whole float copy of the model). A scheme
must freeze every quantized tensor: pockjax cannot train one and says so.

Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> w = np.linspace(-1, 1, 64 * 8, dtype=np.float32).reshape(64, 8)
    >>> qt = quantize(w, "q8_0", transposed=True)   # blocks run along axis 0 of w
    >>> qt.shape, qt.qtype, qt.nbytes
    ((64, 8), 'q8_0', 544)
    >>> bool(np.abs(np.asarray(dequantize(qt)) - w).max() < 0.01)
    True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax.errors import PockjaxError

__all__ = [
    "BLOCK",
    "BYTES_PER_VALUE",
    "FORMATS",
    "QTensor",
    "QuantizationError",
    "abstract",
    "dequantize",
    "dequantize_host",
    "dequantize_tree",
    "from_gguf_blocks",
    "is_qtensor",
    "quantize",
    "to_gguf_blocks",
    "tree_nbytes",
]

#: Values per block (along the stored rows).
BLOCK = 32
#: The supported formats, and their GGUF type names.
FORMATS = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "bf16": "BF16"}
#: Bytes held per value of the matrix, scales included.
BYTES_PER_VALUE = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "bf16": 2.0}


class QuantizationError(PockjaxError, ValueError):
    """A tensor cannot be quantized, or a quantized tensor is used where it cannot be."""


def _fields(qtype: str) -> tuple[str, ...]:
    return {"q4_1": ("q", "scale", "min"), "bf16": ("q",)}.get(qtype, ("q", "scale"))


@jax.tree_util.register_pytree_with_keys_class
class QTensor:
    """A frozen matrix in a block-quantized format (a pytree of its arrays).

    Attributes:
      qtype: ``"q8_0"``, ``"q4_0"`` or ``"q4_1"``.
      q: int8 ``(..., rows, cols)`` (q8_0) or packed uint8 ``(..., rows, cols // 2)``.
      scale: float16 ``(..., rows, cols // 32)``, one per block.
      min: float16 like ``scale`` (q4_1 only), else None.
      transposed: the value is the stored ``(rows, cols)`` matrix transposed
        (a model's ``(in, out)`` kernel stored as GGUF's ``(out, in)`` rows).
      dtype: the float dtype the value is used in (float32 or bfloat16).

    Leading axes (stacked layers) are kept in front of every array.
    """

    def __init__(self, qtype: str, q, scale=None, min=None, *, transposed: bool = False,
                 dtype: Any = jnp.float32):
        if qtype not in FORMATS:
            raise QuantizationError(f"unknown quantized format {qtype!r}; formats: {sorted(FORMATS)}")
        self.qtype = qtype
        self.q = q
        self.scale = scale
        self.min = min
        self.transposed = bool(transposed)
        self.dtype = np.dtype(dtype)

    # -- pytree -----------------------------------------------------------------
    def tree_flatten_with_keys(self):
        names = _fields(self.qtype)
        children = [(jax.tree_util.GetAttrKey(n), getattr(self, n)) for n in names]
        return children, (self.qtype, self.transposed, self.dtype.name)

    def tree_flatten(self):
        return [getattr(self, n) for n in _fields(self.qtype)], (self.qtype, self.transposed, self.dtype.name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        qtype, transposed, dtype = aux
        obj = object.__new__(cls)
        obj.qtype, obj.transposed, obj.dtype = qtype, transposed, np.dtype(dtype)
        obj.q = children[0]
        obj.scale = children[1] if len(children) > 1 else None
        obj.min = children[2] if len(children) > 2 else None
        return obj

    # -- the value it stands for ------------------------------------------------
    @property
    def stored_shape(self) -> tuple[int, ...]:
        """``(..., rows, cols)`` of the stored (dequantized, untransposed) matrix."""
        if self.qtype == "bf16":
            return tuple(np.shape(self.q))
        s = tuple(np.shape(self.scale))
        return s[:-1] + (s[-1] * BLOCK,)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float value this tensor stands for."""
        s = self.stored_shape
        return s[:-2] + (s[-1], s[-2]) if self.transposed else s

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes held (codes and scales)."""
        return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(self)))

    def abstract(self) -> jax.ShapeDtypeStruct:
        """The float value's ``ShapeDtypeStruct``."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    def astype(self, dtype) -> "QTensor":
        """The same codes, used as a value of ``dtype``."""
        return QTensor(self.qtype, self.q, self.scale, self.min, transposed=self.transposed, dtype=dtype)

    def __repr__(self) -> str:
        return (f"QTensor({self.qtype}, shape={self.shape}, dtype={self.dtype.name},"
                f" {self.nbytes} bytes{', transposed' if self.transposed else ''})")


def is_qtensor(x) -> bool:
    """Whether ``x`` is a :class:`QTensor` (the ``is_leaf`` of tree walks that stop at one)."""
    return isinstance(x, QTensor)


def abstract(tree):
    """``tree`` with every :class:`QTensor` replaced by its float value's ``ShapeDtypeStruct``.

    Example:
        >>> qt = quantize(np.ones((2, 32), np.float32), "q4_0")
        >>> abstract({"w": qt, "b": 1.0})["w"]
        ShapeDtypeStruct(shape=(2, 32), dtype=float32)
    """
    return jax.tree.map(lambda x: x.abstract() if is_qtensor(x) else x, tree, is_leaf=is_qtensor)


def tree_nbytes(tree) -> int:
    """Bytes held by the arrays of ``tree`` (a QTensor counts its codes and scales)."""
    return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# -- dequantization (traceable) ---------------------------------------------------
def _unpack4(q, xp=jnp):
    # (..., rows, nb * 16) bytes -> (..., rows, nb, 32) codes in GGUF's order
    blocks = q.reshape(q.shape[:-1] + (q.shape[-1] // 16, 16))
    return xp.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)


def dequantize(qt: QTensor, dtype: Any = None) -> jax.Array:
    """The float value of ``qt`` (in ``dtype``, default ``qt.dtype``), traceable.

    Computed in float32 as ``gguf.quants.dequantize`` computes it, then cast.
    Inside a step compiled by :func:`pockjax.compile` this runs right before
    each use of the matrix.

    Example:
        >>> qt = quantize(np.array([[1.0] * 16 + [-1.0] * 16], np.float32), "q4_0")
        >>> dequantize(qt)[0, :2].tolist(), dequantize(qt)[0, -1].tolist()  # 4 bits: 15 codes of -8..7
        ([1.0, 1.0], -0.875)
    """
    return _dequantize(qt, dtype, jnp)


def dequantize_host(qt: QTensor, dtype: Any = None) -> np.ndarray:
    """:func:`dequantize` in numpy, on the host: no JAX operation runs.

    What writing a checkpoint uses: each tensor's value is computed, written and
    dropped, with no compiled program or device buffer left behind.

    Example:
        >>> qt = quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), "q4_1")
        >>> bool((dequantize_host(qt) == np.asarray(dequantize(qt))).all())
        True
    """
    return _dequantize(qt, dtype, np)


def _dequantize(qt: QTensor, dtype: Any, xp) -> Any:
    dtype = qt.dtype if dtype is None else np.dtype(dtype)
    q = xp.asarray(qt.q)
    if qt.qtype == "bf16":
        value = q.astype(dtype)
        return xp.swapaxes(value, -1, -2) if qt.transposed else value
    scale = xp.asarray(qt.scale).astype(np.float32)[..., None]
    if qt.qtype == "q8_0":
        codes = q.reshape(q.shape[:-1] + (q.shape[-1] // BLOCK, BLOCK)).astype(np.float32)
        value = scale * codes
    elif qt.qtype == "q4_0":
        value = scale * (_unpack4(q, xp).astype(np.float32) - np.float32(8.0))
    else:
        value = scale * _unpack4(q, xp).astype(np.float32) + xp.asarray(qt.min).astype(np.float32)[..., None]
    value = value.reshape(qt.stored_shape).astype(dtype)
    return xp.swapaxes(value, -1, -2) if qt.transposed else value


def dequantize_tree(tree, dtype: Any = None):
    """``tree`` with every :class:`QTensor` dequantized (whole: for checks and export)."""
    return jax.tree.map(lambda x: dequantize(x, dtype) if is_qtensor(x) else x, tree, is_leaf=is_qtensor)


# -- quantization (numpy, on the host) ----------------------------------------------
# Blocks are quantized a slice of rows at a time (about 1M values: 4 MB of float32), in
# place where the arithmetic allows, so the temporaries stay small and are reused instead of
# being whole-matrix copies that the system must fault in page by page (a 262,144 x 640
# embedding took 12 s in five whole-size passes, against under 1 s in slices). GGUF
# dequantization (pockjax.models.llama.gguf) goes by the same slice size.
SLICE_VALUES = 1 << 20
_F16_MAX = float(np.finfo(np.float16).max)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    # C's roundf (what ggml's reference quantizers use), not numpy's round-half-even; in place.
    # floor(|x|) plus one where the fraction is at least a half: exact in float32 (adding 0.5 and
    # truncating is not: 0.49999997 + 0.5 rounds to 1.0)
    sign = np.sign(x)
    np.abs(x, out=x)
    whole = np.floor(x)
    x -= whole
    x *= 2
    np.floor(x, out=x)
    x += whole
    x *= sign
    return x


def _quantize_rows(x: np.ndarray, qtype: str):
    """(n, nb, 32) float32 blocks -> (codes (n, nb, 32), d (n, nb, 1), min (n, nb, 1) or None)."""
    if qtype == "q8_0":
        d = np.abs(x).max(axis=-1, keepdims=True)
        d /= 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        y = x * inv
        return _round_half_away(y).astype(np.int8), d, None
    if qtype == "q4_0":
        # the value of largest magnitude, with its sign, maps to code 0 (-8)
        idx = np.abs(x).argmax(axis=-1)[..., None]
        d = np.take_along_axis(x, idx, axis=-1) / -8.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        y = x * inv
        y += 8.5
        np.trunc(y, out=y)
        return np.minimum(y, 15, out=y).astype(np.uint8), d, None
    lo = x.min(axis=-1, keepdims=True)
    d = x.max(axis=-1, keepdims=True)
    d -= lo
    d /= 15.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    y = x - lo
    y *= inv
    y += 0.5
    np.trunc(y, out=y)
    return np.clip(y, 0, 15, out=y).astype(np.uint8), d, lo


def quantize(w, qtype: str, *, transposed: bool = False, dtype: Any = None) -> QTensor:
    """Quantizes a float matrix as ggml's reference quantizers do (numpy, on the host).

    Args:
      w: A float array of two or more axes (leading axes: stacked layers).
      qtype: ``"q8_0"``, ``"q4_0"`` or ``"q4_1"``.
      transposed: Quantize ``w`` with its last two axes swapped, so that the
        blocks run along ``w``'s second-to-last axis (a model's ``(in, out)``
        kernel is stored as ``(out, in)`` rows of blocks, as GGUF stores it).
      dtype: The dtype the value is used in (default: ``w``'s, or float32).
        A ``"bf16"`` tensor is used in float32 unless ``dtype`` names
        another type than bfloat16 (its held form is already bfloat16;
        bfloat16 products come from ``pockjax.compile(precision="bf16")``).

    Raises:
      QuantizationError: ``w`` is not a float matrix, or its blocked axis is
        not a multiple of 32, or it holds a NaN or an infinity.

    Example:
        >>> qt = quantize(np.arange(64, dtype=np.float32).reshape(1, 64), "q4_1")
        >>> qt.q.shape, qt.scale.shape, qt.min.shape
        ((1, 32), (1, 2), (1, 2))
    """
    if qtype not in FORMATS:
        raise QuantizationError(f"unknown quantized format {qtype!r}; formats: {sorted(FORMATS)}")
    a = np.asarray(w)
    if a.ndim < 2 or not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
        raise QuantizationError(f"only float matrices are quantized; got {a.dtype} of shape {a.shape}")
    if dtype is None:
        dtype = a.dtype if a.dtype.name in ("float32", "bfloat16") else np.float32
    if transposed:
        a = np.swapaxes(a, -1, -2)
    if qtype == "bf16":  # held in bfloat16, used in float32 (or dtype)
        import ml_dtypes

        return QTensor(qtype, np.ascontiguousarray(a.astype(ml_dtypes.bfloat16)), transposed=transposed,
                       dtype=np.float32 if dtype is None or np.dtype(dtype).name == "bfloat16" else dtype)
    rows, cols = a.shape[-2:]
    if cols == 0 or cols % BLOCK:
        axis = "second-to-last" if transposed else "last"
        raise QuantizationError(f"a matrix of shape {np.shape(w)} cannot be quantized in blocks of"
                                f" {BLOCK}: its {axis} axis ({cols}) is not a positive multiple of {BLOCK}")
    nb = cols // BLOCK
    # the stacked matrices (merging the leading axes is a view, also of a transposed ``a``), each
    # read a slice of rows at a time: a transposed matrix is gathered slice by slice, never copied whole
    mats = a.reshape((int(np.prod(a.shape[:-2], dtype=np.int64)), rows, cols))
    n = mats.shape[0] * rows
    codes = np.empty((n, nb, BLOCK), np.int8 if qtype == "q8_0" else np.uint8)
    scale = np.empty((n, nb), np.float16)
    low = np.empty((n, nb), np.float16) if qtype == "q4_1" else None
    step = max(1, SLICE_VALUES // cols)
    for m in range(mats.shape[0]):
        for r in range(0, rows, step):
            x = np.asarray(mats[m, r:r + step], np.float32).reshape(-1, nb, BLOCK)  # read only below
            if not np.isfinite(x).all():
                raise QuantizationError(f"a matrix of shape {np.shape(w)} holds NaN or infinite values"
                                        f" (as float32)")
            c, d, lo = _quantize_rows(x, qtype)
            # the scales (and q4_1's minima) are stored as float16: a value too large for them
            # would come back as inf or NaN, so it is refused here
            if not (np.abs(d) <= _F16_MAX).all() or lo is not None and not (np.abs(lo) <= _F16_MAX).all():
                raise QuantizationError(
                    f"a matrix of shape {np.shape(w)} holds values up to {float(np.abs(x).max()):.4g}:"
                    f" {qtype}'s float16 block scales{' and minima' if lo is not None else ''} cannot hold"
                    f" them (at most {_F16_MAX:.0f}); keep this tensor in float, or scale it down first")
            at = slice(m * rows + r, m * rows + r + len(c))
            codes[at], scale[at] = c, d[..., 0]
            if low is not None:
                low[at] = lo[..., 0]
    lead = a.shape[:-1]
    scale, low = scale.reshape(lead + (nb,)), None if low is None else low.reshape(lead + (nb,))
    if qtype == "q8_0":
        return QTensor(qtype, codes.reshape(a.shape), scale, transposed=transposed, dtype=dtype)
    return QTensor(qtype, _pack4(codes.reshape(lead + (nb, BLOCK)), a.shape), scale, low,
                   transposed=transposed, dtype=dtype)


def _pack4(codes: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    # (..., nb, 32) codes -> (..., rows, nb * 16) bytes: low nibble value j, high value j + 16
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.ascontiguousarray(packed.astype(np.uint8).reshape(shape[:-1] + (shape[-1] // 2,)))


# -- GGUF blocks -------------------------------------------------------------------
_GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...], *,
                     transposed: bool = False, dtype: Any = np.float32) -> QTensor:
    """A :class:`QTensor` holding a GGUF tensor's blocks (no dequantization, no requantization).

    Args:
      raw: The tensor's bytes as stored in the file (``uint8``).
      type_name: ``"Q8_0"``, ``"Q4_0"`` or ``"Q4_1"``.
      shape: The numpy shape of the tensor (``(rows, cols)``, blocks along ``cols``).
      transposed: The value is the transposed matrix (see :class:`QTensor`).

    Example:
        >>> import gguf
        >>> w = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
        >>> raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
        >>> qt = from_gguf_blocks(raw, "Q4_1", (4, 64))
        >>> ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
        >>> bool((np.asarray(dequantize(qt)) == ref).all())
        True
    """
    qtype = type_name.lower()
    if qtype not in _GGUF_BLOCK_BYTES:
        raise QuantizationError(f"GGUF type {type_name} is not kept quantized; kept: {sorted(FORMATS.values())}")
    rows, cols = shape[:-1], shape[-1]
    nbytes = _GGUF_BLOCK_BYTES[qtype]
    if cols % BLOCK:
        raise QuantizationError(f"{type_name} tensor of shape {shape}: last axis not a multiple of {BLOCK}")
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    n_blocks = int(np.prod(shape)) // BLOCK
    if flat.size != n_blocks * nbytes:
        raise QuantizationError(f"{type_name} tensor of shape {shape} needs {n_blocks * nbytes} bytes,"
                                f" got {flat.size}")
    blocks = flat.reshape(rows + (cols // BLOCK, nbytes))
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if qtype == "q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
        return QTensor(qtype, q, scale, transposed=transposed, dtype=dtype)
    if qtype == "q4_0":
        q = np.ascontiguousarray(blocks[..., 2:]).reshape(rows + (cols // 2,))
        return QTensor(qtype, q, scale, transposed=transposed, dtype=dtype)
    mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    q = np.ascontiguousarray(blocks[..., 4:]).reshape(rows + (cols // 2,))
    return QTensor(qtype, q, scale, mins, transposed=transposed, dtype=dtype)


def to_gguf_blocks(qt: QTensor) -> np.ndarray:
    """The GGUF bytes of ``qt``'s stored matrix, ``(..., rows, cols // 32 * block bytes)`` uint8.

    Example:
        >>> qt = quantize(np.ones((2, 32), np.float32), "q8_0")
        >>> to_gguf_blocks(qt).shape
        (2, 34)
    """
    if qt.qtype not in _GGUF_BLOCK_BYTES:
        raise QuantizationError(f"a {qt.qtype} tensor has no GGUF blocks (GGUF block formats:"
                                f" {', '.join(_GGUF_BLOCK_BYTES)}); quantize its value to one of them first")
    lead = tuple(np.shape(qt.scale))
    parts = [np.asarray(qt.scale, np.float16).reshape(lead + (1,)).view(np.uint8)]
    if qt.qtype == "q4_1":
        parts.append(np.asarray(qt.min, np.float16).reshape(lead + (1,)).view(np.uint8))
    per_block = 32 if qt.qtype == "q8_0" else 16
    parts.append(np.asarray(qt.q).view(np.uint8).reshape(lead + (per_block,)))
    blocks = np.concatenate(parts, axis=-1)
    return np.ascontiguousarray(blocks.reshape(lead[:-1] + (lead[-1] * blocks.shape[-1],)))

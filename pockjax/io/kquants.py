"""Dequantization of ggml's 5-bit and K-quant blocks (Q5_0, Q5_1, Q2_K ... Q6_K) with vectorised numpy.

A K-quant block holds 256 values: sub-blocks of 16 or 32 values, each with a
small integer scale (and min) that a float16 super-block scale ``d`` (and
``dmin``) multiplies. These are the types of llama.cpp's ``Q4_K_M``-style
files. Each function takes ``(n_blocks, block bytes)`` uint8 and returns
``(n_blocks, values per block)`` float32, exactly as ggml computes it
(checked against the ``gguf`` package's reference in the tests).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCKS", "DEQUANTIZERS"]

#: type name -> (values per block, bytes per block)
BLOCKS = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q2_K": (256, 84), "Q3_K": (256, 110),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two uint8 columns (little-endian float16) -> ``(n, 1)`` float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _q5_0(b):
    d, qh = _f16(b[:, 0:2]), np.ascontiguousarray(b[:, 2:6]).view(np.uint32)
    qs = b[:, 6:22]
    bits = (qh >> np.arange(32, dtype=np.uint32)) & 1  # bit j: the fifth bit of value j
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (bits.astype(np.uint8) << 4)
    return d * (q.astype(np.float32) - 16.0)


def _q5_1(b):
    d, m, qh = _f16(b[:, 0:2]), _f16(b[:, 2:4]), np.ascontiguousarray(b[:, 4:8]).view(np.uint32)
    qs = b[:, 8:24]
    bits = (qh >> np.arange(32, dtype=np.uint32)) & 1
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (bits.astype(np.uint8) << 4)
    return d * q.astype(np.float32) + m


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K): ``(n, 8)`` each."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 values: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(-1, 256)


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48]  # bit i of qh[l]: the fifth bit of value l of sub-block i
    qs = b[:, 48:176].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (low | (high << 4)).astype(np.float32)
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(-1, 256)


def _q6_k(b):
    ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = _f16(b[:, 208:210])
    # per half of 128 values, four runs of 32: (ql low | qh bits 0-1), (ql[32:] low | bits 2-3),
    # (ql high | bits 4-5), (ql[32:] high | bits 6-7)
    lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    hi = (qh[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = (lo | (hi << 4)).astype(np.float32) - 32.0  # (n, 2, 4, 32)
    # scale index: 16 values each; run r of 32 covers scales 2r and 2r + 1
    s = scales.reshape(-1, 2, 4, 2)[..., None].repeat(16, axis=-1).reshape(-1, 2, 4, 32)
    return (d[:, :, None, None] * s * q).reshape(-1, 256)


def _q2_k(b):
    scales, qs = b[:, 0:16], b[:, 16:80].reshape(-1, 2, 32)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    # per half of 128 values: shifts 0, 2, 4, 6 of the 32 bytes, 16 values per scale
    q = (qs[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3  # (n, 2, 4, 32)
    sc = scales.reshape(-1, 2, 4, 2)
    dl = (d[:, :, None, None] * (sc & 0x0F)).repeat(16, axis=-1)
    ml = (dmin[:, :, None, None] * (sc >> 4)).repeat(16, axis=-1)
    return (dl * q.astype(np.float32) - ml).reshape(-1, 256)


def _q3_k(b):
    hmask, qs = b[:, 0:32], b[:, 32:96].reshape(-1, 2, 32)
    raw = b[:, 96:108].astype(np.uint8)
    d = _f16(b[:, 108:110])
    # 16 six-bit scales: low 4 bits from bytes 0-7, high 2 bits from bytes 8-11
    low = np.concatenate([raw[:, 0:8] & 0x0F, raw[:, 0:8] >> 4], axis=1)
    high = (raw[:, 8:12][:, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]) & 3  # (n, 4, 4)
    scales = (low | (high.reshape(-1, 16) << 4)).astype(np.float32) - 32.0
    q = (qs[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3  # (n, 2, 4, 32)
    # the high bit of sub-block j (0..7) of 32 values is bit j of hmask; a clear bit subtracts 4
    h = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32)
    q = q.astype(np.float32).reshape(-1, 8, 32) - 4.0 * (1 - h.astype(np.float32))
    s = scales.reshape(-1, 8, 2)[..., None].repeat(16, axis=-1).reshape(-1, 8, 32)
    return (d[:, :, None] * s * q).reshape(-1, 256)


#: type name -> dequantize ``(n_blocks, bytes)`` uint8 -> ``(n_blocks, values)`` float32
DEQUANTIZERS = {"Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k,
                "Q5_K": _q5_k, "Q6_K": _q6_k}

"""GGUF K-quant blocks that are MLX affine groups: Q4_K and Q5_K, read without re-quantizing.

A Q4_K / Q5_K super-block holds 256 values in 8 sub-blocks of 32. Sub-block j's value is
    x = d * sc_j * q - dmin * m_j
with d, dmin float16 per super-block, sc_j and m_j 6-bit integers, q a 4- or 5-bit integer.
That is MLX's affine form with group size 32 (x = scale * q + bias): scale = d * sc_j,
bias = -dmin * m_j. The products are rounded once to float16 (the scales' dtype), a
relative change of at most 2^-11 of the scale; q is kept as it is. Q5_K's 5-bit values are
stored at 8 bits (the same value in a wider field: exact), the width with fast kernels.

Layouts (llama.cpp ggml-quants.c, block_q4_K / block_q5_K):
  Q4_K, 144 bytes: d, dmin (float16), scales[12] (the 6-bit sc and m of the 8 sub-blocks),
        qs[128] (for each 64 values: 32 bytes, low nibbles the first 32, high the next 32)
  Q5_K, 176 bytes: d, dmin, scales[12], qh[32] (value i's fifth bit: bit (i // 32) of
        qh[i % 32]), qs[128] as Q4_K's
Q6_K (16 sub-blocks of 16 with signed 8-bit scales) has no group-32 affine form.
"""

import numpy as np

QK = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176}
BITS = {"Q4_K": 4, "Q5_K": 8}  # the bits each is stored at (Q5_K widened)


def _scales_mins(s):
    """scales[..., 12] uint8 -> (sc, m) [..., 8] uint8, llama.cpp's get_scale_min_k4."""
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def _nibbles(qs):
    """qs[..., 128] -> the 256 4-bit values in order: each 32-byte chunk's low nibbles, then high."""
    chunks = qs.reshape(qs.shape[:-1] + (4, 32))
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(qs.shape[:-1] + (QK,))


def affine_groups(kind, raw, rows, n):
    """The raw bytes of a [rows, n] Q4_K / Q5_K tensor -> (q uint8 [rows, n], scales float32
    [rows, n / 32], biases float32 [rows, n / 32]) with x = scales * q + biases per group of 32."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, n // QK, BLOCK_BYTES[kind])
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    sc, m = _scales_mins(blocks[..., 4:16])
    if kind == "Q4_K":
        q = _nibbles(blocks[..., 16:144])
    else:
        qh = blocks[..., 16:48]  # [.., 32]: bit k of byte i is value 32 k + i's fifth bit
        high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8, 32]
        q = _nibbles(blocks[..., 48:176]) | (high.reshape(qh.shape[:-1] + (QK,)) << 4)
    scales = d[..., None] * sc.astype(np.float32)
    biases = -dmin[..., None] * m.astype(np.float32)
    return q.reshape(rows, n), scales.reshape(rows, -1), biases.reshape(rows, -1)

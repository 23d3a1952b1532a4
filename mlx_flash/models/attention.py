"""Attention over a KV cache: mlx_lm's, or, for a cache that hands its keys and values back
in parts (the KV cache on flash: runtime/stores/kv.py), chunk by chunk with a running
softmax, so that no more than one chunk's keys, values and scores are in DRAM at once.

The running softmax is the usual one (as in FlashAttention): per query, the largest score
so far m, the sum of exp(score - m) and the weighted sum of values, rescaled when m grows.
In float32, whatever the compute dtype. A query at position q attends to keys at positions
<= q; a chunk wholly before the queries needs no mask.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention

from . import host

HOST_PROMPT_MIN = 5  # query positions from which a CPU float32 prompt's causal attention runs in NumPy


def attend(queries, keys, values, cache, scale, mask):
    """The attention output (B, H, T, D) for queries (B, H, T, D) and the new keys / values
    (B, H_kv, T, D) after `cache` (None, an mlx_lm cache, or one with `parts`)."""
    if cache is not None and hasattr(cache, "parts"):
        return chunked_attention(queries, cache.offset, cache.parts(keys, values), scale)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    if (host.PASSES and isinstance(mask, str) and mask == "causal" and isinstance(keys, mx.array) and queries.shape[0] == 1
            and queries.shape[2] >= HOST_PROMPT_MIN and queries.dtype == mx.float32 and mx.default_device() == mx.cpu):
        return host_causal_attention(queries, keys, values, scale)
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)


def host_causal_attention(queries, keys, values, scale):
    """A prompt's causal attention on the CPU with its softmax in NumPy: MLX's CPU attention runs a
    219-position prompt's 12 heads at ~16 GFLOP/s (18 ms a layer), its exp ~8x slower than
    NumPy's. The products stay MLX's (its BLAS; NumPy's matmul would wake a second BLAS's threads
    beside MLX's). queries (1, H, T, D) at the last T of the keys' S positions; keys, values
    (1, H_kv, S, D); float32 -> (1, H, T, D): softmax(q k^T * scale + causal mask) v, within
    float32's rounding."""
    _, h, t, d = queries.shape
    hkv, s_len = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(hkv, (h // hkv) * t, d)
    scores = q @ keys[0].swapaxes(-1, -2)
    mx.eval(scores)
    p = np.array(scores).reshape(hkv, h // hkv, t, s_len)  # (a copy: MLX's buffer stays MLX's)
    p += np.triu(np.full((t, s_len), -np.inf, np.float32), k=s_len - t + 1)  # (key after query: -inf)
    p -= p.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    return (mx.array(p).reshape(hkv, (h // hkv) * t, s_len) @ values[0]).reshape(1, h, t, d)


def chunked_attention(queries, offset, parts, scale):
    """queries (B, H, T, D) at positions offset .. offset + T - 1; parts: (keys, values, first
    position) with keys (B, H_kv, C, D), values (B, H_kv, C, Dv), in order of position, the
    first including position 0, the last ending at the queries' last position. -> (B, H, T, Dv)
    in the queries' dtype."""
    b, h, t, d = queries.shape
    q = None
    m = s_sum = acc = None
    for k, v, first in parts:
        hkv, c = k.shape[1], k.shape[2]
        if q is None:
            q = (queries.astype(mx.float32) * scale).reshape(b, hkv, h // hkv, t, d)
        s = q @ k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # (B, H_kv, rep, T, C)
        if first + c - 1 > offset:  # some keys are after some queries
            qpos = mx.arange(offset, offset + t)[:, None]
            kpos = mx.arange(first, first + c)[None]
            s = mx.where(kpos <= qpos, s, -mx.inf)
        top = s.max(axis=-1, keepdims=True)
        if m is None:
            m = top
            p = mx.exp(s - m)
            s_sum = p.sum(axis=-1, keepdims=True)
            acc = p @ v.astype(mx.float32)[:, :, None]
        else:
            m_new = mx.maximum(m, top)
            a = mx.exp(m - m_new)
            p = mx.exp(s - m_new)
            s_sum = s_sum * a + p.sum(axis=-1, keepdims=True)
            acc = acc * a + p @ v.astype(mx.float32)[:, :, None]
            m = m_new
        if first + c < offset + t:  # (a chunk read back: evaluated before the next is read; the last
            mx.eval(m, s_sum, acc)  # part, ending at the queries' own positions, is left to the caller)
    return (acc / s_sum).reshape(b, h, t, -1).astype(queries.dtype)

"""CRC32C of bundle parts: what the converter stores and the reader checks on every read.

The native extension computes them (crc32c.c: SSE4.2 / ARMv8 CRC instructions, ~9.6
GB/s on one core here, a table at ~2 GB/s elsewhere); without it, NumPy computes many
parts at once, one byte position at a time across them (slow, but only the fallback).
"""

import numpy as np

from .native import native_module as _native_module

POLY = 0x82F63B78


def _table():
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(POLY), t >> 1).astype(np.uint32)
    return t


_TABLE = _table()


def _native():
    mod = _native_module()[0]
    return mod if mod is not None and hasattr(mod, "crc32c_rows") else None


def crc32c(data, crc=0):
    """CRC32C of bytes-like `data` (continuing `crc`)."""
    mod = _native()
    if mod is not None:
        return mod.crc32c(data, crc)
    return int(parts_crc(np.frombuffer(data, dtype=np.uint8).reshape(1, -1), [(0, len(data))], crc)[0, 0])


def parts_crc(rows, parts, crc=0):
    """rows: uint8 [n, stride] (bundles); parts: [(offset, length)] within a bundle
    -> uint32 [n, len(parts)]: the CRC32C of each part of each bundle."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    out = np.empty((rows.shape[0], len(parts)), dtype=np.uint32)
    mod = _native()
    if mod is not None:
        col = np.empty(rows.shape[0], dtype=np.uint32)
        for j, (off, n) in enumerate(parts):
            mod.crc32c_rows(rows, rows.strides[0], off, n, col, crc)
            out[:, j] = col
        return out
    for j, (off, n) in enumerate(parts):
        c = np.full(rows.shape[0], ~np.uint32(crc), dtype=np.uint32)
        for k in range(off, off + n):
            c = (c >> 8) ^ _TABLE[(c ^ rows[:, k]) & 0xFF]
        out[:, j] = ~c
    return out

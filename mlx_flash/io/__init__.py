"""Parallel uncached reads of flash files: FlashReader.

    reader.py          FlashReader: a batch of (file, offset, length) reads -> rows, with its stats
    files.py           FlashFile (an uncached open: O_DIRECT / F_NOCACHE), ReadError, ChecksumError
    plan.py            a batch's reads as runs and segments, the plan the native pool executes
    pool.py            the worker pools: native (_native.c) and pure Python
    quantized_rows.py  quantized rows: their codes, dequantization in Python, their checks
    formats.py         dtype codes and the Python row converter
    native.py          the native extension: whether built, its row mover and converter
    checksum.py        CRC32C (crc32c.c); device.py: the disk's counters

Knows no models: files, offsets, rows. Imports nothing of mlx_flash but errors.
"""

from .files import FlashFile, ReadError, logical_block_size
from .native import native_available
from .quantized_rows import Quantized
from .reader import (
    DEFAULT_COALESCE_GAP,
    DEFAULT_MAX_READ,
    READ_THREADS,
    FlashReader,
    ReaderStats,
)

__all__ = [
    "FlashReader",
    "FlashFile",
    "Quantized",
    "ReadError",
    "ReaderStats",
    "DEFAULT_COALESCE_GAP",
    "DEFAULT_MAX_READ",
    "READ_THREADS",
    "logical_block_size",
    "native_available",
]

"""Parallel uncached reads of flash files: FlashReader (see reader.py).

Knows no models: files, offsets, rows. Imports nothing of mlx_flash but errors.
"""

from .reader import (
    DEFAULT_COALESCE_GAP,
    DEFAULT_MAX_READ,
    READ_THREADS,
    FlashFile,
    FlashReader,
    Quantized,
    ReaderStats,
    ReadError,
    logical_block_size,
    native_available,
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

"""What the reader's check of a layer's streamed rows costs the CPU: CRC32C (mlx_flash/io/crc32c.c: three
chains of the crc32 instruction) of 38 MB, a 4-bit OPT-6.7B hybrid layer's reads at --memory-budget 50%,
mean of 5 after one warm-up (stop 45: 2.8 ms, 13.7 GB/s).

usage: .venv/bin/python results/batch/stop45-opt-6.7b-q4/crc_rate.py
"""
import time

import numpy as np

import mlx_flash  # noqa: F401 (before mlx.core)
from mlx_flash.io.checksum import crc32c

a = np.random.default_rng(0).integers(0, 256, 38_000_000, dtype=np.uint8).tobytes()
crc32c(a)
t = time.perf_counter()
for _ in range(5):
    crc32c(a)
dt = (time.perf_counter() - t) / 5
print(f"{dt * 1e3:.1f} ms for 38 MB: {38e6 / dt / 1e9:.1f} GB/s")

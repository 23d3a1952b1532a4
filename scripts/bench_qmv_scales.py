"""Is the native quantized matrix-vector product (kernels/_matvec.c) bound by memory or by compute?
The same weights with float32 and with float16 scales and biases (0.75 against 0.625 bytes a 4-bit
weight at group 32): equal times mean compute-bound.

    .venv/bin/python scripts/bench_qmv_scales.py [--shapes 768x2048,2048x768] [--bits 4] [--group 32]

Best of 5 means of 300 calls each, after 50 warm-ups; GMAC/s beside.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="768x2048,2048x768", help="out x in of each matrix (Qwen3-30B-A3B's experts)")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=32)
    a = p.parse_args()
    import mlx_flash  # noqa: F401  (before mlx: the BLAS set-up)
    import mlx.core as mx
    import numpy as np

    from mlx_flash.kernels import QuantMatrix
    from mlx_flash.runtime.stores.base import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("the native kernels are not available here")
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        q, s, b = mx.quantize(mx.random.normal((n, k)), a.group, a.bits)
        x = np.random.default_rng(0).standard_normal(k).astype(np.float32)
        for dtype in (mx.float32, mx.float16):
            m = QuantMatrix.of_host(kernels, np.array(q), np.array(s.astype(dtype)), np.array(b.astype(dtype)), a.bits,
                                    a.group)
            for _ in range(50):
                m.matvec(x)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(300):
                    m.matvec(x)
                best = min(best, (time.perf_counter() - t0) / 300)
            print(f"{n}x{k} {a.bits}-bit group {a.group}, scales {dtype}: {best * 1e6:.0f} us, "
                  f"{n * k / best / 1e9:.1f} GMAC/s")


if __name__ == "__main__":
    main()

"""MLX's quantized matmul against float32 BLAS on this machine: why a quantized model's
resident weights are dequantized on the CPU by default (models/quantized.py).

    .venv/bin/python benchmarks/cpu-kernels/bench_qmm.py [--out 4096] [--in 4096] [--bits 4] [--group 64]

For 1, 8 and 64 tokens: mean ms of mx.quantized_matmul (weights at --bits, group --group)
and of x @ W.T in float32 (OpenBLAS, as mlx_flash sets it up), 20 calls after 2 warm-ups.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx_flash  # noqa: E402,F401  (OpenBLAS before MLX)
import mlx.core as mx  # noqa: E402


def ms(fn, n=20):
    for _ in range(2):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t0) / n * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=int, default=4096)
    ap.add_argument("--in", dest="n_in", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    a = ap.parse_args()
    w = mx.random.normal((a.out, a.n_in)) * 0.02
    wq, s, b = mx.quantize(w, group_size=a.group, bits=a.bits)
    mx.eval(w, wq, s, b)
    print(f"{a.out} x {a.n_in}, {a.bits}-bit group {a.group}; {mx.default_device()}")
    for m in (1, 8, 64):
        x = mx.random.normal((m, a.n_in))
        q = ms(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=a.group, bits=a.bits))
        f = ms(lambda: x @ w.T)
        print(f"  {m:3d} tokens: quantized {q:8.2f} ms   float32 {f:8.2f} ms   ratio {q / f:5.2f}")


if __name__ == "__main__":
    main()

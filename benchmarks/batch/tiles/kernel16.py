"""One batch step's products over a 16,384 x 4,096 float16 matrix at 16 positions: the pass kernels'
tiles (gather_mm: x @ W.T; gather_mm_cols: h @ W) at the AVX-512 (2) and AVX2 (1) levels, against
the float32 arena + BLAS a 16-bit batch step takes without them (rows only). Two matrices
alternating, 10 calls each after a warm-up, mean (output: kernel16.txt).
With `float32`: the same over float32 rows, the tiles at the top level against MLX's matmul
(BLAS) for x @ W.T and h @ W (output: kernel32.txt).

usage: .venv/bin/python benchmarks/batch/tiles/kernel16.py [float32]
"""
import sys
import time

import mlx_flash  # noqa: F401  (BLAS set-up before mlx)
import mlx.core as mx
import numpy as np
from mlx_flash.kernels import kernels_module

K, _ = kernels_module()
f32 = "float32" in sys.argv[1:]
code, dtype = (0, np.float32) if f32 else (1, np.float16)
rng = np.random.default_rng(0)
n, d, P = 16384, 4096, 16
ws = [(rng.standard_normal((n, d)) * 0.02).astype(dtype) for _ in range(2)]
sel = np.arange(n, dtype=np.int64)
x = rng.standard_normal((P, d)).astype(np.float32)
h = rng.standard_normal((P, n)).astype(np.float32)
y, y2 = np.empty((P, n), np.float32), np.empty((P, d), np.float32)


def t(f, reps=10):
    f(0)
    a = time.perf_counter()
    for i in range(reps):
        f(i)
    return (time.perf_counter() - a) / reps * 1e3


def tiles():
    tr = t(lambda i: K.gather_mm(x, ws[i % 2], sel, y, d, False, code))
    tc = t(lambda i: K.gather_mm_cols(h, ws[i % 2], sel, y2, d, False, code))
    return tr, tc


if f32:
    tr, tc = tiles()
    wm, xm, hm = [mx.array(w) for w in ws], mx.array(x), mx.array(h)
    tb = t(lambda i: mx.eval(xm @ wm[i % 2].T))
    tbc = t(lambda i: mx.eval(hm @ wm[i % 2]))
    print(f"f32 tiles rows {tr:.1f} cols {tc:.1f} ms; MLX/BLAS rows {tb:.1f} cols {tbc:.1f} ms")
    sys.exit()
for lvl in (2, 1):
    K.simd(lvl)
    tr, tc = tiles()
    gb = n * d * 2 / 1e9
    print(f"simd {lvl}: rows {tr:.1f} ms ({gb / tr * 1e3:.2f} GB/s, {n * d * P / tr / 1e6:.1f} G MAC/s) "
          f"cols {tc:.1f} ms ({n * d * P / tc / 1e6:.1f} G MAC/s)")
K.simd(2)
from mlx_flash.models.half import Arena, chunked_matmul  # noqa: E402

ar, xm = Arena(), mx.array(x)


def blas(i):
    w = ws[i % 2]
    mx.eval(chunked_matmul(xm, n, d, lambda a, b, out: ar.convert(w[a:b], 1, out, 0, out.size), ar))


print(f"arena+BLAS rows {t(blas):.1f} ms")

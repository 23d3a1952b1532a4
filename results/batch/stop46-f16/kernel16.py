"""One batch step's products over a 16,384 x 4,096 float16 matrix at 16 positions: the pass kernels'
tiles (gather_mm: x @ W.T; gather_mm_cols: h @ W) at the AVX-512 (2) and AVX2 (1) levels, against
the float32 arena + BLAS a 16-bit batch step took before stop 46 (rows only). Two matrices
alternating, 10 calls each after a warm-up, mean.

usage: .venv/bin/python results/batch/stop46-f16/kernel16.py
"""
import mlx_flash, numpy as np, time, mlx.core as mx
from mlx_flash.kernels import kernels_module
K, _ = kernels_module()
rng = np.random.default_rng(0)
n, d, P = 16384, 4096, 16
ws = [(rng.standard_normal((n, d)) * 0.02).astype(np.float16) for _ in range(2)]
sel = np.arange(n, dtype=np.int64)
x = rng.standard_normal((P, d)).astype(np.float32); h = rng.standard_normal((P, n)).astype(np.float32)
y = np.empty((P, n), np.float32); y2 = np.empty((P, d), np.float32)
def t(f, reps=10):
    f(); a = time.perf_counter()
    for i in range(reps): f(i)
    return (time.perf_counter() - a) / reps * 1e3
for lvl in (2, 1):
    K.simd(lvl)
    tr = t(lambda i=0: K.gather_mm(x, ws[i % 2], sel, y, d, False, 1))
    tc = t(lambda i=0: K.gather_mm_cols(h, ws[i % 2], sel, y2, d, False, 1))
    gb = n * d * 2 / 1e9
    print(f"simd {lvl}: rows {tr:.1f} ms ({gb/tr*1e3:.2f} GB/s, {n*d*P/tr/1e6:.1f} G MAC/s) cols {tc:.1f} ms ({n*d*P/tc/1e6:.1f} G MAC/s)")
# BLAS via arena-like conversion
from mlx_flash.models.half import Arena, chunked_matmul
ar = Arena()
xm = mx.array(x)
def blas(i=0):
    w = ws[i % 2]
    mx.eval(chunked_matmul(xm, n, d, lambda a, b, out: ar.convert(w[a:b], 1, out, 0, out.size), ar))
print(f"arena+BLAS rows {t(blas):.1f} ms")

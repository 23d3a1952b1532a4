"""The same at float32 (16,384 x 4,096, 16 positions): the tiles (gather_mm, gather_mm_cols with
float32 rows) against MLX's matmul (BLAS) for x @ W.T and h @ W.

usage: .venv/bin/python results/batch/stop46-f16/kernel32.py
"""
import mlx_flash, numpy as np, time, mlx.core as mx
from mlx_flash.kernels import kernels_module
K, _ = kernels_module()
rng = np.random.default_rng(0)
n, d, P = 16384, 4096, 16
ws = [(rng.standard_normal((n, d)) * 0.02).astype(np.float32) for _ in range(2)]
sel = np.arange(n, dtype=np.int64)
x = rng.standard_normal((P, d)).astype(np.float32); h = rng.standard_normal((P, n)).astype(np.float32)
y = np.empty((P, n), np.float32); y2 = np.empty((P, d), np.float32)
def t(f, reps=10):
    f(); a = time.perf_counter()
    for i in range(reps): f(i)
    return (time.perf_counter() - a) / reps * 1e3
tr = t(lambda i=0: K.gather_mm(x, ws[i % 2], sel, y, d, False, 0))
tc = t(lambda i=0: K.gather_mm_cols(h, ws[i % 2], sel, y2, d, False, 0))
wm = [mx.array(w) for w in ws]; xm = mx.array(x); hm = mx.array(h)
tb = t(lambda i=0: mx.eval(xm @ wm[i % 2].T)); tbc = t(lambda i=0: mx.eval(hm @ wm[i % 2]))
print(f"f32 tiles rows {tr:.1f} cols {tc:.1f} ms; MLX/BLAS rows {tb:.1f} cols {tbc:.1f} ms")

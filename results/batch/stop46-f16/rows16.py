"""One position over a 16,384 x 4,096 float16 matrix: gather_mv (x @ W.T: an FFN's up / gate rows,
HalfLinear) against gather_axpy (h @ W: its down rows), the two kernels a held float16 FFN
runs, four matrices cycled, mean of 12 calls: why an FFN's held rows (float16-rows) have a rate
of their own in the profile.

usage: .venv/bin/python results/batch/stop46-f16/rows16.py
"""
import mlx_flash, numpy as np, time
from mlx_flash.kernels import kernels_module, gather_mv, gather_axpy
K, _ = kernels_module()
rng = np.random.default_rng(0)
n, d = 16384, 4096
ws = [(rng.standard_normal((n, d)) * 0.02).astype(np.float16) for _ in range(4)]
sel = np.arange(n, dtype=np.int64); x = rng.standard_normal(d).astype(np.float32); h = rng.standard_normal(n).astype(np.float32)
def t(f, reps=12):
    f(0); a = time.perf_counter()
    for i in range(reps): f(i)
    return (time.perf_counter() - a) / reps
tm = t(lambda i: gather_mv(K, x, ws[i % 4], sel)); ta = t(lambda i: gather_axpy(K, h, ws[i % 4], sel))
gb = n * d * 2 / 1e9
print(f"gather_mv {tm*1e3:.1f} ms ({gb/tm:.1f} GB/s)  gather_axpy {ta*1e3:.1f} ms ({gb/ta:.1f} GB/s)")

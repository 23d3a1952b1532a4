"""A batch step's 4-bit products, each kernel alone (stop 47): 16,384 x 4,096 4-bit weights (group
64) times 16 positions through qmm (a resident matrix: attention, head), qmm_rows (an FFN's gate /
up rows with inline scales) and qmm_cols (its down columns with the layer's scale table), 2 layers
alternating (cold in cache, as in a step), best of 5 rounds of 6 calls: ms and G multiply-adds/s.

usage: .venv/bin/python results/batch/stop47/split16.py
"""
import time
import mlx_flash
import numpy as np
import mlx.core as mx
from mlx_flash.bench.profile import ffn_rows
from mlx_flash.kernels import QuantMatrix, kernels_module, qmm_cols, qmm_rows

K, _ = kernels_module()
n, d, pos = 16384, 4096, 16
f = ffn_rows(n, d, 4, 2)
off = f.spec.inline_offsets(d)
x = np.random.default_rng(1).standard_normal((pos, d)).astype(np.float32)
h = np.random.default_rng(2).standard_normal((pos, n)).astype(np.float32)
mats = []
for i in range(2):
    wq, s, b = mx.quantize(mx.random.normal((n, d), key=mx.random.key(i)) * 0.02, group_size=64, bits=4)
    mats.append(QuantMatrix(K, wq, s.astype(mx.float16), b.astype(mx.float16), 4, 64))
cases = {
    "qmm (resident matrix)": lambda i: mats[i % 2].matmul(x),
    "qmm_rows (FFN rows)": lambda i: qmm_rows(K, x, f.layers[i % 2][0], f.sel, f.spec, *off),
    "qmm_cols (FFN columns)": lambda i: qmm_cols(K, h, f.layers[i % 2][1], f.sel, f.trow, f.table, f.spec),
}
best = {k: 1e9 for k in cases}
for r in range(5):
    for k, fn in cases.items():
        fn(0)
        t = time.perf_counter()
        for i in range(6): fn(i)
        best[k] = min(best[k], (time.perf_counter() - t) / 6)
print(f"{K.threads()} threads, simd level {K.simd(-1)}, pinning {K.pinning()}")
for k, s in best.items():
    print(f"{k:24s} {s * 1e3:7.2f} ms  {n * d * pos / s / 1e9:6.1f} G multiply-adds/s")

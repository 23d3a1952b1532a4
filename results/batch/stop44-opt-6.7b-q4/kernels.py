"""The pass kernels (qmm_rows, qmm_cols) on 4-bit rows of a 7B FFN layer's width, 16 and 32 positions, at
1 or 2 threads (MLX_FLASH_KERNEL_THREADS): best of 30 calls; the extra 16 positions' time is the
multiply-adds, the rest the dequantization. Stop 44.

usage: MLX_FLASH_KERNEL_THREADS=1 .venv/bin/python results/batch/stop44-opt-6.7b-q4/kernels.py [rows, default 1024]
"""
import mlx_flash, time, numpy as np, sys
from mlx_flash.kernels import kernels_module, qmm_rows, qmm_cols
from mlx_flash.layout.quant import QuantSpec
K, _ = kernels_module()
rng = np.random.default_rng(0)
bits, d, n = 4, 4096, int(sys.argv[1]) if len(sys.argv) > 1 else 1024
spec = QuantSpec(bits, 32, "float16")
rb = d * bits // 8; soff, boff = rb, rb + 2 * d // 32
buf = rng.integers(0, 256, (n, boff + 2 * d // 32), dtype=np.uint8)
buf[:, soff:] = (rng.standard_normal((n, 2 * d // 32)) * 0.1).astype(np.float16).view(np.uint8).reshape(n, -1)
tables = tuple((rng.standard_normal((n // 32, d)) * 0.1).astype(np.float16) for _ in range(2))
cbuf = rng.integers(0, 256, (n, d * bits // 8), dtype=np.uint8)
sel = np.arange(n); trow = sel // 32
def t(f, reps=30):
    f(); best = 1e9
    for _ in range(reps):
        a = time.perf_counter(); f(); best = min(best, time.perf_counter() - a)
    return best
for P in (16, 32):
    x = rng.standard_normal((P, d)).astype(np.float32); h = rng.standard_normal((P, n)).astype(np.float32)
    tr = t(lambda: qmm_rows(K, x, buf, sel, spec, soff, boff)); tc = t(lambda: qmm_cols(K, h, cbuf, sel, trow, tables, spec))
    print(f"n={n} P={P} rows {tr*1e3:.2f} ms {P*n*d/tr/1e9:.1f} GMAC/s | cols {tc*1e3:.2f} ms {P*n*d/tc/1e9:.1f} GMAC/s")

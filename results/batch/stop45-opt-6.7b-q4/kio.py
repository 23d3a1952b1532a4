"""Mean ms of a pass kernel call (qmm_rows, qmm_cols) on 16384 rows of 4096 4-bit values at 16 positions,
60 calls each after one warm-up: the A/B of stop 45 for the pass kernels' thread shares (static halves,
as kept, against pieces taken in turn: a variant of _matvec.c's share() tried and reverted: qmm_cols
22.2 / 22.9 ms against 17.0 / 16.6 static, quiet), and for the cost of reads landing meanwhile (run it
while `dd iflag=direct` reads the checkpoint's FFN files: static rows 18.4-19.2 / cols 20.2-20.4 ms).
The argument is a label printed with the line.

usage: .venv/bin/python results/batch/stop45-opt-6.7b-q4/kio.py [label]
"""
import mlx_flash, time, numpy as np, sys
from mlx_flash.kernels import kernels_module, qmm_rows, qmm_cols
from mlx_flash.layout.quant import QuantSpec
K, _ = kernels_module()
rng = np.random.default_rng(0)
bits, d, n = 4, 4096, 16384
spec = QuantSpec(bits, 32, "float16")
rb = d * bits // 8; soff, boff = rb, rb + 2 * d // 32
buf = rng.integers(0, 256, (n, boff + 2 * d // 32), dtype=np.uint8)
buf[:, soff:] = (rng.standard_normal((n, 2 * d // 32)) * 0.1).astype(np.float16).view(np.uint8).reshape(n, -1)
tables = tuple((rng.standard_normal((n // 32, d)) * 0.1).astype(np.float16) for _ in range(2))
cbuf = rng.integers(0, 256, (n, d * bits // 8), dtype=np.uint8)
P=16
x = rng.standard_normal((P, d)).astype(np.float32); h = rng.standard_normal((P, n)).astype(np.float32)
def t(f, reps=60):
    f(); a = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - a) / reps
tr = t(lambda: qmm_rows(K, x, buf, np.arange(n), spec, soff, boff))
tc = t(lambda: qmm_cols(K, h, cbuf, np.arange(n), np.arange(n)//32, tables, spec))
print(f"{sys.argv[1] if len(sys.argv)>1 else ''} mean rows {tr*1e3:.2f} ms | cols {tc*1e3:.2f} ms")

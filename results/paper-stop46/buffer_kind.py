"""Why naive's compute runs slower than dense's (stop 46, not found): the FFN row kernels of one token
over 4 layers of 16,384 x 4,096 4-bit rows held in memory of each kind the runtime uses (NumPy,
an anonymous mmap as the reader's stage, the same with MADV_HUGEPAGE, an MLX array): the same
rate in all (transparent huge pages are `madvise` here and none were granted).

usage: .venv/bin/python results/paper-stop46/buffer_kind.py
"""
import mlx_flash, mmap, time, numpy as np, mlx.core as mx
from mlx_flash.bench.profile import ffn_rows
from mlx_flash.kernels import kernels_module, qmv_rows, qaxpy_cols
K, _ = kernels_module()
n, d = 16384, 4096
f = ffn_rows(n, d, 4, 4)
offsets = f.spec.inline_offsets(d)
def copy_to(kind, a):
    if kind == "numpy": b = np.empty_like(a)
    elif kind == "mmap":
        mm = mmap.mmap(-1, a.nbytes); b = np.frombuffer(mm, dtype=a.dtype).reshape(a.shape)
    elif kind == "mmap+thp":
        mm = mmap.mmap(-1, a.nbytes); mm.madvise(mmap.MADV_HUGEPAGE); b = np.frombuffer(mm, dtype=a.dtype).reshape(a.shape)
    else:
        m = mx.zeros((a.size,), dtype=mx.uint8); mx.eval(m); b = np.array(m, copy=False).reshape(a.shape)
    b[...] = a
    return b
for kind in ("numpy", "mmap", "mmap+thp", "mlx", "numpy", "mmap"):
    layers = [(copy_to(kind, u), copy_to(kind, dn)) for u, dn in f.layers]
    def step(i):
        up, down = layers[i % 4]
        h = qmv_rows(K, f.x, up, f.sel, f.spec, *offsets)
        qaxpy_cols(K, h, down, f.sel, f.trow, f.table, f.spec)
    for i in range(4): step(i)
    t = time.perf_counter()
    for i in range(20): step(i)
    dt = (time.perf_counter() - t) / 20
    nb = sum(a.nbytes for a in layers[0])
    print(f"{kind:9s} {dt*1e3:.1f} ms a layer ({nb/dt/1e9:.1f} GB/s)")

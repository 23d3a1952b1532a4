"""Why naive's compute runs slower than dense's (stop 47): the one-token FFN row kernels of one
layer (16,384 x 4,096 4-bit rows held in memory, as buffer_kind.py) timed right after each of:
nothing, a sleep, an uncached read of 75 MB of a file (the reader, 256 KiB reads, as naive's
layer), the next 75 MB of the file in order, uncached; a buffered read of the same bytes from the page cache. Alternating, 12 rounds, medians.

usage: .venv/bin/python results/naive-stop47/after_reads.py FILE
"""
import sys, time, statistics, numpy as np
import mlx_flash
from mlx_flash.bench.profile import ffn_rows
from mlx_flash.io import FlashReader
from mlx_flash.kernels import kernels_module, qmv_rows, qaxpy_cols

K, _ = kernels_module()
n, d = 16384, 4096
f = ffn_rows(n, d, 4, 4)
offsets = f.spec.inline_offsets(d)
def step(i):
    up, down = f.layers[i % 4]
    h = qmv_rows(K, f.x, up, f.sel, f.spec, *offsets)
    qaxpy_cols(K, h, down, f.sel, f.trow, f.table, f.spec)
chunk, nbytes = 256 * 1024, 75 * 1024 * 1024
rng = np.random.default_rng(0)
with FlashReader(direct=True, coalesce_gap=-1) as r, FlashReader(direct=False, coalesce_gap=-1) as rb:
    fh, fb = r.open(sys.argv[1]), rb.open(sys.argv[1])
    hot = np.arange(nbytes // chunk) * chunk  # the buffered reads' bytes (in the page cache after round 1)
    def uncached(): r.read_discard(fh, rng.integers(0, fh.size // chunk, nbytes // chunk) * chunk, np.full(nbytes // chunk, chunk))
    def buffered(): rb.read_discard(fb, hot, np.full(hot.size, chunk))
    at = [0]
    def sequential():  # the next 75 MB of the file, in order (as naive reads a layer's file)
        if at[0] + nbytes > fh.size: at[0] = 0
        r.read_discard(fh, at[0] + np.arange(nbytes // chunk) * chunk, np.full(nbytes // chunk, chunk))
        at[0] += nbytes
    t = time.perf_counter(); uncached(); read_s = time.perf_counter() - t
    acts = {"nothing": lambda: None, "sleep": lambda: time.sleep(read_s), "uncached read": uncached, "sequential uncached read": sequential,
            "buffered read": buffered}
    for i in range(4): step(i); buffered()
    got = {k: [] for k in acts}
    for rnd in range(12):
        for k, a in acts.items():
            a()
            t = time.perf_counter(); step(rnd); got[k].append(time.perf_counter() - t)
            t = time.perf_counter(); step(rnd + 1); got[k + " (2nd layer)"] = got.get(k + " (2nd layer)", []) + [time.perf_counter() - t]
    print(f"an uncached read of 75 MB: {read_s*1e3:.0f} ms")
    for k, v in got.items():
        print(f"after {k:28s} {statistics.median(v)*1e3:6.2f} ms a layer (min {min(v)*1e3:.2f}, max {max(v)*1e3:.2f})")

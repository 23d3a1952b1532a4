"""The prototype of the profile's read_steal (bench/profile.py): a batch step's FFN compute (qmm_rows
+ qmm_cols, 16,384 x 4,096 at 4 bits, 16 positions) timed alone and while a FlashReader streams
the profile's probe file uncached (256 KiB reads, 64 at a time, in a Python thread), 3 rounds
of 2 s each way: seconds of compute lost a GB read. `crc`: each read also checked in that
Python thread (a copy and a CRC32C there: heavier than the reader's own checks in C).

usage: .venv/bin/python results/batch/stop46-opt-6.7b-q4/interference.py [crc]
"""
import mlx_flash, time, threading, numpy as np, sys
from mlx_flash.kernels import kernels_module, qmm_rows, qmm_cols
from mlx_flash.layout.quant import QuantSpec
from mlx_flash.io import FlashReader
from mlx_flash.bench.profile import probe_file, LAYER_READS
from mlx_flash.io.checksum import crc32c
K, _ = kernels_module()
rng = np.random.default_rng(0)
bits, d, n, P = 4, 4096, 16384, 16
spec = QuantSpec(bits, 64, "float16")
rb = d * bits // 8; soff, boff = rb, rb + 2 * d // 64
mats = []
for i in range(3):
    buf = rng.integers(0, 256, (n, boff + 2 * d // 64), dtype=np.uint8)
    buf[:, soff:] = (rng.standard_normal((n, 2 * d // 64)) * 0.1).astype(np.float16).view(np.uint8).reshape(n, -1)
    cbuf = rng.integers(0, 256, (n, d * bits // 8), dtype=np.uint8)
    mats.append((buf, cbuf))
tables = tuple((rng.standard_normal((n // 64, d)) * 0.1).astype(np.float16) for _ in range(2))
x = rng.standard_normal((P, d)).astype(np.float32)
sel = np.arange(n); trow = sel // 64
def work(seconds):
    t0 = time.perf_counter(); calls = 0
    while time.perf_counter() - t0 < seconds:
        buf, cbuf = mats[calls % 3]
        h = qmm_rows(K, x, buf, sel, spec, soff, boff)
        qmm_cols(K, h, cbuf, sel, trow, tables, spec)
        calls += 1
    return (time.perf_counter() - t0) / calls
stop = threading.Event(); got = [0]
crc = "crc" in sys.argv
def reader():
    f0 = probe_file()
    with FlashReader(threads=32, direct=True, coalesce_gap=-1) as r:
        f = r.open(f0); c = 256 << 10
        while not stop.is_set():
            offs = rng.integers(0, f.size // c, 64) * c
            if crc:
                out = r.read(f, offs, np.full(offs.size, c))
                for o in out: crc32c(o.tobytes() if hasattr(o, "tobytes") else bytes(o))
            else:
                r.read_discard(f, offs, np.full(offs.size, c))
            got[0] += offs.size * c
work(0.5)
res = []
for rnd in range(3):
    alone = work(2.0)
    got[0] = 0; stop.clear(); t = threading.Thread(target=reader); t.start()
    time.sleep(0.1); g0 = got[0]; t0 = time.perf_counter()
    busy = work(2.0)
    dt = time.perf_counter() - t0; g1 = got[0]
    stop.set(); t.join()
    gbs = (g1 - g0) / dt / 1e9
    lost_per_gb = (busy - alone) / alone * dt / ((g1 - g0) / 1e9)   # seconds of compute lost per GB read
    res.append(lost_per_gb)
    print(f"round {rnd}: alone {alone*1e3:.1f} ms, with reads {busy*1e3:.1f} ms ({gbs:.2f} GB/s read): {lost_per_gb:.3f} s lost per GB", flush=True)
print("median", np.median(res))

"""The pinning's cost under outside load (stop 47): a 16,384 x 4,096 4-bit product (qmv, one
position) on the pool's two threads, workers pinned or free (set_pinning), alone and beside a
process that spins on one CPU (a busy loop, unpinned: the scheduler places it), alternating,
5 rounds of 1 s each, medians; one thread alone for reference.

usage: .venv/bin/python results/naive-stop47/under_load.py
"""
import statistics, subprocess, sys, time
import mlx_flash
import numpy as np
import mlx.core as mx
from mlx_flash.kernels import QuantMatrix, kernels_module

K, _ = kernels_module()
wq, s, b = mx.quantize(mx.random.normal((16384, 4096), key=mx.random.key(0)) * 0.02, group_size=64, bits=4)
q = QuantMatrix(K, wq, s.astype(mx.float16), b.astype(mx.float16), 4, 64)
x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)

def per_call(seconds=1.0):
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        q.matvec(x); n += 1
    return (time.perf_counter() - t0) / n * 1e3

got = {}
for rnd in range(5):
    for load in (False, True):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load else None
        time.sleep(0.2 if load else 0)
        try:
            for pin, threads in ((True, 2), (False, 2), (None, 1)):
                K.set_threads(threads)
                if pin is not None:
                    K.set_pinning(pin)
                q.matvec(x)
                got.setdefault((load, pin, threads), []).append(per_call())
        finally:
            if hog: hog.kill(); hog.wait()
K.set_threads(2); K.set_pinning(True)
for (load, pin, threads), v in got.items():
    who = "one thread" if threads == 1 else f"two threads, {'pinned' if pin else 'free'}"
    print(f"{'beside a busy process' if load else 'alone':22s} {who:22s} {statistics.median(v):6.2f} ms a product "
          f"(rounds {', '.join(f'{t:.2f}' for t in v)})")

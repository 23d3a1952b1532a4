"""gather_mm_cols of two builds of _matvec.c in one process, alternating, 4 rounds of 10 calls
(16,384 x 4,096, 16 positions, AVX-512, two threads): the re-read's mend (41e1db4: one values_f32
for the scales and the rows) against the code before it (0680046). Build each first:

  git show 0680046:mlx_flash/kernels/_matvec.c > /tmp/old/_matvec.c   (and the headers beside it)
  gcc -O3 -ffp-contract=off -shared -fPIC -pthread -I<python include> /tmp/old/_matvec.c -o /tmp/old/_matvec<EXT_SUFFIX>
  (the same for /tmp/new from the working tree)

usage: .venv/bin/python results/batch/stop46-f16/ab_builds.py
"""
import sys, importlib.util, time, numpy as np
import mlx_flash
def load(p):
    spec = importlib.util.spec_from_file_location("_matvec", p); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
import glob
mods = {v: load(glob.glob(f"/tmp/{v}/_matvec*.so")[0]) for v in ("old", "new")}
for m in mods.values(): m.set_threads(2); m.simd(2)
rng = np.random.default_rng(0); n, d, P = 16384, 4096, 16
for code, dt in ((1, np.float16), (0, np.float32)):
    ws = [(rng.standard_normal((n, d)) * 0.02).astype(dt) for _ in range(2)]
    sel = np.arange(n, dtype=np.int64); h = rng.standard_normal((P, n)).astype(np.float32); y2 = np.empty((P, d), np.float32)
    res = {v: [] for v in mods}
    for r in range(4):
        for v, K in (mods.items() if r % 2 == 0 else reversed(list(mods.items()))):
            K.gather_mm_cols(h, ws[0], sel, y2, d, False, code)
            a = time.perf_counter()
            for i in range(10): K.gather_mm_cols(h, ws[i % 2], sel, y2, d, False, code)
            res[v].append((time.perf_counter() - a) * 100)
    print(code, {v: [round(x, 1) for x in t] for v, t in res.items()})

"""A job's parts taken from a counter (stop 48) against the fixed shares before it: the kernels'
products on the pool's threads, alone and beside a process that spins on one CPU (a busy loop,
unpinned: the scheduler places it).

Variants, each in its own process (the same data, built from fixed seeds): the fixed shares of
the kernels built from commit 6cd7761 (--old-so, a _matvec .so built from that commit), this
build with 1, 2, 4 and 8 parts a thread (set_parts: jobs over rows; a job over columns is cut
into one part a thread, split-columns-cut.txt shows why), and one thread alone. Rounds alternate the
load and flip the variants' order; each kernel is timed for ~0.4 s a variant and round (the
mean call), the table gives the median of the rounds, ms a call.

Kernels (4 bits, group 64, weights cold in cache where a step has them so: 2 matrices alternate):
  qmv 16384x4096 (a resident matrix, one position), qmv 768x2048 (an expert: the smallest shared
  job), qmv_rows / qaxpy_cols (an FFN's 16,384 rows / columns of width 4,096: naive's FFN),
  qmm / qmm_rows / qmm_cols (the same at 16 positions: a batch's step), gather_mv / gather_axpy
  (8,192 float32 rows of 4,096: a hybrid's cache), gather_mm (float16, 16 positions).

usage: .venv/bin/python results/split-stop48/split.py --old-so DIR/_matvec.cpython-311-x86_64-linux-gnu.so [--rounds 3]
"""
import argparse, importlib.util, json, statistics, subprocess, sys, time

KERNELS = ("qmv", "qmv small", "qmv_rows", "qaxpy_cols", "qmm", "qmm_rows", "qmm_cols", "gather_mv", "gather_axpy",
           "gather_mm f16")


def child(so, parts, threads):
    if so:  # the older build in place of this one's (before mlx_flash.kernels loads it)
        spec = importlib.util.spec_from_file_location("mlx_flash.kernels._matvec", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["mlx_flash.kernels._matvec"] = mod
    import mlx_flash
    import numpy as np
    import mlx.core as mx
    from mlx_flash.bench.profile import ffn_rows
    from mlx_flash.kernels import (QuantMatrix, gather_axpy, gather_mm, gather_mv, kernels_module, qaxpy_cols,
                                   qmm_cols, qmm_rows, qmv_rows)
    K, _ = kernels_module()
    K.set_threads(threads)
    if parts:
        K.set_parts(parts)
    n, d, pos = 16384, 4096, 16
    f = ffn_rows(n, d, 4, 2)
    off = f.spec.inline_offsets(d)
    rng = np.random.default_rng(1)
    x1 = rng.standard_normal(d).astype(np.float32)
    x = rng.standard_normal((pos, d)).astype(np.float32)
    h1 = rng.standard_normal(n).astype(np.float32)
    h = rng.standard_normal((pos, n)).astype(np.float32)

    def quant(shape, i):
        wq, s, b = mx.quantize(mx.random.normal(shape, key=mx.random.key(i)) * 0.02, group_size=64, bits=4)
        return QuantMatrix(K, wq, s.astype(mx.float16), b.astype(mx.float16), 4, 64)
    mats = [quant((n, d), i) for i in range(2)]
    small = [quant((768, 2048), i) for i in range(2)]
    xs = rng.standard_normal(2048).astype(np.float32)
    w32 = [rng.standard_normal((8192, d)).astype(np.float32) for _ in range(2)]
    w16 = [w.astype(np.float16) for w in w32]
    sel = np.arange(8192, dtype=np.int64)
    hs = rng.standard_normal(8192).astype(np.float32)
    cases = {
        "qmv": lambda i: mats[i % 2].matvec(x1),
        "qmv small": lambda i: small[i % 2].matvec(xs),
        "qmv_rows": lambda i: qmv_rows(K, x1, f.layers[i % 2][0], f.sel, f.spec, *off),
        "qaxpy_cols": lambda i: qaxpy_cols(K, h1, f.layers[i % 2][1], f.sel, f.trow, f.table, f.spec),
        "qmm": lambda i: mats[i % 2].matmul(x),
        "qmm_rows": lambda i: qmm_rows(K, x, f.layers[i % 2][0], f.sel, f.spec, *off),
        "qmm_cols": lambda i: qmm_cols(K, h, f.layers[i % 2][1], f.sel, f.trow, f.table, f.spec),
        "gather_mv": lambda i: gather_mv(K, x1, w32[i % 2], sel),
        "gather_axpy": lambda i: gather_axpy(K, hs, w32[i % 2], sel),
        "gather_mm f16": lambda i: gather_mm(K, x, w16[i % 2], sel),
    }
    out = {}
    for name in KERNELS:
        fn = cases[name]
        fn(0), fn(1)
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.4:
            fn(calls)
            calls += 1
        out[name] = (time.perf_counter() - t0) / calls * 1e3
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-so", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        so, parts, threads = a.child
        return child(so if so != "-" else None, int(parts), int(threads))
    variants = {"fixed shares (6cd7761)": (a.old_so, 0, 2), "1 part a thread": ("-", 1, 2),
                "2 parts a thread": ("-", 2, 2), "4 parts a thread": ("-", 4, 2), "8 parts a thread": ("-", 8, 2),
                "one thread": ("-", 0, 1)}
    got = {}
    for rnd in range(a.rounds):
        for load in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load else None
            try:
                order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
                for v in order:
                    so, parts, threads = variants[v]
                    res = subprocess.run([sys.executable, __file__, "--old-so", a.old_so, "--child", so, str(parts),
                                          str(threads)], capture_output=True, text=True, check=True)
                    for k, ms in json.loads(res.stdout.strip().splitlines()[-1]).items():
                        got.setdefault((load, v, k), []).append(ms)
            finally:
                if hog:
                    hog.kill(), hog.wait()
    for load in (False, True):
        print(f"\n{'beside a busy process' if load else 'alone'}: ms a call, median of {a.rounds} rounds")
        print(f"{'':24s}" + "".join(f"{k:>14s}" for k in KERNELS))
        for v in variants:
            print(f"{v:24s}" + "".join(f"{statistics.median(got[(load, v, k)]):14.3f}" for k in KERNELS))


if __name__ == "__main__":
    main()

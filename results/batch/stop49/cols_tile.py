"""qmm_cols (a batch step's FFN down columns, 4 bits, group 64) before and after stop 49's change to
its tile's dequantization: the columns of one table row (a group of 64 neurons: every block of
MM16_KBLOCK = 64) take their scales and biases loaded and converted once a block instead of once a
column. The values are the same bits (tests/test_kernels.py).

Variants, each in its own process, alternating over rounds (order flipped each round): the kernels
built from the commit before (--old-so) and this build, at the AVX-512 level (2) and the AVX2
level (1: MLX_FLASH_KERNEL_SIMD=avx2), on 1 and 2 threads. 16,384 columns of width 4,096 times 16
positions, 2 layers alternating (cold in cache, as in a step); each variant times ~0.5 s of calls
a round, the mean call; the table gives each variant's median over the rounds, ms a call.

usage: .venv/bin/python results/batch/stop49/cols_tile.py --old-so DIR/_matvec.cpython-311-x86_64-linux-gnu.so [--rounds 3]
"""
import argparse, importlib.util, os, statistics, subprocess, sys, time


def child(so):
    if so:  # the older build in place of this one's (before mlx_flash.kernels loads it)
        spec = importlib.util.spec_from_file_location("mlx_flash.kernels._matvec", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["mlx_flash.kernels._matvec"] = mod
    import mlx_flash
    import numpy as np
    from mlx_flash.bench.profile import ffn_rows
    from mlx_flash.kernels import kernels_module, qmm_cols

    K, _ = kernels_module()
    n, d, pos = 16384, 4096, 16
    f = ffn_rows(n, d, 4, 2)
    h = np.random.default_rng(2).standard_normal((pos, n)).astype(np.float32)
    fn = lambda i: qmm_cols(K, h, f.layers[i % 2][1], f.sel, f.trow, f.table, f.spec)
    fn(0)
    calls, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.5:
        fn(calls)
        calls += 1
    ms = (time.perf_counter() - t) / calls * 1e3
    print(f"RESULT {ms:.3f} {K.threads()} {K.simd(-1)} {n * d * pos / ms / 1e6:.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-so", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child)
    variants = [(build, simd, threads) for build in ("old", "new") for simd in ("avx512", "avx2") for threads in (1, 2)]
    times = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            build, simd, threads = v
            env = dict(os.environ, MLX_FLASH_KERNEL_THREADS=str(threads))
            if simd == "avx2":
                env["MLX_FLASH_KERNEL_SIMD"] = "avx2"
            out = subprocess.run([sys.executable, __file__, "--old-so", a.old_so,
                                  "--child", a.old_so if build == "old" else ""], env=env, capture_output=True,
                                 text=True, check=True).stdout
            ms, th, level, rate = [line for line in out.splitlines() if line.startswith("RESULT")][0].split()[1:]
            assert int(th) == threads, out
            times[v].append(float(ms))
        print(f"round {r + 1} done", file=sys.stderr)
    print(f"qmm_cols 16384 x 4096, 4 bits, 16 positions; {a.rounds} rounds, medians, ms a call (G multiply-adds/s)")
    print("| level | threads | before | after | before / after |")
    print("| --- | --- | --- | --- | --- |")
    for simd in ("avx512", "avx2"):
        for threads in (1, 2):
            old = statistics.median(times[("old", simd, threads)])
            new = statistics.median(times[("new", simd, threads)])
            g = 16384 * 4096 * 16 / 1e6
            print(f"| {simd} | {threads} | {old:.2f} ({g / old:.1f}) | {new:.2f} ({g / new:.1f}) | {old / new:.3f} |")
    print("all rounds:", {f"{k[0]} {k[1]} {k[2]}": v for k, v in times.items()})


if __name__ == "__main__":
    main()

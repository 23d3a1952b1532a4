"""A batch step's 4-bit tile kernels before and after stop 49's two changes to their dequantization
(the values are the same bits: tests/test_kernels.py):
- qmm_cols (an FFN's down columns): the columns of one table row (a group of 64 neurons: every
  block of MM16_KBLOCK = 64) take their scales and biases loaded and converted once a block
  instead of once a column (AVX-512 and AVX2);
- qmm_rows (an FFN's gate / up rows) and qmm (a resident matrix: attention, the head) at the
  AVX-512 level: each group's 16 possible values made once (scale * q + bias), each weight
  picked from them by a permute instead of converted, multiplied and added.

Variants, each in its own process, alternating over rounds (order flipped each round): the kernels
built from the commit before (--old-so) and this build, at the AVX-512 level (2) and the AVX2
level (1: MLX_FLASH_KERNEL_SIMD=avx2), on 1 and 2 threads. 16,384 columns of width 4,096 times 16
positions, 2 layers alternating (cold in cache, as in a step); each variant times ~0.5 s of calls
a round, the mean call; the table gives each variant's median over the rounds, ms a call.

usage: .venv/bin/python results/batch/stop49/tiles_dequant.py --old-so DIR/_matvec.cpython-311-x86_64-linux-gnu.so [--rounds 3]
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
    import mlx.core as mx
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
    cases = {"qmm_cols": lambda i: qmm_cols(K, h, f.layers[i % 2][1], f.sel, f.trow, f.table, f.spec),
             "qmm_rows": lambda i: qmm_rows(K, x, f.layers[i % 2][0], f.sel, f.spec, *off),
             "qmm": lambda i: mats[i % 2].matmul(x)}
    for name, fn in cases.items():
        fn(0)
        calls, t = 0, time.perf_counter()
        while time.perf_counter() - t < 0.5:
            fn(calls)
            calls += 1
        ms = (time.perf_counter() - t) / calls * 1e3
        print(f"RESULT {name} {ms:.3f} {K.threads()} {K.simd(-1)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-so", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child)
    variants = [(build, simd, threads) for build in ("old", "new") for simd in ("avx512", "avx2") for threads in (1, 2)]
    times = {}
    for r in range(a.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            build, simd, threads = v
            env = dict(os.environ, MLX_FLASH_KERNEL_THREADS=str(threads))
            if simd == "avx2":
                env["MLX_FLASH_KERNEL_SIMD"] = "avx2"
            out = subprocess.run([sys.executable, __file__, "--old-so", a.old_so,
                                  "--child", a.old_so if build == "old" else ""], env=env, capture_output=True,
                                 text=True, check=True).stdout
            for line in out.splitlines():
                if line.startswith("RESULT"):
                    name, ms, th, level = line.split()[1:]
                    assert int(th) == threads, out
                    times.setdefault((name,) + v, []).append(float(ms))
        print(f"round {r + 1} done", file=sys.stderr)
    print(f"16384 x 4096, 4 bits (group 64, float16 scales), 16 positions; {a.rounds} rounds, medians, ms a call "
          "(G multiply-adds/s)")
    print("| kernel | level | threads | before | after | before / after |")
    print("| --- | --- | --- | --- | --- | --- |")
    g = 16384 * 4096 * 16 / 1e6
    for name in ("qmm_cols", "qmm_rows", "qmm"):
        for simd in ("avx512", "avx2"):
            for threads in (1, 2):
                old = statistics.median(times[(name, "old", simd, threads)])
                new = statistics.median(times[(name, "new", simd, threads)])
                print(f"| {name} | {simd} | {threads} | {old:.2f} ({g / old:.1f}) | {new:.2f} ({g / new:.1f}) | "
                      f"{old / new:.3f} |")
    print("all rounds:", {" ".join(map(str, k)): v for k, v in times.items()})


if __name__ == "__main__":
    main()

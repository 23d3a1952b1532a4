"""The one-position 4-bit product (qmv: a decode token's resident matrices, and the FFN rows of
dense / hybrid / naive) before and after stop 49's change: at the AVX-512 BF16 level the row's
scales and biases are read where they lie instead of converted, a call a row, into float32
scratch first (values_f32). The values are claimed the same bits: this checks it against the
kernels built from the commit before (--old-so), on float16, bfloat16 and float32 scales and
groups of 32, 64 and 128 (and a row length whose group count is not a multiple of 8), then
times a 16384 x 4096 matrix (QMV_SHAPE=NxK for another: 1536x576 is SmolLM2's FFN row matrix, in cache) (group 64, float16 scales; 2 matrices alternating) on
1 and 2 threads, each variant in its own process, rounds alternating, medians.

usage: .venv/bin/python results/qmv-stop49/qmv_scales.py --old-so DIR/_matvec.cpython-311-x86_64-linux-gnu.so [--rounds 5]
"""
import argparse, importlib.util, os, statistics, subprocess, sys, tempfile, time

CASES = [(n, k, g, dt) for (n, k, g) in ((512, 4096, 64), (300, 576, 64), (256, 2048, 32), (128, 4096, 128))
         for dt in ("float16", "bfloat16", "float32")]


def child(so, mode, out):
    if so:
        spec = importlib.util.spec_from_file_location("mlx_flash.kernels._matvec", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["mlx_flash.kernels._matvec"] = mod
    import mlx_flash
    import numpy as np
    import mlx.core as mx
    from mlx_flash.kernels import QuantMatrix, kernels_module

    K, _ = kernels_module()
    assert K.simd(-1) == 2, "needs the AVX-512 BF16 level"
    if mode == "values":
        ys = []
        for i, (n, k, g, dt) in enumerate(CASES):
            wq, s, b = mx.quantize(mx.random.normal((n, k), key=mx.random.key(i)) * 0.05, group_size=g, bits=4)
            q = QuantMatrix(K, wq, s.astype(getattr(mx, dt)), b.astype(getattr(mx, dt)), 4, g)
            x = np.random.default_rng(i).standard_normal(k).astype(np.float32)
            ys.append(q.matvec(x))
        np.savez(out, *ys)
        return
    n, k = (int(v) for v in os.environ.get("QMV_SHAPE", "16384x4096").split("x"))
    mats = []
    for i in range(2):
        wq, s, b = mx.quantize(mx.random.normal((n, k), key=mx.random.key(i)) * 0.02, group_size=64, bits=4)
        mats.append(QuantMatrix(K, wq, s.astype(mx.float16), b.astype(mx.float16), 4, 64))
    x = np.random.default_rng(0).standard_normal(k).astype(np.float32)
    mats[0].matvec(x)
    calls, t = 0, time.perf_counter()
    while time.perf_counter() - t < 0.5:
        mats[calls % 2].matvec(x)
        calls += 1
    print(f"RESULT {(time.perf_counter() - t) / calls * 1e3:.4f} {K.threads()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-so", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        so, mode, out = a.child
        return child(so if so != "-" else "", mode, out)
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        for build in ("old", "new"):
            subprocess.run([sys.executable, __file__, "--old-so", a.old_so, "--child",
                            a.old_so if build == "old" else "-", "values", f"{d}/{build}.npz"], check=True)
        old, new = np.load(f"{d}/old.npz"), np.load(f"{d}/new.npz")
        same = [np.array_equal(old[f], new[f]) for f in old.files]
    for (n, k, g, dt), eq in zip(CASES, same):
        print(f"values {n} x {k}, group {g}, {dt} scales: {'the same bits' if eq else 'DIFFERENT'}")
    times = {}
    for r in range(a.rounds):
        order = [(b, t) for b in ("old", "new") for t in (1, 2)]
        for build, threads in (order if r % 2 == 0 else order[::-1]):
            env = dict(os.environ, MLX_FLASH_KERNEL_THREADS=str(threads))
            out = subprocess.run([sys.executable, __file__, "--old-so", a.old_so, "--child",
                                  a.old_so if build == "old" else "-", "time", "-"], env=env, capture_output=True,
                                 text=True, check=True).stdout
            ms, th = [line for line in out.splitlines() if line.startswith("RESULT")][0].split()[1:]
            assert int(th) == threads
            times.setdefault((build, threads), []).append(float(ms))
    print(f"qmv {os.environ.get('QMV_SHAPE', '16384x4096')}, 4 bits, group 64, float16 scales; {a.rounds} rounds, medians, ms a call")
    print("| threads | before | after | before / after |")
    print("| --- | --- | --- | --- |")
    for threads in (1, 2):
        old_ms, new_ms = statistics.median(times[("old", threads)]), statistics.median(times[("new", threads)])
        print(f"| {threads} | {old_ms:.3f} | {new_ms:.3f} | {old_ms / new_ms:.3f} |")
    print("all rounds:", {f"{b} {t}": v for (b, t), v in times.items()})
    if not all(same):
        raise SystemExit("values differ")


if __name__ == "__main__":
    main()

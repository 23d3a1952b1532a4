"""GB/s of the native kernels a quantized FFN's rows go through in one decode token.

    .venv/bin/python scripts/bench_ffn_kernels.py [--d 4096] [--n 16384] [--layers 4] [--bits 4]

models/ffn.py `_packed`: the up rows (scales inline) through qmv_rows, then the down columns
(their scales in the layer's table) through qaxpy_cols, each kind's rows contiguous as a store
holds them (bench/profile.py's ffn_rows: one table shared by the layers); `--layers` such layers
cycled through (past the CPU's caches), the best of 5 runs.
Defaults: an OPT-6.7B layer at 4 bits, group 64. `mlx_flash.benchmark profile` measures the pair
together as the cost model's q4-rows rate; this prints each kernel apart (to compare builds: run
it against each build's kernels in alternating rounds).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_flash.bench.profile import ffn_rows  # noqa: E402
from mlx_flash.kernels import kernels_module, qaxpy_cols, qmv_rows, simd_name  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=4096, help="d_model: values a row")
    p.add_argument("--n", type=int, default=16384, help="neurons a layer")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bits", type=int, default=4)
    a = p.parse_args()
    kernels, why = kernels_module()
    if kernels is None:
        sys.exit(f"bench_ffn_kernels: {why}")
    f = ffn_rows(a.n, a.d, a.bits, a.layers)  # (the profile's q4-rows data)
    so, bo = f.spec.inline_offsets(a.d)
    h = np.random.default_rng(1).standard_normal(a.n).astype(np.float32)

    def rows():
        for up, _ in f.layers:
            qmv_rows(kernels, f.x, up, f.sel, f.spec, so, bo)

    def cols():
        for _, down in f.layers:
            qaxpy_cols(kernels, h, down, f.sel, f.trow, f.table, f.spec)

    print(f"d {a.d}, {a.n} neurons, {a.bits}-bit group 64, {a.layers} layers cycled; {simd_name(kernels)}, "
          f"{kernels.threads()} threads")
    up, down = (f.layers[0][k].shape[1] for k in (0, 1))
    for name, run, nbytes in (("qmv_rows (up rows)", rows, up), ("qaxpy_cols (down columns)", cols, down)):
        run()
        best = min(_timed(run) for _ in range(5))
        print(f"{name}: {a.layers * a.n * nbytes / best / 1e9:.2f} GB/s ({1e3 * best / a.layers:.2f} ms a layer)")


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()

"""Do the hybrid decode's reads run slower because its compute holds the CPUs?

Stop 49 left the one-at-a-time hybrid decode of 4-bit OPT-6.7B reading ~1.4x slower than the
cost model's disk probe of the same minute. The probe reads on an idle machine; the decode's
reads (the next layer's, prefetched) land while the kernels' two threads compute on both of
this machine's two cores (and spin 0.2 ms after each job). This reads the checkpoint's FFN
files four ways, in alternating order each round, and prints GB/s for each:

  probe        the cost model's probe: 256 KiB reads scattered, LAYER_READS (512) at a time
  layer        a hybrid layer's reads: one contiguous run of 144 x 256 KiB at a time
  layer+busy   the same while another thread runs 4-bit matvecs (16384 x 4096) on the kernels'
               pool without pause (both cores busy, as a decode's compute)
  probe+busy   the probe while that runs

Usage (after `mlx_flash.benchmark batch --shape opt-6.7b --dtype q4 ...` built the checkpoint):
  .venv/bin/python benchmarks/cost-model/read_contention.py \
      --folder ~/.cache/mlx_flash/bench/opt-6.7b-q4 --rounds 6 --seconds 2
"""

import argparse
import statistics
import threading
import time
from pathlib import Path

import mlx_flash  # noqa: F401  (before mlx.core)
import numpy as np

from mlx_flash.plan.measure import LAYER_READS
from mlx_flash.io import FlashReader
from mlx_flash.io.reader import READ_THREADS
from mlx_flash.kernels import QuantMatrix, kernels_module
from mlx_flash.layout.format import read_manifest

KiB = 1024
SIZE = 256 * KiB
LAYER_RUN = 144  # a hybrid layer's streamed rows at 50 % of 4-bit OPT-6.7B: 144 reads of 256 KiB


def busy_matrix():
    module, why = kernels_module()
    if module is None:
        raise SystemExit(f"needs the native kernels: {why}")
    n, k, group = 16384, 4096, 64
    rng = np.random.default_rng(0)
    w = rng.integers(0, 2**32, (n, k * 4 // 32), dtype=np.uint32)
    s = rng.random((n, k // group), dtype=np.float32).astype(np.float16)
    b = rng.random((n, k // group), dtype=np.float32).astype(np.float16)
    return QuantMatrix.of_host(module, w, s, b, 4, group), rng.random(k, dtype=np.float32)


class Busy:
    """matvecs without pause on another thread while `with` lasts; counts them."""

    def __init__(self, mat, x):
        self.mat, self.x, self.stop, self.calls = mat, x, threading.Event(), 0

    def _run(self):
        y = np.empty(self.mat.n, np.float32)
        while not self.stop.is_set():
            self.mat.matvec(self.x, y)
            self.calls += 1

    def __enter__(self):
        self.stop.clear()
        self.th = threading.Thread(target=self._run)
        self.th.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.th.join()


def rate(reader, fs, rng, seconds, contiguous):
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f = fs[rng.integers(len(fs))]
        n = f.size // SIZE
        if contiguous:
            offs = (rng.integers(0, n - LAYER_RUN + 1) + np.arange(LAYER_RUN)) * SIZE
        else:
            offs = rng.integers(0, n, LAYER_READS) * SIZE
        reader.read_discard(f, offs, np.full(offs.size, SIZE))
        done += offs.size * SIZE
    return done / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    files = [a.folder / e["file"] for e in read_manifest(a.folder).ffn_files]
    mat, x = busy_matrix()
    t0 = time.perf_counter()
    calls = 50
    for _ in range(calls):
        mat.matvec(x)
    print(f"busy thread: a 16384 x 4096 4-bit matvec takes {1e3 * (time.perf_counter() - t0) / calls:.2f} ms alone")
    kinds = ["probe", "layer", "layer+busy", "probe+busy"]
    out = {k: [] for k in kinds}
    rng = np.random.default_rng(1)
    with FlashReader(threads=READ_THREADS, direct=True, coalesce_gap=-1) as reader:
        fs = [reader.open(p) for p in files]
        for r in range(a.rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                contiguous = kind.startswith("layer")
                if kind.endswith("+busy"):
                    with Busy(mat, x) as busy:
                        gbs = rate(reader, fs, rng, a.seconds, contiguous)
                    extra = f" ({busy.calls} matvecs beside)"
                else:
                    gbs, extra = rate(reader, fs, rng, a.seconds, contiguous), ""
                out[kind].append(gbs)
                print(f"round {r + 1} {kind:11s} {gbs:.3f} GB/s{extra}", flush=True)
    print("\n| reads | GB/s median | min | max | ÷ probe (median of the rounds' ratios) |")
    print("| --- | --- | --- | --- | --- |")
    for kind in kinds:
        v = out[kind]
        ratio = statistics.median(p / q for p, q in zip(out["probe"], v))
        print(f"| {kind} | {statistics.median(v):.3f} | {min(v):.3f} | {max(v):.3f} | {1 / ratio:.2f} |")


if __name__ == "__main__":
    main()

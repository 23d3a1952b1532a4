"""Beside one-position products, do reads lose rate per byte or per batch? Uncached 256 KiB
reads of the checkpoint's FFN files in contiguous runs of N reads a batch (N = 16, 144, 256: a layer file holds 288),
alone and beside the busy kernels of read_contention.py, in alternating order, each round.

  .venv/bin/python benchmarks/cost-model/busy_by_batch.py --rounds 4 --seconds 2
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_flash  # noqa: F401
import numpy as np

from mlx_flash.io import FlashReader
from mlx_flash.io.reader import READ_THREADS
from mlx_flash.layout.format import read_manifest

sys.path.insert(0, str(Path(__file__).parent))
from read_contention import Busy, busy_matrix  # noqa: E402

SIZE = 256 * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", type=Path, default=Path.home() / ".cache/mlx_flash/bench/opt-6.7b-q4")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    files = [a.folder / e["file"] for e in read_manifest(a.folder).ffn_files]
    busy = Busy(*busy_matrix())
    rng = np.random.default_rng(5)
    sizes = (16, 144, 256)
    out = {(n, b): [] for n in sizes for b in (False, True)}
    with FlashReader(threads=READ_THREADS, direct=True, coalesce_gap=-1) as r:
        fs = [r.open(p) for p in files]

        def run(n):
            done, batches, t0 = 0, 0, time.perf_counter()
            while time.perf_counter() - t0 < a.seconds:
                f = fs[rng.integers(len(fs))]
                offs = (rng.integers(0, f.size // SIZE - n + 1) + np.arange(n)) * SIZE
                r.read_discard(f, offs, np.full(n, SIZE))
                done += n * SIZE
                batches += 1
            dt = time.perf_counter() - t0
            return done / dt / 1e9, 1e3 * dt / batches

        for i in range(a.rounds):
            for n in sizes:
                for b in ((False, True) if i % 2 == 0 else (True, False)):
                    if b:
                        with busy:
                            gbs, ms = run(n)
                    else:
                        gbs, ms = run(n)
                    out[n, b].append((gbs, ms))
                    print(f"round {i + 1} {n:4d} reads a batch {'busy ' if b else 'alone'} {gbs:.2f} GB/s, "
                          f"{ms:.2f} ms a batch", flush=True)
    print("\n| reads a batch | alone GB/s | beside GB/s | ratio (median of rounds) | ms a batch alone | beside | extra ms a batch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in sizes:
        al, bu = out[n, False], out[n, True]
        ratio = statistics.median(y[0] / x[0] for x, y in zip(al, bu))
        ma, mb = statistics.median(x[1] for x in al), statistics.median(y[1] for y in bu)
        print(f"| {n} | {statistics.median(x[0] for x in al):.2f} | {statistics.median(y[0] for y in bu):.2f} | "
              f"{ratio:.2f} | {ma:.2f} | {mb:.2f} | {mb - ma:.2f} |")


if __name__ == "__main__":
    main()

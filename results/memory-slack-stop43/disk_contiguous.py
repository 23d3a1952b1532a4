"""The cost model's disk rate for an exact mode: a layer's streamed rows lie together, so its
reads are one run of consecutive 256 KiB pieces; the profile's curve reads pieces scattered over
the file. Both, alternating, on a model's own FFN files, LAYER_READS pieces a batch (as the
profile), and a batch of a SmolLM2 layer's stream (~10 pieces).

usage: .venv/bin/python results/memory-slack-stop43/disk_contiguous.py MODEL_FOLDER [ROUNDS] [SECONDS]"""
import statistics
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (first: BLAS)
from mlx_flash.bench.profile import LAYER_READS, disk_curve
from mlx_flash.layout.format import read_manifest

folder = Path(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
ffn = [folder / e["file"] for e in read_manifest(folder).ffn_files]
size = 256 << 10
cases = [(b, c) for b in (LAYER_READS, 10) for c in (False, True)]
got = {k: [] for k in cases}
for r in range(rounds):
    for b, c in (cases if r % 2 == 0 else cases[::-1]):
        got[b, c].append(disk_curve(ffn, (size,), seconds=seconds, batch=b, contiguous=c, seed=r)[size])
print(f"{folder}: {len(ffn)} FFN files; 256 KiB reads, {rounds} alternating rounds, {seconds} s each")
print("| pieces a batch | scattered GB/s (median; rounds) | contiguous GB/s (median; rounds) | contiguous ÷ scattered |")
print("| --- | --- | --- | --- |")
for b in (LAYER_READS, 10):
    a, c = statistics.median(got[b, False]), statistics.median(got[b, True])
    fmt = lambda v: " / ".join(f"{x:.2f}" for x in v)  # noqa: E731
    print(f"| {b} | {a:.2f} ({fmt(got[b, False])}) | {c:.2f} ({fmt(got[b, True])}) | {c / a:.2f} |")

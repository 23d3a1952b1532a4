"""Is the cost model's disk rate the one a decode sees? Uncached random reads (the profile's
disk_curve, O_DIRECT) of the profile's probe file against the same reads of a model's own FFN
files, alternating, a few rounds.

usage: .venv/bin/python results/memory-slack-stop43/disk_where.py MODEL_FOLDER [ROUNDS] [SECONDS]"""
import statistics
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  (first: BLAS)
from mlx_flash.bench.profile import disk_curve, probe_file
from mlx_flash.layout.format import read_manifest

folder = Path(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
manifest = read_manifest(folder)
ffn = [folder / e["file"] for e in manifest.ffn_files]
sizes = (64 << 10, 256 << 10, 1 << 20)
got = {"probe file": {s: [] for s in sizes}, "model's FFN files": {s: [] for s in sizes}}
for r in range(rounds):
    order = list(got) if r % 2 == 0 else list(got)[::-1]
    for name in order:
        files = [probe_file()] if name == "probe file" else ffn
        curve = disk_curve(files, sizes, seconds=seconds)
        for s in sizes:
            got[name][s].append(curve[s])
print(f"{folder}: {len(ffn)} FFN files, {sum(f.stat().st_size for f in ffn) / 1e6:.0f} MB; probe file "
      f"{probe_file().stat().st_size / 1e6:.0f} MB; {rounds} alternating rounds, {seconds} s a size")
print("| read size | " + " | ".join(f"{n} GB/s (median; rounds)" for n in got) + " | model ÷ probe |")
print("| --- | --- | --- | --- |")
for s in sizes:
    a, b = (statistics.median(got[n][s]) for n in got)
    cells = [f"{statistics.median(got[n][s]):.2f} ({' / '.join(f'{x:.2f}' for x in got[n][s])})" for n in got]
    print(f"| {s >> 10} KiB | {cells[0]} | {cells[1]} | {b / a:.2f} |")

"""How this machine's disk serves the ways a runtime can read weights, in alternating rounds.

    python scripts/disk_read_modes.py FILE [--rounds 8] [--seconds 3] [--out results/storage/read-modes]

The question it answers (issue 13, stop 37's lead): llama.cpp's buffered, read-ahead page faults
got a steady 2.2-2.4 GB/s from this VM's disk while mlx_flash's uncached reads got 1.1-2.0 in the
same alternating runs. Is a buffered path worth building? Each round runs every mode once, in
turn, with the page cache dropped before each (root), through fio:

- direct-256k-qd32: mlx_flash's reader (O_DIRECT, 256 KiB, 32 threads doing pread at random
  offsets: fio psync, numjobs 32);
- direct-1m-qd32: the same with 1 MiB reads;
- direct-256k-seq-qd32: 32 threads, each reading its own region front to back (a layer's
  stream split between threads);
- buffered-seq: one thread reading front to back through the page cache (the kernel's
  read-ahead, read_ahead_kb);
- mmap-seq: one thread touching an mmap of the file front to back (llama.cpp's page faults).

Printed and written (markdown + JSON): GB/s per round and the median, and each mode's rate as
the device counted it (bytes over busy time, mlx_flash/io/device.py), which is the figure
`benchmark peers` reports for a decode. Needs fio and root (to drop the page cache).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_flash.io import device  # noqa: E402

MODES = {
    "direct-256k-qd32": ["--direct=1", "--rw=randread", "--bs=256k", "--numjobs=32", "--ioengine=psync"],
    "direct-1m-qd32": ["--direct=1", "--rw=randread", "--bs=1m", "--numjobs=32", "--ioengine=psync"],
    "direct-256k-seq-qd32": ["--direct=1", "--rw=read", "--bs=256k", "--numjobs=32", "--ioengine=psync",
                             "--offset_increment={region}"],
    "buffered-seq": ["--direct=0", "--rw=read", "--bs=1m", "--numjobs=1", "--ioengine=psync"],
    "mmap-seq": ["--direct=0", "--rw=read", "--bs=1m", "--numjobs=1", "--ioengine=mmap"],
}


def drop_caches():
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_mode(path, args, seconds, size):
    region = size // 32 // 4096 * 4096
    cmd = ["fio", "--name=t", f"--filename={path}", "--thread", "--group_reporting", "--time_based",
           f"--runtime={seconds}", "--output-format=json"] + [a.format(region=region) for a in args]
    if "--numjobs=32" in args and "--rw=read" in args:
        cmd.append(f"--size={region}")
    before = device.counters(path)
    t = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t
    if out.returncode != 0:
        raise SystemExit(f"fio failed ({' '.join(cmd)}): {out.stderr.strip()[-500:]}")
    job = json.loads(out.stdout)["jobs"][0]["read"]
    return {"gbs": job["bw_bytes"] / 1e9, "device_gbs": device.rate(before, device.counters(path)),
            "wall_s": wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="a large file on the disk to measure (a model's weights)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None, help="folder for read-modes.md / .json")
    a = ap.parse_args(argv)
    path = Path(a.file)
    if not path.is_file():
        raise SystemExit(f"{path}: no such file")
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)} (choose from {', '.join(MODES)})")
    size = path.stat().st_size
    res = {m: [] for m in modes}
    for r in range(a.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for m in order:
            drop_caches()
            res[m].append(run_mode(path, MODES[m], a.seconds, size))
        print(f"round {r + 1}: " + "  ".join(f"{m} {res[m][-1]['gbs']:.2f}" for m in modes), flush=True)
    lines = [f"# Read modes on {path} ({size / 1e9:.1f} GB), {a.rounds} rounds of {a.seconds} s, alternating",
             "", f"- {time.strftime('%Y-%m-%d %H:%M:%S')}; `python scripts/disk_read_modes.py {' '.join(sys.argv[1:])}`",
             "- GB/s as fio counts it; 'device' is bytes over the device's busy time (io/device.py)", "",
             "| mode | median GB/s | min | max | device median GB/s | per round |", "| --- | --- | --- | --- | --- | --- |"]
    for m in modes:
        g = [x["gbs"] for x in res[m]]
        dev = [x["device_gbs"] for x in res[m] if x["device_gbs"] is not None]
        lines.append(f"| {m} | {statistics.median(g):.2f} | {min(g):.2f} | {max(g):.2f} | "
                     f"{statistics.median(dev):.2f} | {' '.join(f'{v:.2f}' for v in g)} |" if dev else
                     f"| {m} | {statistics.median(g):.2f} | {min(g):.2f} | {max(g):.2f} | – | "
                     f"{' '.join(f'{v:.2f}' for v in g)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "read-modes.md").write_text(text)
        (out / "read-modes.json").write_text(json.dumps({"file": str(path), "size": size, "rounds": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

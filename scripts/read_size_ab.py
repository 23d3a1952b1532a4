"""A decode from flash with the reader's largest read at several sizes, in alternating rounds.

    python scripts/read_size_ab.py --model /work/big/llama7b-q4 --memory-limit 2082MB \
        --max-read 262144,1048576 --rounds 3 --tokens 6

Each run is a fresh process (the page cache dropped before it, as root) that loads the model
under --memory-limit (the plan --mode auto picks), decodes a 16-token prompt and one warm-up
token, then times `--tokens` single-token steps. The reader's largest read (io/reader.py's
DEFAULT_MAX_READ, 256 KiB) is replaced for that process only. Printed per run: seconds a token,
the rate the disk delivered during the timed tokens (bytes over its busy time, io/device.py),
and the bytes the plan reads a token. fio's random reads on this VM say 1 MiB reads are as fast
or faster (scripts/disk_read_modes.py); this checks what the engine's batches get.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
max_read, model_dir, limit, tokens = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
import mlx_flash, mlx.core as mx
from mlx_flash.io import reader as R, device
d = list(R.FlashReader.__init__.__defaults__)
d[R.FlashReader.__init__.__code__.co_varnames.index("max_read") - 1] = max_read  # (defaults start after self)
R.FlashReader.__init__.__defaults__ = tuple(d)
from mlx_lm.models.cache import make_prompt_cache
model, _ = mlx_flash.load(model_dir, memory_limit=limit, progress=False)
cache = make_prompt_cache(model)
mx.eval(model(mx.array([list(range(1, 17))]), cache=cache))
x = mx.array([[1]])
mx.eval(model(x, cache=cache))
probe = model_dir + "/config.json"
c0, t = device.counters(probe), time.perf_counter()
for _ in range(tokens):
    mx.eval(model(x, cache=cache))
dt = (time.perf_counter() - t) / tokens
w = model.runtime.work()
print("RESULT " + json.dumps({"max_read": max_read, "mode": model.runtime.mode, "s_per_token": dt,
      "disk_gbs": device.rate(c0, device.counters(probe)), "read_bytes": w.read_bytes}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-limit", required=True)
    ap.add_argument("--max-read", default="262144,1048576", help="comma-separated sizes in bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--out", default=None, help="a JSON file for the runs")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.max_read.split(",")]
    runs = []
    for r in range(a.rounds):
        for size in (sizes if r % 2 == 0 else sizes[::-1]):
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            out = subprocess.run([sys.executable, "-c", CHILD, str(size), a.model, a.memory_limit, str(a.tokens)],
                                 capture_output=True, text=True, cwd=ROOT)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not line:
                raise SystemExit(f"run with max_read {size} failed:\n{out.stderr[-2000:]}")
            rec = json.loads(line[0][7:]) | {"round": r}
            runs.append(rec)
            g = rec["disk_gbs"]
            print(f"round {r + 1}  max_read {size >> 10:5d} KiB  {rec['mode']}  {rec['s_per_token']:.3f} s/token  "
                  f"disk {'%.2f' % g if g else '-'} GB/s  read {rec['read_bytes'] / 1e6:.0f} MB/token", flush=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M:%S')}, medians:")
    for size in sizes:
        mine = [x for x in runs if x["max_read"] == size]
        rates = [x["disk_gbs"] for x in mine if x["disk_gbs"]]
        print(f"  max_read {size >> 10:5d} KiB: {statistics.median(x['s_per_token'] for x in mine):.3f} s/token, "
              f"disk {statistics.median(rates) if rates else float('nan'):.2f} GB/s")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"argv": sys.argv[1:], "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

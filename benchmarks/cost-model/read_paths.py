"""What a hybrid layer's reads cost beyond the disk probe's: the same bytes three ways.

The cost model prices a token's reads at the disk probe's rate (plan/measure.py:
model_disk_curve: reads thrown away, `read_discard`). A hybrid store's reads also place every
bundle's bytes into the layer's buffer and check each part's CRC32C. This loads 4-bit
OPT-6.7B in `--mode hybrid --memory-budget 50%` and reads each layer's streamed rows, layer
after layer, through the store's own reader, three ways in alternating order each round:

  discard   the same byte ranges thrown away (what the probe does)
  placed    read into the store's buffer as a decode does, CRC32C unchecked
  checked   read into the buffer with the checks (what a decode does: store._fill)

and prints GB/s and ms a token (its 32 layers) for each, idle and beside a thread running the
kernels without pause (as read_contention.py): six kinds in alternating order each round, so
that the disk's drift over minutes stays out of the ratios.

  .venv/bin/python benchmarks/cost-model/read_paths.py --rounds 6
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_flash
import numpy as np

from mlx_flash.runtime.stores.base import read_into

sys.path.insert(0, str(Path(__file__).parent))
from read_contention import Busy, busy_matrix  # noqa: E402

FOLDER = Path.home() / ".cache/mlx_flash/bench/opt-6.7b-q4"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", type=Path, default=FOLDER)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    model, _ = mlx_flash.load(a.folder, mode="hybrid", memory_budget="50%", progress=False)
    st = model.runtime.store
    ids, lay, buf, r = st._stream, st.layout, st.buffers[0], st.reader
    L = len(st.files)
    nbytes = ids.size * lay.stride * L
    print(f"{L} layers, {ids.size} streamed rows a layer of {lay.stride} bytes: {nbytes / 1e9:.3f} GB a token")
    starts = ids * lay.stride

    def token(kind):
        t = time.perf_counter()
        for layer in range(L):
            if kind == "discard":
                r.read_discard(st.files[layer], starts, np.full(ids.size, lay.stride))
            else:
                buf.delete(buf.cached_ids())
                rows = buf.append(ids)
                read_into(r, st.files[layer], lay, ids, buf, rows, st.bundled, st.tables[layer],
                          st.crcs[layer] if kind == "checked" else None, f"layer {layer}", None)
        return time.perf_counter() - t

    kinds = [f"{k}{b}" for b in ("", "+busy") for k in ("discard", "placed", "checked")]
    out = {k: [] for k in kinds}
    busy = Busy(*busy_matrix())
    token("checked")  # warm
    for i in range(a.rounds):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            if kind.endswith("+busy"):
                with busy:
                    s = token(kind[: -len("+busy")])
            else:
                s = token(kind)
            out[kind].append(s)
            print(f"round {i + 1} {kind:14s} {1e3 * s:.0f} ms ({nbytes / s / 1e9:.2f} GB/s)", flush=True)
    model.runtime.close()
    print(f"\nmedians of {a.rounds} rounds")
    print("| reads | ms a token | GB/s | ÷ discard's time idle (median of the rounds' ratios) |")
    print("| --- | --- | --- | --- |")
    for kind in kinds:
        ratio = statistics.median(x / y for x, y in zip(out[kind], out["discard"]))
        m = statistics.median(out[kind])
        print(f"| {kind} | {1e3 * m:.0f} | {nbytes / m / 1e9:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()

"""What reading experts costs: uncached reads of random experts into the expert buffer (the
store's own read path: O_DIRECT, CRC32C of every part, scales converted), wall time and this
process's CPU time, with the CRC32C instruction and with the table, rounds alternating.

    .venv/bin/python scripts/bench_expert_reads.py MODEL [--experts 24] [--layers 12] [--rounds 2]

MODEL: a flash folder of a mixture of experts (e.g. the one `mlx_flash.benchmark moe --shape
qwen3-30b-a3b` builds under ~/.cache/mlx_flash/bench). Each step reads --experts random experts of
a layer that are not in the buffer (the buffer is --memory-budget 50 % of the model). Then the
checksum alone over 64 MiB in DRAM, both paths, best of two.
"""

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--experts", type=int, default=24)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    import numpy as np

    import mlx_flash
    from mlx_flash.io import _native

    model, _ = mlx_flash.load(a.model, memory_budget="50%")
    store = model.runtime.store
    rng = np.random.default_rng(0)
    totals = {1: [0.0, 0.0, 0], 0: [0.0, 0.0, 0]}  # crc path -> [wall s, CPU s, bytes]
    for r in range(a.rounds):
        for hw in (1, 0) if r % 2 == 0 else (0, 1):
            _native.crc32c_hardware(hw)
            for layer in store.layers[: a.layers]:
                ids = store.cache.ids(layer, rng.choice(store.layout.n_experts, a.experts, replace=False))
                ids = ids[store.cache.slot_of[ids] < 0]
                _, missing, into = store.cache.place(ids)
                c0, t0 = cpu_s(), time.perf_counter()
                store._read(layer, missing, into)
                totals[hw][0] += time.perf_counter() - t0
                totals[hw][1] += cpu_s() - c0
                totals[hw][2] += store.read_bytes(layer, missing)
    buf = rng.integers(0, 256, 64 << 20, dtype=np.uint8)  # the checksum alone, 64 MiB in DRAM
    crc_gbps = {}
    for hw in (1, 0, 1, 0):
        _native.crc32c_hardware(hw)
        t0 = time.perf_counter()
        _native.crc32c(buf, 0)
        crc_gbps[hw] = max(crc_gbps.get(hw, 0), buf.size / (time.perf_counter() - t0) / 1e9)
    _native.crc32c_hardware(1)
    print(f"{a.model}: {a.experts} random experts a layer, {a.layers} layers, {a.rounds} rounds; CRC32C of 64 MiB "
          f"in DRAM: {crc_gbps[1]:.1f} GB/s with the instruction, {crc_gbps[0]:.1f} by table\n")
    print("| CRC32C | MB read | GB/s | CPU ms per 100 MB |")
    print("| --- | --- | --- | --- |")
    for hw, name in ((1, "instruction, three chains"), (0, "table")):
        wall, cpu, nbytes = totals[hw]
        print(f"| {name} | {nbytes / 1e6:.0f} | {nbytes / wall / 1e9:.2f} | {1e3 * cpu / (nbytes / 1e8):.0f} |")


if __name__ == "__main__":
    main()

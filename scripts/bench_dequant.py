"""How fast the native reader dequantizes on copy, next to the float16 conversion.

    .venv/bin/python scripts/bench_dequant.py [--d 4096] [--reps 7]

1. The C conversion alone (_native.convert / _native.dequantize), one 4096-value
   row per call, rows rotating over 64 sources (cache-resident, as a worker's
   read slot is): float16 -> float32 against quantized rows (scales inline) and
   columns (scales from a table row) at 4 and 8 bits, group 64, float16 scales.
   The Python call (measured with n = 0) is subtracted; GB/s counts the float32
   bytes written. Best of --reps.
2. The whole read_bundles path on page-cached files (threads=1, buffered):
   FFN bundles [gate row | up row | down column] of d values, float16 against
   4- and 8-bit; us per bundle, and the same batch with read_discard (the reads
   without the copy) for scale.
3. CRC32C (what every checked read adds): GB/s on one core over 64 MiB, with the
   CPU's CRC instruction and with the table.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_flash.io import FlashReader, Quantized, native_available  # noqa: E402
from mlx_flash.layout import quant as Q  # noqa: E402

GS, SD = 64, "float16"


def best(fn, reps, inner):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(inner):
            fn(i)
        times.append((time.perf_counter() - t0) / inner)
    return min(times)


def kernel(d, reps):
    from mlx_flash.io import _native

    rng = np.random.default_rng(0)
    R, inner = 64, 3000
    out = np.empty((R, d), np.float32)
    half = rng.standard_normal((R, d)).astype(np.float16)
    null = best(lambda i: _native.convert(half[i % R], 1, out[i % R], 0, 0), reps, inner)
    print(f"1. C conversion, one {d}-value row per call (Python call overhead {null * 1e6:.2f} us, "
          f"subtracted), simd={_native.simd(-1)}")
    print(f"   {'source':<34} {'us/row':>7} {'GB/s f32':>9}")

    def show(name, t):
        t = max(t - null, 1e-12)
        print(f"   {name:<34} {t * 1e6:7.2f} {d * 4 / t / 1e9:9.1f}")

    show("float16 -> float32 (F16C)", best(lambda i: _native.convert(half[i % R], 1, out[i % R], 0, d),
                                          reps, inner))
    for bits in (4, 8):
        packed = Q.pack(rng.integers(0, 1 << bits, (R, d)).astype(np.uint8), bits)
        sb = (rng.standard_normal((R, 2 * d // GS)) * 0.02).astype(np.float16)
        rows = np.ascontiguousarray(np.concatenate([packed, sb.view(np.uint8)], axis=1))
        table = (rng.standard_normal((2, d)) * 0.02).astype(np.float16)
        show(f"{bits}-bit row (inline scales)",
             best(lambda i: _native.dequantize(rows[i % R], d, bits, GS, 1, None, None, out[i % R], 0),
                  reps, inner))
        show(f"{bits}-bit column (table row)",
             best(lambda i: _native.dequantize(packed[i % R], d, bits, GS, 1, table[0], table[1],
                                               out[i % R], 0), reps, inner))


def layer_file(folder, d, n, bits, rng):
    """n FFN bundles of d values: float16 (bits None) or quantized -> (path, stride, segments, used)."""
    if bits is None:
        rb = d * 2
        used = 3 * rb
        data = rng.standard_normal((n, 3 * d)).astype(np.float16).view(np.uint8)
        segs = [(j * rb, d, "float16") for j in range(3)]
    else:
        q = Q.QuantSpec(bits, GS, SD)
        rb, cb = q.row_bytes(d), q.packed_bytes(d)
        used = 2 * rb + cb
        data = rng.integers(0, 256, (n, used), dtype=np.uint8)
        sb = (rng.standard_normal((n, 2, 2 * d // GS)) * 0.02).astype(np.float16).view(np.uint8)
        data[:, cb:rb] = sb[:, 0]
        data[:, rb + cb : 2 * rb] = sb[:, 1]
        table = tuple((rng.standard_normal((n // GS, d)) * 0.02).astype(np.float16) for _ in range(2))
        segs = [(0, d, Quantized(bits, GS, SD)), (rb, d, Quantized(bits, GS, SD)),
                (2 * rb, d, Quantized(bits, GS, SD, table))]
    stride = (used + 511) // 512 * 512
    buf = np.zeros((n, stride), np.uint8)
    buf[:, :used] = data
    path = Path(folder) / f"layer_{bits or 'f16'}.bin"
    buf.tofile(path)
    return path, stride, segs


def reader_path(d, reps):
    n = 1024
    rng = np.random.default_rng(1)
    print(f"\n2. read_bundles, page-cached, threads=1: {n} bundles [gate row | up row | down column], "
          f"d={d}, all in one batch")
    print(f"   {'layout':<22} {'bundle KiB':>10} {'us/bundle':>10} {'reads only':>11} {'copy us/row':>12}")
    with tempfile.TemporaryDirectory() as tmp, FlashReader(threads=1, direct=False) as r:
        for bits in (None, 4, 8):
            path, stride, segs = layer_file(tmp, d, n, bits, rng)
            dst = [np.empty((n, d), np.float32) for _ in segs]
            segs = [s + (v,) for s, v in zip(segs, dst)]
            f = r.open(path)
            ids = np.arange(n)
            r.read_bundles(f, ids, stride, segs, ids)  # page it in
            full = best(lambda i: r.read_bundles(f, ids, stride, segs, ids), reps, 3)
            offs = ids * stride
            lens = np.full(n, stride)
            bare = best(lambda i: r.read_discard(f, offs, lens), reps, 3)
            name = "float16 -> float32" if bits is None else f"{bits}-bit, {SD} scales"
            print(f"   {name:<22} {stride / 1024:10.1f} {full / n * 1e6:10.2f} {bare / n * 1e6:11.2f} "
                  f"{(full - bare) / n / 3 * 1e6:12.2f}")
            r.close_file(f)
            os.unlink(path)


def crc(reps):
    from mlx_flash.io import _native

    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    print("\n3. CRC32C of 64 MiB, one core")
    for hw, name in ((1, "hardware instruction"), (0, "table (slicing-by-8)")):
        _native.crc32c_hardware(hw)
        t = best(lambda i: _native.crc32c(data), reps, 1)
        print(f"   {name:<22} {data.nbytes / t / 1e9:6.2f} GB/s")
    _native.crc32c_hardware(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=4096, help="values per row (a multiple of 256)")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    if not native_available():
        sys.exit("the native extension is not built (pip install -e .)")
    kernel(a.d, a.reps)
    reader_path(a.d, a.reps)
    crc(a.reps)


if __name__ == "__main__":
    main()

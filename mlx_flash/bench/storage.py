"""The storage benchmark: uncached random-read throughput, FlashReader vs fio.

Reproduces the paper's Figure 2b on this machine (throughput by chunk size
and thread count), fits the latency/throughput model that sets the reader's
coalescing gap, and checks the reader against the device in one run:

- the grid: FlashReader (`read_discard`: plan, pool, O_DIRECT into aligned
  staging; no copy-out) and fio (`--direct=1 --rw=randread --ioengine=psync
  --numjobs=T --iodepth=1 --thread`: T threads each doing pread, the same
  block size and parallelism) for every chunk x threads cell, back to back;
- the acceptance rounds, alternated `repeat` times because a shared virtual
  disk drifts by +-15 %: 32 KiB x 32 threads (FlashReader, fio psync, fio
  libaio with iodepth 32), and the token-like batch (12,000 random 16 KiB
  bundles, float16 on flash, converted to float32 rows: the engine's path,
  `read_bundles`) against fio's 16 KiB x 32 threads;
- the per-read overhead of the native and Python pools (buffered reads of
  page-cached bundles, so the device costs nothing).
Offsets are random and aligned to the chunk size (as fio's are).
"""

import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..io import DEFAULT_COALESCE_GAP, FlashReader, native_available

from ..sizes import KiB, MiB, parse_size  # noqa: F401  (parse_size: the CLI's --size)
DEFAULT_CHUNKS = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB,
                  512 * KiB, 1 * MiB]
DEFAULT_THREADS = [1, 2, 4, 8, 16, 32, 64]

def fmt_size(n):
    for unit, v in (("MiB", MiB), ("KiB", KiB)):
        if n >= v and n % v == 0:
            return f"{n // v} {unit}"
    return f"{n} B"


def ensure_file(path, size=None, progress=True, default_size=2 * 1000**3):
    """Reuse the benchmark file, or write it (random bytes, temp name, rename)."""
    path = Path(path)
    if path.exists():
        have = path.stat().st_size
        if size is not None and have != size:
            raise FlashError(f"{path} exists with {have} bytes, not {size}; pass --size {have} "
                             "or another --file")
        return have
    size = size or default_size
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < size + (1 << 30):
        raise FlashError(f"{path.parent}: {free / 1e9:.1f} GB free, the file needs {size / 1e9:.1f} GB")
    tmp = path.with_name(path.name + ".partial")
    rng = np.random.default_rng(0)
    chunk = 64 * MiB
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"writing {path.name}")
    with open(tmp, "wb") as fh:
        done = 0
        while done < size:
            n = min(chunk, size - done)
            fh.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            done += n
            if bar:
                bar.update(n)
        fh.flush()
        os.fsync(fh.fileno())
    if bar:
        bar.close()
    os.replace(tmp, path)
    return size


# ---- measurements


def reader_throughput(reader, f, chunk, duration, rng, max_batch_reads=8192):
    """Random chunk-aligned reads of `chunk` bytes for about `duration` s."""
    nblocks = f.size // chunk
    # >= 32 reads per thread keeps the batch's tail (threads running out of
    # work) near 1 %; read_discard's staging does not grow with the batch
    batch = max(reader.threads * 32, min(max_batch_reads, int(64 * MiB * reader.threads // chunk)))
    reads = nbytes = 0
    c0 = time.process_time()
    t0 = time.perf_counter()
    while True:
        offs = rng.integers(0, nblocks, batch, dtype=np.int64) * chunk
        reader.read_discard(f, offs, np.full(batch, chunk, dtype=np.int64))
        reads += batch
        nbytes += batch * chunk
        dt = time.perf_counter() - t0
        if dt >= duration:
            break
    cpu = time.process_time() - c0
    return {"gbps": nbytes / dt / 1e9, "iops": reads / dt, "reads": reads, "seconds": dt,
            "cpu_us_per_read": cpu / reads * 1e6}


def fio_available():
    return shutil.which("fio") is not None


def fio_throughput(path, chunk, threads, duration, engine="psync"):
    """fio's uncached random-read figure; psync: T threads x 1 read each,
    libaio: 1 thread with T reads in flight."""
    cmd = ["fio", "--name=flash", f"--filename={path}", "--readonly", "--direct=1",
           "--rw=randread", f"--bs={chunk}", "--norandommap", "--randrepeat=0",
           "--time_based", f"--runtime={max(1, int(duration * 1000))}ms",
           "--group_reporting", "--output-format=json"]
    if engine == "psync":
        cmd += ["--ioengine=psync", f"--numjobs={threads}", "--iodepth=1", "--thread"]
    elif engine == "libaio":
        cmd += ["--ioengine=libaio", "--numjobs=1", f"--iodepth={threads}"]
    else:
        raise ValueError(engine)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise FlashError(f"fio failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
    out = r.stdout[r.stdout.index("{"):]  # fio may print notes before the JSON
    job = json.loads(out)["jobs"][0]
    rd = job["read"]
    secs = rd["runtime"] / 1000 if rd.get("runtime") else duration
    return {"gbps": rd["bw_bytes"] / 1e9, "iops": rd["iops"], "reads": rd["total_ios"],
            "seconds": secs, "command": " ".join(cmd)}


def fit_latency_model(points):
    """Least squares (relative) of 1/throughput = l / chunk + 1 / B over (chunk, GB/s) points.

    l: per-read cost parallelism does not hide; B: streaming rate.
    Reading a gap g beats a second read while g < l * B (the coalescing gap).
    """
    c = np.array([p[0] for p in points], dtype=float)
    inv = np.array([1 / (p[1] * 1e9) for p in points])  # s per byte
    A = np.stack([1 / c, np.ones_like(c)], axis=1)
    w = 1 / inv  # relative residuals: every chunk size counts the same
    (l, invb), *_ = np.linalg.lstsq(A * w[:, None], inv * w, rcond=None)
    if l <= 0 or invb <= 0:
        return None
    return {"latency_us": l * 1e6, "stream_gbps": 1 / invb / 1e9, "gap_bytes": int(l / invb),
            "points": len(points)}


def token_batch(reader, f, n_reads, bundle, rng, src_dtype="float16"):
    """One batch of n_reads random distinct bundles (2 segments, float32 rows)."""
    nbundles = f.size // bundle
    if n_reads > nbundles:
        raise FlashError(f"{f.path}: {nbundles} bundles of {bundle} B, fewer than {n_reads}")
    isz = 4 if src_dtype == "float32" else 2
    d = bundle // 2 // isz
    ids = rng.choice(nbundles, n_reads, replace=False).astype(np.int64)
    dst = [np.empty((n_reads, d), dtype=np.float32) for _ in range(2)]
    for a in dst:
        a.fill(0)  # touch the pages: the engine's cache is resident
    segs = [(0, d, src_dtype, dst[0]), (d * isz, d, src_dtype, dst[1])]
    rows = rng.permutation(n_reads).astype(np.int64)
    reader.stats.reset()
    c0 = time.process_time()
    t0 = time.perf_counter()
    reader.read_bundles(f, ids, bundle, segs, rows)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    s = reader.stats
    return {"seconds": dt, "gbps": n_reads * bundle / dt / 1e9, "reads_requested": n_reads,
            "reads_issued": s.reads_issued, "bytes_requested": s.bytes_requested,
            "bytes_read": s.bytes_read, "cpu_us_per_read": cpu / n_reads * 1e6}


def per_read_overhead(path, n_reads, bundle, threads, rounds=5):
    """Microseconds per read on page-cached data (the device costs ~nothing),
    per backend: raw reads (`read_discard`) and bundles converted float16 ->
    float32 into rows (`read_bundles`); wall time and process CPU time."""
    backends = ["native", "python"] if native_available() else ["python"]
    out = {}
    rng = np.random.default_rng(7)
    size = os.path.getsize(path)
    span = min(size // bundle, max(n_reads * 2, (256 * MiB) // bundle))
    ids = np.sort(rng.choice(span, n_reads, replace=False)).astype(np.int64)
    isz, d = 2, bundle // 4
    dst = [np.zeros((n_reads, d), dtype=np.float32) for _ in range(2)]
    segs = [(0, d, "float16", dst[0]), (d * isz, d, "float16", dst[1])]
    rows = np.arange(n_reads, dtype=np.int64)
    lens = np.full(n_reads, bundle, dtype=np.int64)
    for backend in backends:
        with FlashReader(threads=threads, direct=False, backend=backend,
                         coalesce_gap=-1) as r:
            f = r.open(path)
            r.read_bundles(f, ids, bundle, segs, rows)  # warm the page cache
            res = {}
            for what, call in (("read", lambda: r.read_discard(f, ids * bundle, lens)),
                               ("bundles", lambda: r.read_bundles(f, ids, bundle, segs, rows))):
                walls, cpus = [], []
                for _ in range(rounds):
                    c0, t0 = time.process_time(), time.perf_counter()
                    call()
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                res[what] = {"wall_us": statistics.median(walls) / n_reads * 1e6,
                             "cpu_us": statistics.median(cpus) / n_reads * 1e6}
            out[backend] = res
    return out


# ---- the run


def _cell(d, chunk, threads):
    return d.setdefault(str(chunk), {}).setdefault(str(threads), {})


def measure_grid(res, path, reader_for, chunks, threads, duration, use_fio, rng, echo):
    """The grid of random uncached reads, FlashReader / fio psync per chunk size and thread count
    (alternating order), into res; then the latency/throughput model at 32 threads."""
    echo(f"\ngrid: {duration:.1f} s per cell, FlashReader / fio psync (alternating order); GB/s")
    for ti, t in enumerate(threads):
        r, f = reader_for(t, coalesce_gap=-1)
        line = []
        for ci, c in enumerate(chunks):
            fio_first = use_fio and (ti + ci) % 2 == 1  # checkerboard order
            if fio_first:
                fm = fio_throughput(path, c, t, duration)
            m = reader_throughput(r, f, c, duration, rng)
            _cell(res["flashreader"], c, t).update(m)
            txt = f"{m['gbps']:.2f}"
            if use_fio:
                if not fio_first:
                    fm = fio_throughput(path, c, t, duration)
                _cell(res["fio_psync"], c, t).update(fm)
                txt += f"/{fm['gbps']:.2f}"
            line.append(f"{fmt_size(c)}: {txt}")
        echo(f"  {t:>2} threads  " + "  ".join(line))
    print_tables(res, chunks, threads, echo)
    at32 = [(c, res["flashreader"][str(c)]["32"]["gbps"]) for c in chunks
            if "32" in res["flashreader"].get(str(c), {})]
    model = fit_latency_model(at32) if len(at32) >= 2 else None
    res["model_32_threads"] = model
    if model:
        echo(f"\nlatency/throughput model at 32 threads (1/X = l/chunk + 1/B): "
             f"l = {model['latency_us']:.2f} us, B = {model['stream_gbps']:.2f} GB/s -> "
             f"coalescing pays for gaps under l*B = {model['gap_bytes'] / KiB:.1f} KiB "
             f"(FlashReader default {DEFAULT_COALESCE_GAP / KiB:.0f} KiB)")


def measure_overhead(res, path, token_reads, bundle, rng, echo):
    """Each backend's per-read cost (page-cached), and a token-like batch through the Python
    pool (uncached) where both backends exist, into res."""
    ov = per_read_overhead(path, token_reads, bundle, 32)
    res["per_read_overhead"] = ov
    echo(f"\nper-read overhead ({token_reads} x {fmt_size(bundle)} bundles, float16 -> "
         "float32, page-cached, 32 threads):")
    for b, v in ov.items():
        echo(f"  {b:>6}: raw read {v['read']['wall_us']:.2f} us wall, "
             f"{v['read']['cpu_us']:.2f} us CPU; bundle read + convert "
             f"{v['bundles']['wall_us']:.2f} us wall, {v['bundles']['cpu_us']:.2f} us CPU")
    if "python" in ov and "native" in ov:
        # the same uncached token-like batch through the Python pool
        with FlashReader(threads=32, backend="python") as rp:
            tb = token_batch(rp, rp.open(path), token_reads, bundle, rng)
        res["token_batch_python_backend"] = tb
        echo(f"  token-like batch through the Python pool (uncached): "
             f"{tb['seconds'] * 1e3:.0f} ms, {tb['gbps']:.3f} GB/s, "
             f"{tb['cpu_us_per_read']:.1f} us CPU per bundle")


def run(path, size=None, chunks=DEFAULT_CHUNKS, threads=DEFAULT_THREADS, duration=1.0,
        repeat=5, acc_duration=2.0, token_reads=12000, bundle=16 * KiB, use_fio=True,
        backend="auto", grid=True, overhead=True, progress=True, echo=print):
    size = ensure_file(path, size, progress=progress)
    use_fio = use_fio and fio_available()
    if not use_fio:
        echo("fio: not installed, no reference figures (apt-get install fio)")
    res = {
        "file": str(path), "file_bytes": size,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_at_start": os.getloadavg()},
        "reader": {}, "flashreader": {}, "fio_psync": {},
    }
    rng = np.random.default_rng()
    readers = {}

    def reader_for(t, **kw):
        key = (t, tuple(sorted(kw.items())))
        if key not in readers:
            r = FlashReader(threads=t, backend=backend, **kw)
            readers[key] = (r, r.open(path))
        return readers[key]

    try:
        r0, f0 = reader_for(32)
        res["reader"] = {"backend": r0.backend, "uncached": f0.direct, "align": f0.align,
                         "coalesce_gap": r0.coalesce_gap, "max_read": r0.max_read}
        echo(f"file {path}: {size / 1e9:.2f} GB; FlashReader backend {r0.backend}, "
             f"{'uncached (O_DIRECT/F_NOCACHE)' if f0.direct else 'BUFFERED (figures are the page cache)'}, "
             f"align {f0.align}; load average {os.getloadavg()[0]:.2f}")
        if grid:
            measure_grid(res, path, reader_for, chunks, threads, duration, use_fio, rng, echo)
        res["acceptance"] = acceptance(path, reader_for, token_reads, bundle, repeat,
                                       acc_duration, use_fio, rng, echo)
        if overhead:
            measure_overhead(res, path, token_reads, bundle, rng, echo)
    finally:
        for r, _ in readers.values():
            r.close()
    return res


def acceptance(path, reader_for, token_reads, bundle, repeat, duration, use_fio, rng, echo):
    r32, f32 = reader_for(32, coalesce_gap=-1)
    rtok, ftok = reader_for(32)
    rows = []
    echo(f"\nacceptance: {repeat} alternating rounds ({duration:.1f} s each measurement)")
    steps = [("flashreader_32k", lambda: reader_throughput(r32, f32, 32 * KiB, duration, rng))]
    if use_fio:
        steps += [("fio_psync_32k", lambda: fio_throughput(path, 32 * KiB, 32, duration)),
                  ("fio_libaio_32k", lambda: fio_throughput(path, 32 * KiB, 32, duration, "libaio"))]
    steps += [("token_batch", lambda: token_batch(rtok, ftok, token_reads, bundle, rng)),
              ("flashreader_16k", lambda: reader_throughput(r32, f32, bundle, duration, rng))]
    if use_fio:
        steps += [("fio_psync_16k", lambda: fio_throughput(path, bundle, 32, duration)),
                  ("fio_libaio_16k", lambda: fio_throughput(path, bundle, 32, duration, "libaio"))]
    for i in range(repeat):
        row = {}
        # odd rounds run in reverse order: a drifting disk favours nobody
        for name, measure in steps if i % 2 == 0 else steps[::-1]:
            m = measure()
            row[name] = m["gbps"]
            if name == "token_batch":
                row["token_batch_detail"] = m
        row = {name: row[name] for name, _ in steps} | {"token_batch_detail": row["token_batch_detail"]}
        rows.append(row)
        echo("  round %d: %s" % (i + 1, ", ".join(
            f"{k} {v:.3f}" for k, v in row.items() if not k.endswith("detail"))))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if not k.endswith("detail")}
    out = {"rounds": rows, "median_gbps": med, "token_reads": token_reads, "bundle": bundle}
    tb = rows[-1]["token_batch_detail"]
    echo(f"\n  token-like batch: {token_reads} x {fmt_size(bundle)} in {statistics.median(r['token_batch_detail']['seconds'] for r in rows) * 1e3:.0f} ms "
         f"(median); {tb['reads_issued']} reads after coalescing, "
         f"{tb['bytes_read'] / 1e6:.0f} MB read for {tb['bytes_requested'] / 1e6:.0f} MB asked, "
         f"{tb['cpu_us_per_read']:.1f} us CPU per bundle")
    if use_fio:
        ratios = {
            "flashreader_vs_fio_psync_32k": [r["flashreader_32k"] / r["fio_psync_32k"] for r in rows],
            "flashreader_vs_fio_libaio_32k": [r["flashreader_32k"] / r["fio_libaio_32k"] for r in rows],
            "token_vs_fio_psync_16k": [r["token_batch"] / r["fio_psync_16k"] for r in rows],
            "token_vs_fio_libaio_16k": [r["token_batch"] / r["fio_libaio_16k"] for r in rows],
            "token_vs_flashreader_16k": [r["token_batch"] / r["flashreader_16k"] for r in rows],
        }
        out["ratios"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                         for k, v in ratios.items()}
        out["ratio_of_medians"] = {
            "flashreader_vs_fio_psync_32k": med["flashreader_32k"] / med["fio_psync_32k"],
            "token_vs_fio_psync_16k": med["token_batch"] / med["fio_psync_16k"],
        }
        echo("  medians GB/s: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
        for k, v in out["ratios"].items():
            echo(f"  {k:<32} median {v['median']:.3f}  (min {v['min']:.3f}, max {v['max']:.3f})")
        a = out["ratios"]["flashreader_vs_fio_psync_32k"]["median"]
        b = out["ratios"]["token_vs_fio_psync_16k"]["median"]
        out["pass"] = {"flashreader_32k_ge_0.95_fio": a >= 0.95, "token_ge_0.9_device_16k": b >= 0.9}
        echo(f"  acceptance: 32 KiB x 32 threads {a:.3f} x fio psync (>= 0.95: "
             f"{'yes' if a >= 0.95 else 'NO'}); token batch {b:.3f} x fio 16 KiB x 32 "
             f"(>= 0.9: {'yes' if b >= 0.9 else 'NO'})")
    return out


def print_tables(res, chunks, threads, echo):
    def table(title, d):
        echo(f"\n{title} (GB/s)")
        echo("| chunk | " + " | ".join(f"{t} thr" for t in threads) + " |")
        echo("| --- |" + " --- |" * len(threads))
        for c in chunks:
            cells = []
            for t in threads:
                v = d.get(str(c), {}).get(str(t))
                cells.append(f"{v:.2f}" if v is not None else "-")
            echo(f"| {fmt_size(c)} | " + " | ".join(cells) + " |")

    fr = {c: {t: v["gbps"] for t, v in row.items()} for c, row in res["flashreader"].items()}
    table("FlashReader, random uncached reads", fr)
    if res["fio_psync"]:
        fio = {c: {t: v["gbps"] for t, v in row.items()} for c, row in res["fio_psync"].items()}
        table("fio --direct=1 --rw=randread --ioengine=psync --numjobs=T", fio)
        ratio = {c: {t: fr[c][t] / fio[c][t] for t in fio[c] if t in fr.get(c, {})} for c in fio}
        table("FlashReader / fio", ratio)


def write_csv(res, path):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["tool", "chunk_bytes", "threads", "gbps", "iops", "reads", "seconds"])
        for tool in ("flashreader", "fio_psync", "fio_libaio"):
            for c, row in res.get(tool, {}).items():
                for t, v in row.items():
                    w.writerow([tool, c, t, f"{v['gbps']:.4f}", f"{v['iops']:.0f}", v["reads"],
                                f"{v['seconds']:.3f}"])


def write_png(res, path):
    """Figure 2b style: throughput vs chunk size, a line per thread count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fr, fio = res["flashreader"], res.get("fio_psync", {})
    threads = sorted({int(t) for row in fr.values() for t in row})
    chunks = sorted(int(c) for c in fr)
    cmap = plt.get_cmap("viridis")
    for i, t in enumerate(threads):
        color = cmap(i / max(1, len(threads) - 1))
        xs = [c for c in chunks if str(t) in fr[str(c)]]
        ax.plot([c / KiB for c in xs], [fr[str(c)][str(t)]["gbps"] for c in xs], "o-",
                color=color, label=f"{t} threads")
        xs = [c for c in chunks if str(t) in fio.get(str(c), {})]
        if xs:
            ax.plot([c / KiB for c in xs], [fio[str(c)][str(t)]["gbps"] for c in xs], "--",
                    color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks([c / KiB for c in chunks])
    ax.set_xticklabels([fmt_size(c).replace(" ", "") for c in chunks], rotation=45)
    ax.set_xlabel("chunk size (random reads)")
    ax.set_ylabel("throughput (GB/s)")
    ax.set_title("Uncached random reads: FlashReader (solid), fio psync (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_json(res, path):
    Path(path).write_text(json.dumps(res, indent=1, default=float))

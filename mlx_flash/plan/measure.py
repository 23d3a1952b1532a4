"""Measure this machine for the cost model (plan/profile.py holds the result): uncached reads
by size, one decode step's matrix-vector products by weight form, what each layer and each
token cost apart from their bytes, by mode, and how much prefetch hides, from small 4-bit
models decoded through the real runtime.

One file past 500 lines: every rate the cost model reads is measured here, through the same
small models and timing loops."""

import os
import tempfile
import time
from functools import partial
from typing import NamedTuple

import numpy as np

import mlx.core as mx

from ..errors import FlashError
from .profile import VERSION, Profile, _device, curve_gbs, machine_key, profile_path, load_profile

KiB, MiB = 1024, 1024 * 1024
CHUNKS = (2 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB)  # (2 KiB: a 4-bit 7B's neuron row, unbundled)
PROBE_FILE_BYTES = 256 * MiB  # the disk probe's file (its own, written once, then read uncached)
STREAMED_BYTES = 256 * MiB  # the distinct weights a rate cycles through: past any CPU cache


def ensure_profile(path=None, log=None):
    """The cached profile, or a quick one measured now (said) and cached."""
    return load_profile(path, measure=measure, log=log)


def ensure_profile_apart(log=None):
    """ensure_profile for a command about to load a model under --memory-limit: the quick probe
    runs in a child process (`mlx_flash.benchmark profile --quick`), so that the memory its
    probe models and matrices took never counts in this process's measured runtime (the
    allocator keeps freed memory: in-process, a 300 MB limit lost ~100 MB to it)."""
    import subprocess
    import sys

    p = load_profile()
    if p is not None:
        return p
    (log or (lambda m: print(f"[mlx_flash] {m}", file=sys.stderr)))(
        "machine profile: none is cached for this machine; a quick probe now, in a child process "
        "(about 45 s here, once; `mlx_flash.benchmark profile` measures it fully)")
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "benchmark", "profile", "--quick"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise FlashError(f"the machine probe failed: {r.stderr.strip()[-500:]}")
    return load_profile()


def measure(quick=False, file=None, threads=None, seconds=None, progress=None):
    """Measure this machine: the disk on `file` (else a probe file of our own, kept beside
    the profile) and the compute rates. quick: fewer repeats and shorter disk runs."""
    from ..io.reader import READ_THREADS

    threads = threads or READ_THREADS
    seconds = seconds or (0.3 if quick else 1.5)
    say = progress or (lambda _: None)
    notes = []
    if file is None:
        file = probe_file()
    say(f"disk: uncached random reads of {file}, {threads} threads")
    disk = model_disk_curve([file], CHUNKS, threads, seconds, rounds=1 if quick else 3)
    batch_ms = batch_latency(file, disk, threads, batches=30 if quick else 150)
    say("compute: one decode step's matrix-vector products, by weight form")
    compute = compute_rates(repeat=3 if quick else 10, streamed=STREAMED_BYTES // 4 if quick else STREAMED_BYTES)
    positions = PASS_POSITIONS_QUICK if quick else PASS_POSITIONS
    say(f"compute: a batch's decode step ({', '.join(map(str, positions))} sequences), by weight form")
    # (quick: at a 7B FFN matrix's size only, which smaller models' steps are then priced at)
    passes = pass_rates(MATRICES[-1:] if quick else MATRICES, positions, repeat=2 if quick else 4,
                        streamed=STREAMED_BYTES // 4 if quick else STREAMED_BYTES)
    say("per-layer and per-token costs, overlap: 4-bit models of two widths and depths decoded "
        "through the runtime, by mode")
    zero = {m: {1: 0.0} for m in MODES}
    p = Profile(disk, threads, compute, zero, zero, 0.0, machine_key(), mx.__version__, _device(),
                time.strftime("%Y-%m-%d %H:%M:%S"), quick, VERSION, notes)
    say("the reader's conversion: 4-bit rows read into float32 rows, against the reads alone")
    p.pass_compute = passes
    p.convert_ns = convert_cost(threads, rounds=5 if quick else 15)
    p.batch_ms = batch_ms  # (before runtime_costs: its probes' batches are then not a per-layer cost)
    say("the reads' cost to the compute they overlap: a batch step's compute alone and while reading")
    p.read_steal = read_steal(file, threads, seconds=1.0 if quick else 3.0, rounds=1 if quick else 3)
    say("a layer's reads placed into rows: against the reads thrown away, and beside one-position products")
    # (short turns, many, 0.375 s: the effects, 5-15 %, are the size of this disk's drift over seconds)
    placed = placed_reads(file, threads, seconds=1.5 if quick else 9.0, rounds=1 if quick else 8)
    p.read_busy, p.place_s = placed.busy, placed.place_s
    if not placed.rounds:
        notes.append(f"the reads beside compute and their placing: not measured ({file} is smaller than a "
                     "layer's batch, or the disk stalled): taken as 1.0 and 0")
    p.layer_ms, p.token_ms, p.overlap = runtime_costs(p, notes, tokens=8 if quick else 32,
                                                      rounds=1 if quick else 3)
    return p


def probe_file():
    """A file of random bytes for the disk probe (written once; reads of it bypass the cache)."""
    path = profile_path().parent / "disk-probe.bin"
    if path.exists() and path.stat().st_size == PROBE_FILE_BYTES:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".disk-probe")
    rng = np.random.default_rng(0)
    with os.fdopen(fd, "wb") as f:
        for _ in range(PROBE_FILE_BYTES // (16 * MiB)):
            f.write(rng.integers(0, 256, 16 * MiB, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


LAYER_READS = 512  # reads the disk probe issues at once for the cost model: about what a layer's store asks


def model_disk_curve(files, chunks=CHUNKS, threads=None, seconds=1.0, seed=0, rounds=3):
    """The disk as the profile measures it for the cost model (`measure`): LAYER_READS reads at a
    time, the sizes in turn `rounds` times, medians. `benchmark paper` and `benchmark batch`
    probe each round's disk the same way, to predict their rows at it."""
    return disk_curve(files, chunks, threads, seconds, seed=seed, rounds=rounds, batch=LAYER_READS)


def disk_curve(files, chunks, threads=None, seconds=1.0, seed=0, rounds=1, batch=None, contiguous=False):
    """{read size: GB/s} of uncached random reads of `chunks`-sized pieces of `files`, for
    `seconds` a size, `batch` reads at a time (None: 64 MiB of them, the queue kept full: what
    the device can do, for floors; LAYER_READS: what a layer's store issues at once, for the cost
    model: 4.5 KiB reads got 0.25-0.30 GB/s 400 at a time here against 0.28-0.31 in 64 MiB).
    rounds > 1: the sizes in turn, `rounds` times, each for seconds / rounds, the median kept: a
    stall of this VM's disk (30 MB/s for a minute, seen once) then spoils one round of every
    size, not every round of one. contiguous: each batch one run of consecutive pieces from a
    random place (what an exact mode's layer reads: its streamed rows lie together), not pieces
    scattered over the files (a sparse mode's)."""
    from ..io import FlashReader
    from ..io.reader import READ_THREADS

    threads = threads or READ_THREADS
    rng = np.random.default_rng(seed)
    rates = {}
    with FlashReader(threads=threads, direct=True, coalesce_gap=-1) as r:
        fs = [r.open(p) for p in files]
        sizes = [c for c in chunks if c <= min(f.size for f in fs)]
        for _ in range(rounds):
            for c in sizes:
                n_per = max(64, int(64 * MiB // c))
                n_per = n_per if batch is None else min(batch, n_per)
                done, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds / rounds:
                    f = fs[rng.integers(len(fs))]
                    if contiguous:
                        k = min(n_per, f.size // c)
                        offs = (rng.integers(0, f.size // c - k + 1) + np.arange(k)) * c
                    else:
                        offs = rng.integers(0, f.size // c, n_per) * c
                    r.read_discard(f, offs, np.full(offs.size, c))
                    done += offs.size * c
                rates.setdefault(c, []).append(done / (time.perf_counter() - t0) / 1e9)
    return {c: float(np.median(v)) for c, v in rates.items()}


def read_steal(file, threads=None, seconds=1.5, rounds=3, seed=3):
    """Seconds of compute lost a GB read meanwhile. Prefetch reads the next layer while this one
    computes: the reads' block-layer work, their DMA into memory and the checks of their CRC32C
    take from that compute. Measured: a batch step's compute (an FFN layer of 8,192 4-bit neurons
    of width 4,096 times 16 positions through the pass kernels where the CPU has them, else a
    float32 matrix product through MLX) timed alone and while the reader streams `file`
    uncached (256 KiB reads, LAYER_READS at a time, as the disk probe), `rounds` times
    alternating, the median kept; plus the checks' CPU time a GB (the reader checks every read
    on the CPU) over the cores, whose share of it the compute loses. Here 0.10-0.16 s a GB, the
    checks' 0.04 of it: a 4-bit OPT-6.7B batch of 16 at 50 % reads 1.2 GB during a 1.5 s step,
    which takes 0.25-0.3 s longer in hybrid than dense reading nothing. Priced a GB at
    256 KiB reads: reads of a few KiB (flash mode's rows) cost the block layer more a GB, and the
    reader's conversion of rows into float32 (convert_ns) takes from the cores too; neither is in
    it."""
    from ..io import FlashReader
    from ..io.checksum import crc32c
    from ..io.reader import READ_THREADS
    from ..kernels import batched, kernels_module, qmm_cols, qmm_rows

    kernels, _ = kernels_module()
    n, d, positions = 8192, 4096, 16
    rng = np.random.default_rng(seed)
    if batched(kernels):
        f = ffn_rows(n, d, 4, 2)
        offsets = f.spec.inline_offsets(d)
        x = rng.standard_normal((positions, d)).astype(np.float32)

        def step(i):
            up, down = f.layers[i % 2]
            qmm_cols(kernels, qmm_rows(kernels, x, up, f.sel, f.spec, *offsets), down, f.sel, f.trow, f.table, f.spec)
    else:
        ws = [mx.random.normal((n, d), key=mx.random.key(i)) for i in range(2)]
        xm = mx.random.normal((positions, d))

        def step(i):
            mx.eval(xm @ ws[i % 2].T)

    def per_step(s):
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < s:
            step(calls)
            calls += 1
        return (time.perf_counter() - t0) / calls

    lost = []
    per_step(0.2)  # warm
    with FlashReader(threads=threads or READ_THREADS, direct=True, coalesce_gap=-1) as r:
        fh = r.open(file)
        for _ in range(rounds if fh.size >= 4 * KiB else 0):
            alone = per_step(seconds / 2)
            busy, gb, dt = _beside_reads(r, fh, rng, lambda: per_step(seconds / 2))
            if gb >= 0.05 * seconds / 2:  # (a stalled disk: too few bytes to divide by)
                lost.append(max(0.0, (busy - alone) / alone * dt / gb))
    # the checks' CPU time a GB (the native CRC; the NumPy fallback's, on far fewer bytes, runs ~1000x
    # slower and would take minutes over 64 MiB)
    from ..io.checksum import _native

    buf = rng.integers(0, 256, (64 if _native() is not None else 1) * MiB, dtype=np.uint8)
    crc32c(buf[: 64 * KiB])
    t0 = time.perf_counter()
    crc32c(buf)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    checks = (time.perf_counter() - t0) / (buf.nbytes / 1e9) / max(cpus, 1)
    return (float(np.median(lost)) if lost else 0.0) + checks


def _probe_reads(r, fh, rng):
    """-> bytes read: one batch of the disk probe's reads of `fh` (256 KiB, LAYER_READS at a time)."""
    c = min(256 * KiB, fh.size // (4 * KiB) * (4 * KiB))  # (a small file: reads of all of it)
    offs = rng.integers(0, fh.size // c, LAYER_READS) * c
    r.read_discard(fh, offs, np.full(offs.size, c))
    return offs.size * c


def _beside_reads(r, fh, rng, during, batch=_probe_reads):
    """-> (during()'s result, GB read meanwhile, its seconds): batches of uncached reads of `fh`
    through reader `r` (batch(r, fh, rng) -> bytes: by default the disk probe's) streamed by
    another thread while during() runs (which must not use `rng`: the thread draws from it)."""
    import threading

    read, stop, failed = [0], threading.Event(), []

    def stream():
        try:
            while not stop.is_set():
                read[0] += batch(r, fh, rng)
        except Exception as e:  # (said by the caller, not lost in the thread)
            failed.append(e)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        b0, t0 = read[0], time.perf_counter()
        out = during()
        gb, dt = (read[0] - b0) / 1e9, time.perf_counter() - t0
    finally:  # (the thread done before the reader closes)
        stop.set()
        t.join()
    if failed:
        raise FlashError(f"reading {fh.path} beside the compute failed: {failed[0]}")
    return out, gb, dt


LAYER_BUNDLES = 8192  # placed_reads' batch: a hybrid layer's streamed neurons of a 7B at 50 %
LAYER_BUNDLE_BYTES = 4608  # ... each a 4-bit neuron's up and down rows of 4096 values, scales inline


class PlacedReads(NamedTuple):
    busy: float  # the share of their rate alone the reads keep beside a decode's compute (read_busy)
    place_s: float  # s a GB placing them into rows adds to the same reads thrown away (place_s)
    rounds: int  # rounds measured (0: neither measured)


def placed_reads(file, threads=None, seconds=1.5, rounds=3, seed=4):
    """-> PlacedReads: what a layer's uncached reads cost beyond the disk probe's, measured on
    the reads as a store makes them: LAYER_BUNDLES consecutive bundles of a 4-bit 7B's neurons,
    placed into rows (read_bundles: its plan, coalescing, and the copy of each read out of its
    thread's staging slot). Three kinds in turn, `rounds` times (the order turned each round),
    `seconds` in all, the median of the rounds kept:
    - the same byte ranges thrown away (read_discard, as the disk probe reads): place_s is the
      time a GB the placing adds to them. It depends on the disk's rate at the time, like the
      curve measured beside it: ~0.04 s here at 2.2-3.4 GB/s (1.08x and 1.13x their time,
      benchmarks/cost-model/read_paths.txt), ~0 at 1.4, where the copies hide behind the other
      threads' reads;
    - placed, alone;
    - placed beside one-position 4-bit products without pause (a 16384 x 4096 matrix, past the
      CPU's caches, through the native kernels where the CPU has them, else a float32 matrix
      of the same bytes, 16384 x 512, through MLX: on a GPU, what its products leave the
      reads): busy is their rate over the rate alone. The compute's threads hold the cores
      and its products the memory bus, which the reads' block-layer work, completions, copies
      and DMA need too (the other way round from read_steal). Here 0.92-0.95 at 1.5-2.5 GB/s,
      0.995 at 1.4; a hybrid layer's reads of 4-bit OPT-6.7B, placed and checked as its decode
      places them, keep 0.84 beside the same products at 3.4 (benchmarks/cost-model/).
    rounds: the rounds measured; none (a file too small for a layer's batch, a stalled disk):
    busy 1.0 and place_s 0, which measure() notes."""
    from ..io import FlashReader
    from ..io.reader import READ_THREADS
    from ..kernels import QuantMatrix, kernels_module

    kernels, _ = kernels_module()
    n, d, group = 16384, 4096, 64
    rng = np.random.default_rng(seed)
    if kernels is not None:
        m = QuantMatrix.of_host(kernels, rng.integers(0, 2**32, (n, d // 8), dtype=np.uint32),
                                rng.random((n, d // group), dtype=np.float32).astype(np.float16),
                                rng.random((n, d // group), dtype=np.float32).astype(np.float16), 4, group)
        x, y = rng.random(d, dtype=np.float32), np.empty(n, np.float32)

        def product():
            m.matvec(x, y)
    else:
        w, xm = mx.random.normal((n, d // 8)), mx.random.normal((d // 8,))

        def product():
            mx.eval(w @ xm)

    def compute(s):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < s:
            product()

    stride, n_bundles = LAYER_BUNDLE_BYTES, LAYER_BUNDLES
    dst = np.zeros((n_bundles, stride // 4), np.float32)  # (its pages mapped now)
    rows = np.arange(n_bundles, dtype=np.int64)

    def layer(r, fh, rng, place):
        first = rng.integers(0, fh.size // stride - n_bundles + 1)
        if place:
            r.read_bundles(fh, first + rows, stride, [(0, stride // 4, "float32", dst)], rows)
        else:
            r.read_discard(fh, (first + rows) * stride, np.full(n_bundles, stride))
        return n_bundles * stride

    kinds = ("thrown", "alone", "busy")
    turn = seconds / (len(kinds) * max(rounds, 1))
    busy, place = [], []
    compute(0.1)  # warm
    with FlashReader(threads=threads or READ_THREADS, direct=True) as r:
        fh = r.open(file)
        for i in range(rounds if fh.size >= n_bundles * stride else 0):
            rate = {}
            for what in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
                during = (lambda: compute(turn)) if what == "busy" else (lambda: time.sleep(turn))
                _, gb, dt = _beside_reads(r, fh, rng, during, partial(layer, place=what != "thrown"))
                rate[what] = gb / dt
            if min(rate.values()) >= 0.1:  # GB/s (a stalled disk: too few bytes to divide by)
                busy.append(min(1.0, rate["busy"] / rate["alone"]))
                place.append(max(0.0, 1 / rate["alone"] - 1 / rate["thrown"]))
    if not busy:
        return PlacedReads(1.0, 0.0, 0)
    return PlacedReads(float(np.median(busy)), float(np.median(place)), len(busy))


BATCHES = ((1, 4 * KiB), (3, 256 * KiB), (32, 4 * KiB))  # reads x size: a layer's few reads


def batch_latency(file, curve, threads=None, batches=150, seed=2):
    """ms a small batch of uncached reads costs beyond its bytes at the curve's rate: its first
    read's latency and the pool's wake-up, which the curve's deep queue leaves out. BATCHES's
    shapes in turn, `batches` of each, the median time of each shape less its bytes at the
    curve, the median over the shapes. Here 0.2-0.5 ms (1 x 4 KiB took 0.21-0.25 ms against
    0.014 for its bytes; 3 x 256 KiB 0.92-0.98 against 0.50)."""
    from ..io import FlashReader
    from ..io.reader import READ_THREADS

    rng = np.random.default_rng(seed)
    times = {shape: [] for shape in BATCHES}
    with FlashReader(threads=threads or READ_THREADS, direct=True, coalesce_gap=-1) as r:
        f = r.open(file)
        for _ in range(batches):
            for n, c in BATCHES:
                offs = rng.integers(0, f.size // c, n) * c
                t = time.perf_counter()
                r.read_discard(f, offs, np.full(n, c))
                times[n, c].append(time.perf_counter() - t)
    surplus = [1e3 * (np.median(t) - n * c / (curve_gbs(curve, c) * 1e9)) for (n, c), t in times.items()]
    return max(0.0, float(np.median(surplus)))


def convert_cost(threads=None, d=4096, batch=400, rounds=7):
    """ns a value costs the reader when a read's rows are dequantized into float32 on the way (a
    flash store's float cache, a streamed layer's float rows), besides the disk's time: `batch`
    random bundles of two 4-bit rows of d values (a 4-bit 7B's neuron, 4.5 KiB) of a file of our
    own, read into scattered float32 rows of a destination past the CPU's caches, against the
    same reads thrown away, through the page cache (the disk's noise kept out of the
    difference), in alternating rounds, the median kept. The disk curve's probe only throws its
    reads away; in a flash store here the float32 rows written into DRAM (7x the 4-bit bytes
    read) and their conversion cost ~5 us such a read, against 13-14 us for the read itself."""
    from ..io import FlashReader, Quantized
    from ..io.reader import READ_THREADS
    from ..layout.quant import QuantSpec

    row = QuantSpec(4, 64, "float16").row_bytes(d)
    stride = 2 * row
    q = Quantized(4, 64, "float16")
    rng = np.random.default_rng(1)
    spread = 8  # destination rows 8x the batch's (100 MB), drawn at random, as a cache's are
    dst = [np.zeros((spread * batch, d), np.float32) for _ in range(2)]
    for a in dst:
        a.fill(0.0)  # (its pages mapped now, not in the timed reads)
    segments = [(0, d, q, dst[0]), (row, d, q, dst[1])]
    n = 4 * batch
    with tempfile.TemporaryDirectory() as tmp, \
            FlashReader(threads=threads or READ_THREADS, direct=False, coalesce_gap=-1) as r:
        path = os.path.join(tmp, "bundles.bin")  # (written now: in the page cache)
        rng.integers(0, 256, n * stride, dtype=np.uint8).tofile(path)
        f = r.open(path)
        per = []
        for i in range(rounds):  # (the two in turn, each on bundles of its own: none warm in a cache)
            ids = [np.sort(rng.choice(n, batch, replace=False)).astype(np.int64) for _ in range(2)]
            times = {}
            for what in (("discard", "convert") if i % 2 else ("convert", "discard")):
                t = time.perf_counter()
                if what == "discard":
                    r.read_discard(f, ids[0] * stride, np.full(batch, stride))
                else:
                    r.read_bundles(f, ids[1], stride, segments, rng.choice(spread * batch, batch, replace=False))
                times[what] = time.perf_counter() - t
            per.append(times["convert"] - times["discard"])
    return max(0.0, float(np.median(per)) / (batch * 2 * d) * 1e9)


MATRICES = ((1536, 576), (5632, 2048), (11008, 4096))  # a 135M, a 1B and a 7B model's FFN matrix


def compute_rates(sizes=MATRICES, repeat=10, streamed=STREAMED_BYTES):
    """{form: {rows x cols: GB/s}} of weights consumed by x @ W.T for one position (a decode
    step), for each form the runtime holds weights in, through the very modules it uses, at
    FFN-matrix sizes from a 135M model's to a 7B model's."""
    out = {}
    for rows, cols in sizes:
        for form, gbs in _rates_at(rows, cols, max(repeat, int(repeat * 4096 * 11008 / (rows * cols)) // 4),
                                   streamed).items():
            out.setdefault(form, {})[rows * cols] = gbs
    return out


PASS_POSITIONS = (8, 16, 32, 64)  # a batch's decode step: sequences, one new position each
PASS_POSITIONS_QUICK = (16, 32)


def pass_rates(sizes=MATRICES, positions=PASS_POSITIONS, repeat=4, streamed=STREAMED_BYTES):
    """{form: {rows x cols: {positions: GB/s}}} of weights consumed by one decode step of a batch
    (`positions` sequences, one new position each), through the modules and kernels such a step
    runs (kernels.pass_kernels: the pass kernels from SMALL_PASS + 1 to BATCH_PASS sequences,
    where the CPU has them; else dequantized chunks + BLAS), at the FFN-matrix sizes of
    compute_rates. The cost model prices a batch's step from them (plan/cost.py)."""
    from ..kernels import pass_notes_off

    out = {}
    with pass_notes_off():
        for rows, cols in sizes:
            reps = max(6, int(repeat * 4096 * 11008 / (rows * cols)) // 4)
            for p in positions:
                for form, gbs in _rates_at(rows, cols, reps, streamed, positions=p).items():
                    out.setdefault(form, {}).setdefault(rows * cols, {})[p] = gbs
    return out


def _rates_at(rows, cols, repeat, streamed=STREAMED_BYTES, positions=1):
    """Each form's rate over enough distinct copies of the matrix that together they exceed the
    CPU's caches (STREAMED_BYTES), cycled through: a decode step touches each layer's weights
    once, from DRAM; one matrix multiplied again and again would be read from the cache (a 7B
    FFN matrix at 4 bits, 25 MB, fits an EPYC's L3: 17 GB/s there, against ~6 in a model).
    positions: a batch's decode step of that many sequences (x [positions, 1, cols])."""
    import mlx.nn as nn

    from ..kernels import kernels_module
    from ..models.half import Arena, HalfLinear
    from ..models.quantized import NativeQuantizedLinear

    def copies(nbytes):
        return max(1, min(64, -(-streamed // nbytes)))

    def rate(fs, nbytes):
        """The best of three runs of `repeat` products cycling through `fs` (a shared machine's
        other work only slows)."""
        x = mx.random.normal((positions, 1, cols))
        for f in fs:
            mx.eval(f(x))  # warm
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for i in range(repeat):
                mx.eval(fs[i % len(fs)](x))
            best = min(best, time.perf_counter() - t)
        return nbytes * repeat / best / 1e9

    base = mx.random.normal((rows, cols), key=mx.random.key(0)) * 0.02
    mx.eval(base)

    def matrices(n):
        """n matrices, each in memory of its own; drawn once and scaled (MLX's normal draw on
        the CPU took 27 of the quick probe's 33 s here)"""
        for i in range(n):
            w = base * (1.0 + i / 64)
            mx.eval(w)
            yield w

    ws = list(matrices(copies(rows * cols * 4)))
    out = {"float32": rate([lambda x, w=w: x @ w.T for w in ws], ws[0].nbytes)}
    del ws
    on_cpu = mx.default_device() == mx.cpu
    arena = Arena()
    kernels, _ = kernels_module()
    for name, dt in (("float16", mx.float16), ("bfloat16", mx.bfloat16)):
        w16s = [w.astype(dt) for w in matrices(copies(rows * cols * 2))]
        mx.eval(w16s)
        # on the CPU a held weight's decode product runs the native kernels on its 16-bit rows
        # (models/half.py; a held dense FFN too), and without them goes through the float32
        # arena; elsewhere MLX multiplies them as they are
        fs = [HalfLinear(w16, None, arena, kernels) if on_cpu else (lambda x, w16=w16: x @ w16.T) for w16 in w16s]
        out[name] = rate(fs, w16s[0].nbytes)
        del fs, w16s
        if on_cpu and kernels is not None and name == "float16":  # (held FFN rows are float16: as stored)
            out["float16-rows"] = _half_rows_rate(kernels, rows, cols, repeat, copies, positions)
    for bits in (4, 8):
        ms = []
        for w in matrices(copies(rows * cols * bits // 8)):
            q = nn.QuantizedLinear(cols, rows, bias=False, group_size=64, bits=bits)
            q.weight, q.scales, q.biases = mx.quantize(w, group_size=64, bits=bits)
            mx.eval(q.parameters())
            ms.append(NativeQuantizedLinear(q, kernels, arena) if on_cpu and kernels is not None else q)
        nbytes = ms[0].weight.nbytes + ms[0].scales.nbytes + ms[0].biases.nbytes
        out[f"q{bits}"] = rate(ms, nbytes)
        del ms
        if on_cpu and kernels is not None:
            out[f"q{bits}-rows"] = _ffn_rows_rate(kernels, rows, cols, bits, repeat, copies, positions)
    return out


def _half_rows_rate(kernels, n, d, repeat, copies, positions=1):
    """GB/s of an FFN's rows held at float16 (a dense FFN or a hybrid's cache of a float16 model)
    consumed by one token's products, through the kernels FlashFFN runs on them in place
    (models/ffn.py FFNRows.select): n up rows -> gather_mv, then n down rows -> gather_axpy, whose
    sum over rows streams at about half gather_mv's rate here (16.5 against 29.6 GB/s for a
    16,384 x 4,096 float16 matrix; an OPT-6.7B float16 model held dense decoded at 21 GB/s
    where HalfLinear's rate, gather_mv's, priced it at 29). positions > 1: a batch's decode step
    through the tiles (gather_mm, gather_mm_cols) where kernels.pass_kernels takes it, else the
    float32 arena + BLAS the dense store falls back to."""
    from ..kernels import gather_axpy, gather_mm, gather_mm_cols, gather_mv, pass_kernels
    from ..models.half import Arena

    rng = np.random.default_rng(0)
    nbytes = 2 * n * d * 2
    base = (rng.standard_normal((n, d)) * 0.02).astype(np.float32)
    layers = [((base * (1 + i / 64)).astype(np.float16), (base * (1 - i / 64)).astype(np.float16))
              for i in range(copies(nbytes))]
    sel = np.arange(n, dtype=np.int64)
    x = rng.standard_normal((positions, d)).astype(np.float32)
    tiles = positions > 1 and pass_kernels(kernels, mx.zeros((positions, 1, d)))
    arena = Arena(2 * n * d) if positions > 1 and not tiles else None

    def layer(i):
        up, down = layers[i % len(layers)]
        if positions == 1:
            gather_axpy(kernels, gather_mv(kernels, x[0], up, sel), down, sel)
        elif tiles:
            gather_mm_cols(kernels, gather_mm(kernels, x, up, sel), down, sel)
        else:  # the dense store's fallback: the layer converted into a float32 arena for BLAS
            w = arena.fill_rows({"up": up, "down": down}, 1)  # (1: float16, models/half.py's code)
            mx.eval((mx.array(x) @ w["up"].T) @ w["down"])

    return _layers_rate(layer, len(layers), repeat, nbytes)


def _ffn_rows_rate(kernels, n, d, bits, repeat, copies, positions=1):
    """GB/s of a quantized FFN's rows consumed by one token's products, through the kernels
    FlashFFN runs on them (models/ffn.py `_packed`): n up rows (scales inline) -> qmv_rows, then n
    down columns (their scales in the layer's table) -> qaxpy_cols, each kind's rows contiguous as
    the stores hold them. Not the resident matrices' rate: the column kernel runs ~30 % slower a
    byte here, and an OPT-6.7B-shaped model's FFN computed at 7 GB/s where its attention took 9.
    Every row of the layer, in runs of 64 sharing a scale-table row: a sparse selection of a few
    rows a run (flash mode's packed caches) pays the runs' fixed costs more often.
    positions > 1: a batch's decode step, as FlashFFN._packed_parts runs it: the pass kernels
    (qmm_rows, qmm_cols) where kernels.pass_kernels takes it, else 4 MiB chunks of rows
    dequantized and multiplied by MLX (_packed_chunks)."""
    from ..kernels import dequantize_cols, dequantize_rows, pass_kernels, qaxpy_cols, qmm_cols, qmm_rows, qmv_rows

    nbytes = n * ffn_row_bytes(d, bits)
    f = ffn_rows(n, d, bits, copies(nbytes))
    offsets = f.spec.inline_offsets(d)
    x = np.ascontiguousarray(np.tile(f.x, (positions, 1)))
    kernel_pass = positions > 1 and pass_kernels(kernels, mx.zeros((positions, 1, d)))  # (the runtime's own rule)
    step = max(1, (1 << 20) // d)  # FlashFFN.PACKED_CHUNK_VALUES a chunk

    def layer(i):
        up, down = f.layers[i % len(f.layers)]
        if positions == 1:
            h = qmv_rows(kernels, f.x, up, f.sel, f.spec, *offsets)
            qaxpy_cols(kernels, h, down, f.sel, f.trow, f.table, f.spec)
        elif kernel_pass:
            qmm_cols(kernels, qmm_rows(kernels, x, up, f.sel, f.spec, *offsets), down, f.sel, f.trow, f.table, f.spec)
        else:
            y, xm = None, mx.array(x)
            for a in range(0, n, step):
                at = slice(a, min(a + step, n))
                w_up = mx.array(dequantize_rows(kernels, up, f.sel[at], f.spec, *offsets, d))
                w_down = mx.array(dequantize_cols(kernels, down, f.sel[at], f.trow[at], f.table, f.spec))
                part = (xm @ w_up.T) @ w_down
                y = part if y is None else y + part
                mx.eval(y)

    return _layers_rate(layer, len(f.layers), repeat, nbytes)


def _layers_rate(layer, count, repeat, nbytes):
    """GB/s of `nbytes` a call of layer(i): every one of the `count` distinct layers once (warm),
    then the best of three runs of `repeat` calls cycling through them."""
    for i in range(count):
        layer(i)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for i in range(repeat):
            layer(i)
        best = min(best, time.perf_counter() - t)
    return nbytes * repeat / best / 1e9


class FFNRows(NamedTuple):
    """Random packed rows of `len(layers)` FFN layers as the stores hold them, for timing the
    kernels FlashFFN runs on them (the values do not matter to the time; the bytes must be
    distinct): per layer (up rows with their scales inline, down columns), the down columns'
    scale table, every row selected in runs of 64 sharing a table row, a token's vector."""

    spec: object  # layout.quant.QuantSpec: bits, group 64, float16 scales
    layers: list  # [(up uint8 [n, row_bytes], down uint8 [n, packed_bytes])]
    table: tuple  # (scales, biases) float16 [n / 64, d]
    sel: np.ndarray
    trow: np.ndarray
    x: np.ndarray


def ffn_row_bytes(d, bits):
    """Bytes of one neuron's up row (scales inline) and down column at `bits`, group 64."""
    from ..layout.quant import QuantSpec

    spec = QuantSpec(bits, 64, "float16")
    return spec.row_bytes(d) + spec.packed_bytes(d)


def ffn_rows(n, d, bits, count):
    """FFNRows of `count` layers of n neurons of width d."""
    from ..layout.quant import QuantSpec

    spec = QuantSpec(bits, 64, "float16")
    rng = np.random.default_rng(0)
    layers = [(rng.integers(0, 256, (n, spec.row_bytes(d)), dtype=np.uint8),
               rng.integers(0, 256, (n, spec.packed_bytes(d)), dtype=np.uint8)) for _ in range(count)]
    table = tuple((rng.standard_normal((n // 64, d)) * 0.01).astype(np.float16) for _ in range(2))
    sel = np.arange(n, dtype=np.int64)
    return FFNRows(spec, layers, table, sel, sel // 64, rng.standard_normal(d).astype(np.float32))


# width: (4, 36 layers), 4-bit. 36, not 12: the slope between 4 and 12 layers moved 3x from
# run to run here (0.45-1.45 ms a layer at d576, against ~1.0-1.1 fitted over 4-48 layers),
# since a few ms of noise on the deeper probe divide by 8 layers, not 32; and 36 layers of
# d576 (72 MB at 4 bits) are past a CPU's last-level cache, as a real model's layers are
PROBES = {128: ("tiny-llama", "tiny-llama-36"), 576: ("probe-576", "probe-576-36")}
MODES = ("dense", "hybrid", "naive")


# long: one probe read top to bottom: its decode() step, then the slopes and the overlap fitted from it
def runtime_costs(rates, notes, tokens=32, rounds=3):
    """-> (layer_ms, token_ms, overlap): what a decode token costs besides its bytes, by mode
    and width, and the share of min(I/O, compute) prefetch hides on this machine.

    Each probe is decoded through the real runtime after a 64-token prompt, without prefetch,
    `rounds` times alternating (the median kept), less the time its store waited for its reads (as
    the store measured it: the disk's drift and the I/O model's own error kept out, where a
    predicted read time would move the per-layer costs with the disk) and the cost
    model's compute time for its bytes (`rates`: a Profile of the compute rates just measured, no
    other cost): the slope of the rest between 4 and 36 layers is
    the per-layer cost, what is left at 4 layers the per-token one. Then the deeper 576-wide
    probe in naive mode (it reads every row) with prefetch and without, alternating `rounds`
    times: the time prefetch saves over the time it could save. notes: the profile's list, where
    an overlap that could not be measured is said."""
    import mlx_flash

    from ..convert.random_model import build_checkpoint
    from ..io import device
    from .cost import predict, read_steal_ms

    layer_ms, token_ms = {}, {}
    with tempfile.TemporaryDirectory(prefix="mlx-flash-probe") as home:
        folders = {shape: build_checkpoint(shape, "q4", home=home, progress=False)
                   for pair in PROBES.values() for shape in pair}

        def decode(shape, mode, prefetch):
            """-> (median ms per token, the cost model's Work of the run, `rates` with the disk
            at the rate it delivered during the run where it read enough to time it: this
            machine's disk drifts ~2x from minute to minute, and a read time taken at the
            curve's rate would move into the per-layer cost; the median ms a token waited for
            its reads, as the store measured it)"""
            streams = {} if mode == "dense" else {"memory_budget": "60%", "prefetch": prefetch}
            model, _ = mlx_flash.load(folders[shape], mode=mode, progress=False, **streams)
            before = device.counters(folders[shape])
            stats = getattr(model.runtime.store, "stats", None)
            ms = _decode_ms(model, tokens)
            gbs = device.rate(before, device.counters(folders[shape]))
            waited = 0.0
            if stats is not None:
                stats.end()
                waited = float(np.median([r["io_ms"] for r in stats.rows if r["tokens"] == 1][-tokens:]))
            work = model.runtime.work()
            model.runtime.close()
            at = rates.at_run_disk(gbs, work.read_size) if gbs is not None and work.read_bytes else rates
            return ms, work, at, waited

        rest = {}  # (width, mode, shape) -> [ms besides the bytes, one a round], layers
        for _ in range(rounds):  # (rounds alternate the runs: the machine's load drifts)
            for width, pair in PROBES.items():
                for mode in MODES:
                    for shape in pair:
                        # the read time as the store waited it, not as predicted: the disk's
                        # minute-to-minute drift (and the model's error for it) then stays out of
                        # the per-layer cost (a predicted read time puts it in: 0.74-1.32 ms a
                        # layer for hybrid at d576 in two profiles an hour apart)
                        ms, work, at, waited = decode(shape, mode, False)
                        rest.setdefault((width, mode, shape), ([], work.n_layers))[0].append(
                            ms - waited - predict(work, at).compute_ms)
        for width, (shallow, deep) in PROBES.items():
            for mode in MODES:
                (r4, l4), (rd, ld) = [(float(np.median(rest[width, mode, s][0])), rest[width, mode, s][1])
                                        for s in (shallow, deep)]
                per_layer = max(0.0, (rd - r4) / (ld - l4))
                layer_ms.setdefault(mode, {})[width] = per_layer
                token_ms.setdefault(mode, {})[width] = max(0.0, r4 - l4 * per_layer)
        on, off, io = [], [], []
        width = 576
        deep = PROBES[width][1]
        for _ in range(rounds):
            ms_off, work, at, _ = decode(deep, "naive", False)
            ms_on, _, _, _ = decode(deep, "naive", True)
            off.append(ms_off)
            on.append(ms_on)
            # (the disk's rate in the run without prefetch: no compute beside its reads)
            io.append(predict(work, at).io_ms)
    # What prefetch could hide, over all layers but one: the I/O (its bytes at the rate the disk
    # delivered during the runs) or the compute, whichever is less. The compute is measured (the
    # run without prefetch less its I/O and what a token costs once, which cost.predict keeps out
    # of the share too), not predicted from the per-layer costs above: a few ms of their error
    # put the share past 1 (clipped) in every profile of this machine, while benchmark peers'
    # SmolLM2 naive rows ran 1.2-1.45x slower than predicted; measured so, 0.75-1.0.
    t_off, t_io, L = float(np.median(off)), float(np.median(io)), work.n_layers
    compute = t_off - t_io - token_ms["naive"][width]
    saved = t_off - float(np.median(on))
    # the run with prefetch also paid what its reads cost the compute they overlapped, which
    # cost.predict adds apart (read_steal): added back, so that the share is not net of it twice;
    # and what prefetch could hide is what cost.predict hides at a share 1: min(I/O, read_busy x
    # the compute with that cost), the reads beside compute at their share of the rate alone
    steal = read_steal_ms(rates, work.read_bytes + work.kv_read_bytes, compute, t_io)
    saved += steal
    hideable = min(t_io, rates.read_busy * (compute + steal)) * (L - 1) / L
    overlap = float(np.clip(saved / hideable, 0.0, 1.0)) if hideable > 0 else 0.0
    if hideable <= 0:
        notes.append(f"overlap: not measurable (the probe without prefetch took {t_off:.1f} ms a token, its "
                     f"I/O {t_io:.1f} at the disk's rate): taken as 0, prefetch predicted to hide nothing")
    return layer_ms, token_ms, overlap


def _decode_ms(model, tokens):
    """Median ms of one decode step after a 64-token prompt (two warm-up steps)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 65))]), cache=cache))
    x = mx.array([[1]])
    times = []
    for _ in range(tokens + 2):
        t = time.perf_counter()
        mx.eval(model(x, cache=cache))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times[2:]))

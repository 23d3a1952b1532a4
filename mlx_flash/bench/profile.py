"""Measure this machine for the cost model (plan/profile.py holds the result): uncached reads
by size, one decode step's matrix-vector products by weight form, and what each layer costs
apart from its bytes, by mode, from a tiny model decoded through the real runtime."""

import os
import tempfile
import time

import numpy as np

import mlx.core as mx

from ..plan.profile import VERSION, Profile, _device, machine_key, profile_path, load_profile

KiB, MiB = 1024, 1024 * 1024
CHUNKS = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB)
PROBE_FILE_BYTES = 256 * MiB  # the disk probe's file (its own, written once, then read uncached)


def ensure_profile(path=None, log=None):
    """The cached profile, or a quick one measured now (said) and cached."""
    return load_profile(path, measure=measure, log=log)


def measure(quick=False, file=None, threads=None, seconds=None, progress=None):
    """Measure this machine: the disk on `file` (else a probe file of our own, kept beside
    the profile) and the compute rates. quick: fewer repeats and shorter disk runs."""
    from ..io.reader import READ_THREADS

    threads = threads or READ_THREADS
    seconds = seconds or (0.3 if quick else 1.5)
    say = progress or (lambda _: None)
    notes = []
    if file is None:
        file = _probe_file()
    say(f"disk: uncached random reads of {file}, {threads} threads")
    disk = disk_curve([file], CHUNKS, threads, seconds)
    say("compute: one decode step's matrix-vector products, by weight form")
    compute = compute_rates(repeat=3 if quick else 10)
    say("per-layer overhead: 4-bit models of two widths decoded through the runtime, by mode")
    p = Profile(disk, threads, compute, {m: {1: 0.0} for m in ("dense", "hybrid", "naive")}, machine_key(),
                mx.__version__, _device(), time.strftime("%Y-%m-%d %H:%M:%S"), quick, VERSION, notes)
    p.layer_ms = layer_overheads(p, tokens=8 if quick else 32)
    return p


def _probe_file():
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


def disk_curve(files, chunks, threads=None, seconds=1.0, seed=0):
    """{read size: GB/s} of uncached random reads of `chunks`-sized pieces of `files`."""
    from ..io import FlashReader
    from ..io.reader import READ_THREADS

    threads = threads or READ_THREADS
    rng = np.random.default_rng(seed)
    out = {}
    with FlashReader(threads=threads, direct=True, coalesce_gap=-1) as r:
        fs = [r.open(p) for p in files]
        for c in [c for c in chunks if c <= min(f.size for f in fs)]:
            n_per = max(64, int(64 * MiB // c))
            done, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                f = fs[rng.integers(len(fs))]
                offs = rng.integers(0, f.size // c, n_per) * c
                r.read_discard(f, offs, np.full(n_per, c))
                done += n_per * c
            out[c] = done / (time.perf_counter() - t0) / 1e9
    return out


MATRICES = ((1536, 576), (5632, 2048), (11008, 4096))  # a 135M, a 1B and a 7B model's FFN matrix


def compute_rates(sizes=MATRICES, repeat=10):
    """{form: {rows x cols: GB/s}} of weights consumed by x @ W.T for one position (a decode
    step), for each form the runtime holds weights in, through the very modules it uses, at
    FFN-matrix sizes from a 135M model's to a 7B model's."""
    out = {}
    for rows, cols in sizes:
        for form, gbs in _rates_at(rows, cols, max(repeat, int(repeat * 4096 * 11008 / (rows * cols)) // 4)).items():
            out.setdefault(form, {})[rows * cols] = gbs
    return out


def _rates_at(rows, cols, repeat):
    import mlx.nn as nn

    from ..kernels import kernels_module
    from ..models.half import Arena, HalfLinear
    from ..models.quantized import NativeQuantizedLinear

    def rate(f, nbytes):
        """The best of three runs of `repeat` products (a shared machine's other work only slows)."""
        x = mx.random.normal((1, 1, cols))
        mx.eval(f(x))  # warm
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(repeat):
                mx.eval(f(x))
            best = min(best, time.perf_counter() - t)
        return nbytes * repeat / best / 1e9

    w = mx.random.normal((rows, cols)) * 0.02
    mx.eval(w)
    out = {"float32": rate(lambda x: x @ w.T, w.nbytes)}
    on_cpu = mx.default_device() == mx.cpu
    arena = Arena()
    for name, dt in (("float16", mx.float16), ("bfloat16", mx.bfloat16)):
        w16 = w.astype(dt)
        mx.eval(w16)
        # on the CPU held weights go through the float32 arena (models/half.py); elsewhere MLX
        # multiplies them as they are
        product = HalfLinear(w16, None, arena) if on_cpu else (lambda x, w16=w16: x @ w16.T)
        out[name] = rate(product, w16.nbytes)
    kernels, _ = kernels_module()
    for bits in (4, 8):
        q = nn.QuantizedLinear(cols, rows, bias=False, group_size=64, bits=bits)
        q.weight, q.scales, q.biases = mx.quantize(w, group_size=64, bits=bits)
        mx.eval(q.parameters())
        nbytes = q.weight.nbytes + q.scales.nbytes + q.biases.nbytes
        m = NativeQuantizedLinear(q, kernels, arena) if on_cpu and kernels is not None else q
        out[f"q{bits}"] = rate(m, nbytes)
    return out


PROBES = ("tiny-llama", "probe-576")  # 4-layer 4-bit models of width 128 and 576 (bench/random_model.py)


def layer_overheads(rates, tokens=32):
    """{mode: {d_model: ms}}: what a decode token costs per layer besides its bytes, by mode, at
    the probes' widths: each probe decoded through the real runtime after a 64-token prompt,
    less the cost model's time for its bytes (`rates`: a Profile of the disk and compute rates
    just measured, no layer cost), over its layers. It grows with the width (more work per
    MLX op), not only with the bytes."""
    import mlx_flash
    from mlx_lm.models.cache import make_prompt_cache

    from ..plan.cost import predict
    from .random_model import build_checkpoint

    out = {}
    with tempfile.TemporaryDirectory(prefix="mlx-flash-probe") as home:
        for shape in PROBES:
            folder = build_checkpoint(shape, "q4", home=home, progress=False)
            for mode in ("dense", "hybrid", "naive"):
                model, _ = mlx_flash.load(folder, mode=mode, memory_budget=None if mode == "dense" else "60%",
                                          progress=False)
                rt = model.runtime
                cache = make_prompt_cache(model)
                mx.eval(model(mx.array([list(range(1, 65))]), cache=cache))
                x = mx.array([[1]])
                times = []
                for i in range(tokens + 2):
                    t = time.perf_counter()
                    mx.eval(model(x, cache=cache))
                    times.append(time.perf_counter() - t)
                bytes_ms = predict(rt.work(), rates).total_ms
                rt.close()
                L = len(model.layers)
                out.setdefault(mode, {})[rt.manifest.layout.d_model] = max(
                    0.0, (1e3 * float(np.median(times[2:])) - bytes_ms) / L)
    return out

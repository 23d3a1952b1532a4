"""The paper's experiments on this machine: `mlx_flash.benchmark paper`.

One process, one random checkpoint of a real shape (random_model.py), the real
runtime (FlashStore, FlashReader with uncached reads, neuron caches, the
model's MLX compute), sparsity from a statistical trace fitted to the paper
(trace.py). The resident weights are loaded once; each configuration gets its
own store under the same memory budget:

  naive       every FFN weight read from flash every token (attention and
              embeddings resident: our runtime never streams them)
  hybrid      as much of every FFN as the budget leaves resident, the rest read
              every token (no sparsity)
  predictor   the predicted neurons read every token, nothing reused (window 0),
              up and down rows read separately (no bundling)
  windowing   predictor + the sliding window (k = 5), no bundling
  all         predictor + window + row-column bundling (one read per neuron)

Per configuration: a few prompt tokens, `warmup` decode tokens that fill the
window, then `tokens` measured decode tokens. Rows of the paper's Table 2
(flash->DRAM per token, throughput, I/O latency, FFN bytes in DRAM) and
Table 3 (I/O, memory management, predictor, compute, total), with the
physical floor of each row: bytes read / the disk's uncached throughput at
that row's read size (measured on the checkpoint's own files in this run) +
weights the compute touches / the memory bandwidth (measured in this run).

Figure 7 (window size vs DRAM vs latency) and Figure 8 (I/O latency per
token over a long generation) drive the store alone (no attention/FFN compute:
what they plot is the loading).

Past 500 lines because the run, its floors and its report read the same row
dictionaries; the report half (from "--- reports") is the piece to move out
when it grows again.
"""

import csv
import gc
import json
import platform
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

import mlx.core as mx

from ..convert.random_model import build_checkpoint
from ..errors import FlashError
from ..io import READ_THREADS
from ..plan.measure import disk_curve, model_disk_curve
from ..plan.profile import curve_gbs
from .trace import TraceModel, TraceSource

CONFIGS = {  # name: (mode, window, bundled, predictor, overlap)
    "naive": ("naive", None, True, False, False),
    "hybrid": ("hybrid", None, True, False, False),
    "predictor": ("flash", 0, False, True, False),
    "windowing": ("flash", 5, False, True, False),
    "all": ("flash", 5, True, True, False),
    # mlx_flash's default on top of the paper's "all": a layer's missing neurons are read
    # while the FFN computes on its cached ones
    "all+overlap": ("flash", 5, True, True, True),
}
UNCHECKED = "/unchecked"  # a row name's suffix: that row's reads skip their CRC32C checks


def row_config(name):
    """'all/unchecked' -> ('all', False): the configuration and whether its reads are checked."""
    base = name[: -len(UNCHECKED)] if name.endswith(UNCHECKED) else name
    if base not in CONFIGS:
        raise FlashError(f"unknown configuration '{name}' (available: {', '.join(CONFIGS)}, each "
                         f"also as NAME{UNCHECKED})")
    return base, not name.endswith(UNCHECKED)
KiB, MiB = 1024, 1024 * 1024


# --- the machine's limits, measured in this run


def memory_bandwidth(nbytes=1 << 30, repeat=5):
    """GB/s of a float32 reduction over a large array (the weights' path to the cores)."""
    a = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(a)
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval(mx.sum(a))
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    del a
    return best


def matvec_bandwidth(rows=16384, cols=4096, repeat=10):
    """GB/s of a float32 matrix-vector product (what a decode step's compute runs at)."""
    w = mx.random.normal((rows, cols))
    x = mx.random.normal((1, cols))
    mx.eval(w, x)
    mx.eval(x @ w.T)
    t = time.perf_counter()
    for _ in range(repeat):
        mx.eval(x @ w.T)
    gbps = w.nbytes * repeat / (time.perf_counter() - t) / 1e9
    del w
    return gbps


# --- the runs


def attach(model, config, trace, budget, threads, predictor_rank, window=None, verify=True):
    """A fresh runtime for `config` on the loaded model (the last one released); returns its store.
    window: another window than the configuration's (Figure 7); verify: check every read's
    CRC32C (what users run; --no-verify measures without)."""
    from ..runtime import FlashConfig, rebuild_runtime

    config, checked = row_config(config)
    verify = verify and checked
    mode, cfg_window, bundled, predictor, overlap = CONFIGS[config]
    source = None
    if mode == "flash":
        source = TraceSource(trace, model.runtime.manifest.layout.d_model,
                             predictor_rank=predictor_rank if predictor else 0)
    # the loaded model's compute dtype: float32 on the CPU, the flash dtype on a GPU (its header says which)
    cfg = FlashConfig(dtype=model.runtime.compute_dtype, verify=verify, mode=mode, memory_budget=budget, threads=threads,
                      window=cfg_window if window is None else window, bundled=bundled,
                      prefetch=False, overlap=overlap)
    store = rebuild_runtime(model, cfg, source=source).store
    store.timed = True  # the phases' times must be the phases' (a staged store skips that sync otherwise)
    return store


def release(model):
    """Close the model's runtime (its reader, worker and caches) and give the memory back."""
    model.runtime.close()
    gc.collect()
    mx.clear_cache()


def decode(model, store, prompt, warmup, tokens, folder=None):
    """Prompt, warmup tokens, then `tokens` measured decode tokens -> (per-token stats rows,
    their wall times, the GB/s the disk holding `folder` delivered during them or None)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..io import device

    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    walls, disk = [], []
    for i in range(warmup + tokens + 1):
        if folder is not None and i in (warmup, warmup + tokens):
            disk.append(device.counters(folder))
        t = time.perf_counter()
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        walls.append(1e3 * (time.perf_counter() - t))
    store.stats.end()
    rows = [r for r in store.stats.rows if r["tokens"] == 1][warmup: warmup + tokens]
    return rows, walls[warmup: warmup + tokens], device.rate(*disk) if len(disk) == 2 else None


def summarize(config, rows, walls, store, plan, resident_bytes, curve, mem_bw, source_stats=None):
    mean = {k: float(np.mean([r[k] for r in rows])) for k in
            ("io_ms", "mem_ms", "predict_ms", "compute_ms", "total_ms", "bytes_read", "reads",
             "hit_rate", "active")}
    wall = float(np.median(walls))
    read_size = mean["bytes_read"] / mean["reads"] if mean["reads"] else 0
    # the FFN rows a token computes on: flash mode on the CPU, its active ones (FFNRows.select);
    # else every row held (the window's, masked; naive / hybrid: all of them)
    selected = getattr(store, "source", None) is not None and getattr(store, "kernels", None) is not None
    ffn_rows = mean["active"] if selected else store.held_rows
    neuron_bytes = plan.neuron_bytes  # as the store holds a row: float32, or a bundle's packed bytes
    computed = resident_bytes + plan.source_bytes + ffn_rows * neuron_bytes
    row = {
        "config": config,
        "flash_to_dram_gb": mean["bytes_read"] / 1e9,
        "reads": mean["reads"],
        "read_kib": read_size / KiB,
        "throughput_gbs": mean["bytes_read"] / 1e9 / (mean["io_ms"] / 1e3) if mean["io_ms"] else 0.0,
        "io_ms": mean["io_ms"],
        "mem_ms": mean["mem_ms"],
        "predict_ms": mean["predict_ms"],
        "compute_ms": mean["compute_ms"],
        "total_ms": wall,
        "ffn_dram_gb": store.held_rows * neuron_bytes / 1e9,
        "ffn_dram_alloc_gb": plan.ffn_dram_bytes / 1e9,
        "weights_dram_gb": plan.weights_bytes / 1e9,
        "hit_rate": mean["hit_rate"],
        "computed_gb": computed / 1e9,
        "computed_rows": ffn_rows,
        "tokens": len(rows),
    }
    refloor(row, curve, mem_bw)  # floor_io_ms, floor_mem_ms, floor_ms, measured_over_floor, ...
    if source_stats and source_stats["active"]:
        s = source_stats
        row["predictor_fn"] = s["missed"] / s["active"]
        row["predictor_fp"] = s["extra"] / s["active"]
    return row


def add_prediction(row, runtime, store, profile, disk_gbs=None, run_curve=None):
    """The cost model's time beside the measured one (plan/cost.py), where a profile is cached:
    an exact row's from its plan alone; a flash row's from the bytes and reads it measured and
    the rows it computed (the sparsity decides those; the model then predicts their time) and its
    predictors' weights, with naive's per-layer cost, flash mode not being probed; its overlap
    hides reads behind the cached rows' compute only. Again with the disk curve measured on the
    checkpoint in this round (`run_curve`: the disk's drift since the profile set apart), and at
    the rate the device's counters gave during the decode (`disk_gbs`)."""
    from ..plan.cost import Work, converts, predict, predict_at_disk_rate

    row["decode_disk_gbs"] = disk_gbs
    if profile is None:
        return
    lay, plan = runtime.manifest.layout, runtime.plan
    work = runtime.work()  # (an exact row's; None in flash mode)
    if work is None:
        computed = dict(runtime.resident_work)
        form = f"q{lay.quant.bits}-rows" if getattr(store, "packed", False) else "float32"
        rows = row["computed_rows"] * plan.neuron_bytes  # (all layers')
        computed[form] = computed.get(form, 0) + rows
        # the predictors' products (the row's predictor column): float32 matrices a token multiplies by
        computed["float32"] = computed.get("float32", 0) + plan.source_bytes
        read_rows = int(row["computed_rows"] * (1 - row["hit_rate"]))  # (the rows read, gaps aside)
        # the overlap (a layer's missing rows read while its cached rows compute) hides reads
        # behind the cached rows' compute, not behind attention's; its cache appends the new rows
        # after moving rows into the holes of those that left: about one row moved a row read
        overlaps = runtime.config.overlaps
        work = Work(int(row["flash_to_dram_gb"] * 1e9), max(1, int(row["read_kib"] * KiB)), computed,
                    overlaps, plan.n_layers, "naive", lay.d_model * lay.n_neurons, lay.d_model,
                    converted_values=read_rows * len(lay.kinds) * lay.d_model
                    if converts(lay, getattr(store, "packed", False)) else 0,
                    placed_bytes=0 if converts(lay, getattr(store, "packed", False))
                    else int(row["flash_to_dram_gb"] * 1e9),
                    hideable={form: rows * row["hit_rate"]},
                    moved_bytes=read_rows * plan.neuron_bytes if overlaps else 0,
                    # a layer's missing rows: one batch, or one a weight kind unbundled
                    read_batches=plan.n_layers * (1 if runtime.config.bundled else len(lay.kinds)))
    try:
        predicted = predict(work, profile).total_ms
    except FlashError:  # (a profile without this weight form's rate)
        return
    row["predicted_ms"] = predicted
    row["measured_over_predicted"] = row["total_ms"] / predicted
    if run_curve:
        row["predicted_run_curve_ms"] = predict(work, replace(profile, disk=dict(run_curve))).total_ms
        row["measured_over_predicted_run_curve"] = row["total_ms"] / row["predicted_run_curve_ms"]
    # and at the rate the disk delivered while the row decoded (none where it gave no rate)
    at = predict_at_disk_rate(work, profile, disk_gbs)
    if at is not None:
        row["predicted_run_disk_ms"] = at.total_ms
        row["measured_over_predicted_run_disk"] = row["total_ms"] / at.total_ms


def refloor(row, curve, mem_bw):
    """The row's floor again, with the best disk curve and memory bandwidth the run saw.

    A floor is what the device can do: on a shared machine one measurement can be
    slowed by a neighbour, which would make the floor too high (measured / floor < 1)."""
    read_size = row["read_kib"] * KiB
    disk_bw = curve_gbs(curve, read_size) if read_size else float("inf")
    io_floor = 1e3 * row["flash_to_dram_gb"] / disk_bw if row["flash_to_dram_gb"] else 0.0
    mem_floor = 1e3 * row["computed_gb"] / mem_bw
    row.update(disk_gbs_at_read_size=disk_bw, floor_io_ms=io_floor, floor_mem_ms=mem_floor,
               floor_ms=io_floor + mem_floor, measured_over_floor=row["total_ms"] / (io_floor + mem_floor),
               io_over_floor=row["io_ms"] / io_floor if io_floor else None)
    return row


def median_row(rows):
    """Per-key median of one configuration's rounds (each round's figures stay in `rounds`); a
    figure only some rounds have (the disk's rate during a decode): the median of theirs."""
    out = dict(rows[0])
    for k in dict.fromkeys(k for r in rows for k in r):
        vals = [r[k] for r in rows if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if vals:
            out[k] = float(np.median(vals))
    out["tokens"] = sum(r["tokens"] for r in rows)
    out["rounds"] = [dict(r) for r in rows]
    return out


def drive_store(store, d_model, tokens, warmup=5):
    """The store alone, token after token (Figures 7, 8): per-token stats rows."""
    x = mx.random.normal((1, 1, d_model))
    mx.eval(x)
    for _ in range(warmup + tokens):
        for layer in range(len(store.files)):
            store.rows(layer, x)
    store.stats.end()
    return store.stats.rows[warmup:]


@dataclass
class Subject:
    """One checkpoint of the run (a dtype on flash); its model while its rows run."""

    dtype: str
    folder: Path
    manifest: object
    resident_dtype: str | None
    model: object = None
    resident_bytes: int = 0
    held: str | None = None  # the runtime's resident dtype, as reported


def open_subject(sub):
    """Load the subject's model (resident weights) unless it is loaded; -> the model."""
    from ..loader import load

    if sub.model is None:
        sub.model, _ = load(sub.folder, mode="naive", verify=False, prefetch=False,
                            resident_dtype=sub.resident_dtype)
        sub.resident_bytes = sub.model.runtime.resident.held_bytes
        sub.held = sub.model.runtime.resident_dtype
        release(sub.model)
    return sub.model


def close_subject(sub):
    """Drop the subject's model: several dtypes' resident weights and caches would not fit
    together at 7B (float16's float32 attention is 9 GB)."""
    if sub.model is not None:
        sub.model = None
        gc.collect()
        mx.clear_cache()


def load_subject(shape, dtype, home, progress, verify, resident_dtype, log):
    from ..layout.format import read_manifest

    folder = build_checkpoint(shape, dtype, home=home, progress=progress)
    manifest = read_manifest(folder)
    log(f"checkpoint {folder} ({shape}, {dtype} on flash; reads {'checked' if verify else 'unchecked'})")
    # A quantized checkpoint's resident weights are held at their bits unless told (on the
    # CPU: the native quantized matvec, models/quantized.py)
    return Subject(dtype, folder, manifest, resident_dtype if manifest.layout.quant is not None else None)


def row_name(config, dtype, dtypes):
    return config if len(dtypes) == 1 else f"{config} [{dtype}]"


def measure_machine(first, subjects, disk_seconds, log):
    """The disk (uncached random reads of the first checkpoint, at every read size the subjects'
    rows make) and the memory bandwidth -> (files, chunk sizes, disk curve, memory GB/s, float32
    matvec GB/s)."""
    lay = first.manifest.layout
    log("measuring the disk (uncached random reads of the checkpoint) and memory bandwidth")
    files = [first.folder / e["file"] for e in first.manifest.ffn_files]
    chunks = sorted({4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB}
                    | {b for s in subjects for b in (s.manifest.layout.bundle_bytes,
                                                    s.manifest.layout.kind_bytes(lay.kinds[0]))})
    curve = disk_curve(files, chunks, seconds=disk_seconds)
    mv_bw = matvec_bandwidth(lay.n_neurons, lay.d_model)
    mem_bw = max(memory_bandwidth(), mv_bw)  # the fastest the weights were seen to stream
    log("disk GB/s: " + ", ".join(f"{c // KiB} KiB {v:.2f}" for c, v in curve.items())
        + f"; memory {mem_bw:.1f} GB/s (sum), {mv_bw:.1f} GB/s (float32 matvec)")
    return files, chunks, curve, mem_bw, mv_bw


def cached_profile(log):
    """The machine profile the rows' predictions use, or None (said)."""
    from ..plan.profile import load_profile

    profile = load_profile()
    if profile is None:
        log("no machine profile is cached: no cost-model prediction beside the rows (mlx_flash.benchmark profile)")
    return profile


def measure_row(sub, config, name, attach_to, prompt, tokens, warmup, mem_bw, curve, profile, run_curve,
                round_text, log):
    """One row of one round on the subject's loaded model: a fresh runtime for `config`, its
    warm-up, its measured decode tokens (a quarter of `tokens` for naive / hybrid), summarized with
    its floor and the cost model's times; the runtime released -> (the row, the memory GB/s
    measured for it)."""
    lay = sub.manifest.layout
    store = attach_to(sub.model, config)
    plan = store.plan
    sparse = CONFIGS[row_config(config)[0]][0] == "flash"
    n_tok = tokens if sparse else max(1, tokens // 4)
    n_warm = warmup if sparse else 1
    bw = max(mem_bw, matvec_bandwidth(lay.n_neurons, lay.d_model))  # now, for this row
    log(f"{round_text} {name}: {n_warm} warm-up + {n_tok} decode tokens")
    r, walls, disk_gbs = decode(sub.model, store, prompt, n_warm, n_tok, sub.folder)
    src_stats = sub.model.runtime.source.stats if sub.model.runtime.source is not None else None
    row = summarize(name, r, walls, store, plan, sub.resident_bytes, curve, bw, src_stats)
    row["dtype"] = sub.dtype
    add_prediction(row, sub.model.runtime, store, profile, disk_gbs, run_curve)
    log(f"  {row['total_ms']:.0f} ms/token: I/O {row['io_ms']:.0f}, mem {row['mem_ms']:.0f}, "
        f"predictor {row['predict_ms']:.0f}, compute {row['compute_ms']:.0f}; "
        f"{row['flash_to_dram_gb']:.3f} GB read at {row['throughput_gbs']:.2f} GB/s; "
        f"floor {row['floor_ms']:.0f} ms (memory {bw:.1f} GB/s)")
    del store, plan  # its caches go with the runtime, not at the next row's attach
    release(sub.model)
    return row, bw


def median_rows(per, curve, best_bw):
    """{row name: its rounds' rows} -> one row per name: each round refloored with the best disk
    curve and memory bandwidth the run saw, then their medians."""
    for rs in per.values():
        for r in rs:
            refloor(r, curve, best_bw)
    rows = [median_row(per[name]) for name in per]
    for r in rows:  # (the median time over the median prediction, not the median of the ratios)
        if r.get("predicted_ms"):
            r["measured_over_predicted"] = r["total_ms"] / r["predicted_ms"]
        if r.get("predicted_run_disk_ms"):
            r["measured_over_predicted_run_disk"] = r["total_ms"] / r["predicted_run_disk_ms"]
        if r.get("predicted_run_curve_ms"):
            r["measured_over_predicted_run_curve"] = r["total_ms"] / r["predicted_run_curve_ms"]
    return rows


def measure_rows(subjects, configs, dtypes, rounds, attach_to, prompt, tokens, warmup, mem_bw, disk, profile, log):
    """Every configuration's row for every subject, round after round (the rows alternate: a
    shared machine drifts), the disk measured again each round. disk: (files, chunk sizes,
    seconds a size, the curve measured at the start). -> (the rows, their rounds' medians; the
    disk curves of the rounds; the best curve; the best memory GB/s; the curves measured a layer's
    reads at a time, as the profile measures them)."""
    files, chunks, disk_seconds, curve = disk
    names = [(c, s) for s in subjects for c in configs]  # a subject's rows together: one model at a time
    per = {row_name(c, s.dtype, dtypes): [] for c, s in names}
    curves, best_bw, layer_curves = [curve], mem_bw, []
    for rnd in range(rounds):  # rounds alternate the rows: a shared machine drifts
        if rnd:  # the disk again: the floor takes the best the device showed in the run (other offsets
            # each probe: a cache below the guest's, a VM host's or the drive's, would serve a repeat)
            curves.append(disk_curve(files, chunks, seconds=disk_seconds, seed=rnd))
            curve = {c: max(cv[c] for cv in curves) for c in curves[0]}
            log("disk GB/s (best so far): " + ", ".join(f"{c // KiB} KiB {v:.2f}" for c, v in curve.items()))
        # and as the profile measures it (a layer's reads at a time, the sizes in turn three times,
        # medians: a short stall of the disk then spoils one pass, not a size), for the prediction
        # at this round's disk: the disk's drift since the profile set apart from the model's error
        if profile is not None:
            layer_curves.append(model_disk_curve(files, chunks, seconds=disk_seconds, seed=100 + rnd))
        for config, sub in names:
            for other in subjects:
                if other is not sub and len(subjects) > 1:
                    close_subject(other)
            open_subject(sub)  # (no local name for the model: a closed subject's must be freed)
            row, bw = measure_row(sub, config, row_name(config, sub.dtype, dtypes), attach_to, prompt, tokens,
                                  warmup, mem_bw, curve, profile, layer_curves[-1] if layer_curves else None,
                                  f"[round {rnd + 1}/{rounds}]", log)
            per[row["config"]].append(row)
            best_bw = max(best_bw, bw)
    return median_rows(per, curve, best_bw), curves, curve, best_bw, layer_curves


def figure7(model, attach_to, windows, d_model, window_tokens, log):
    """Figure 7: the store alone under "all" at each window size -> a row per window."""
    fig7 = []
    for w in windows or ():
        store = attach_to(model, "all", window=w)
        r = drive_store(store, d_model, window_tokens)
        fig7.append({"window": w, "io_ms": float(np.mean([x["io_ms"] for x in r])),
                     "mem_ms": float(np.mean([x["mem_ms"] for x in r])),
                     "load_ms": float(np.mean([x["total_ms"] for x in r])),
                     "flash_to_dram_gb": float(np.mean([x["bytes_read"] for x in r])) / 1e9,
                     "ffn_dram_gb": store.held_rows * store.plan.neuron_bytes / 1e9,
                     "window_kept": float(np.mean([x["window"] for x in r]))})
        log(f"window {w}: FFN in DRAM {fig7[-1]['ffn_dram_gb']:.2f} GB, "
            f"{fig7[-1]['flash_to_dram_gb'] * 1e3:.0f} MB/token, I/O {fig7[-1]['io_ms']:.0f} ms")
        release(model)
    return fig7


def figure8(model, attach_to, long_tokens, d_model, log):
    """Figure 8: the store alone under "all" for `long_tokens` tokens -> a row per token ([]: none)."""
    fig8 = []
    if long_tokens:
        store = attach_to(model, "all")
        log(f"long generation: {long_tokens} tokens through the store")
        r = drive_store(store, d_model, long_tokens)
        fig8 = [{"token": i, "io_ms": x["io_ms"], "mem_ms": x["mem_ms"],
                 "flash_to_dram_mb": x["bytes_read"] / 1e6} for i, x in enumerate(r)]
        release(model)
    return fig8


def run(shape="opt-6.7b", dtype="float32", memory_budget="50%", tokens=8, warmup=6, rounds=2,
        prompt_tokens=8, configs=tuple(CONFIGS), windows=(0, 1, 2, 3, 4, 5, 6, 8),
        window_tokens=12, long_tokens=1000, threads=READ_THREADS, predictor_rank=128, active=0.03,
        new=0.024, k=5, home=None, progress=True, log=print, verify=True, resident_dtype=None,
        disk_seconds=1.0):
    """Everything of `mlx_flash.benchmark paper`; returns a dict (rows, figures, machine).
    disk_seconds: how long each read size of the disk curve is read, at the start and each round.
    dtype: the weights on flash, float32 / float16 / bfloat16, or q4 / q8 (group-wise 4- or
    8-bit, group 64, float16 scales; dequantized as the reader copies them); a list of them
    runs every row for each, alternating, in one run (Figures 7 and 8: the first only)."""
    from ..blas import blas_info

    dtypes = [dtype] if isinstance(dtype, str) else list(dtype)
    subjects = [load_subject(shape, d, home, progress, verify, resident_dtype, log) for d in dtypes]
    first = subjects[0]
    lay = first.manifest.layout
    n_layers = len(first.manifest.ffn_files)
    neuron_bytes = len(lay.kinds) * lay.d_model * 4  # a float32 row (reported; stores say their own)
    # every dtype's rows get the same budget in bytes: a share of this shape's float32 model
    from ..runtime.budget import parse_budget
    from .peers.files import model_float32_bytes

    model_bytes = model_float32_bytes(first.folder)
    budget_text, memory_budget = memory_budget, str(parse_budget(memory_budget, model_bytes))

    files, chunks, curve, mem_bw, mv_bw = measure_machine(first, subjects, disk_seconds, log)

    trace = TraceModel(n_layers, lay.n_neurons, active=active, new=new, k=k)
    trace_stats = trace.statistics()
    log(f"trace: {trace_stats['active']:.2%} active, {trace_stats['new']:.2%} new at k={k}, "
        f"window union {trace_stats['union']:.1%}")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, prompt_tokens).tolist()
    profile = cached_profile(log)
    attach_to = partial(attach, trace=trace, budget=memory_budget, threads=threads, predictor_rank=predictor_rank,
                        verify=verify)

    for config in configs:
        row_config(config)
    rows, curves, curve, best_bw, layer_curves = measure_rows(
        subjects, configs, dtypes, rounds, attach_to, prompt, tokens, warmup, mem_bw,
        (files, chunks, disk_seconds, curve), profile, log)

    for sub in subjects[1:]:
        close_subject(sub)
    model = open_subject(first)
    fig7 = figure7(model, attach_to, windows, lay.d_model, window_tokens, log)
    fig8 = figure8(model, attach_to, long_tokens, lay.d_model, log)

    return {
        "shape": shape, "flash_dtype": ",".join(dtypes), "compute_dtype": model.runtime.compute_dtype, "verify": verify,
        "resident_dtype": model.runtime.resident_dtype,
        "subjects": [{"dtype": s.dtype, "checkpoint": str(s.folder), "resident_bytes": s.resident_bytes,
                      "resident_dtype": s.held} for s in subjects],
        "memory_budget": f"{budget_text} ({int(memory_budget) / 1e9:.2f} GB)", "model_bytes_float32": model_bytes,
        "resident_bytes": first.resident_bytes, "neuron_bytes": neuron_bytes,
        "checkpoint": str(first.folder), "trace": trace_stats | {"concentration": trace.concentration},
        "predictor_rank": predictor_rank, "disk_curve_gbs": {str(c): v for c, v in curve.items()},
        "memory_gbs": best_bw, "matvec_gbs": mv_bw, "disk_curves_gbs": [
            {str(c): v for c, v in cv.items()} for cv in curves],
        "disk_layer_curves_gbs": [{str(c): v for c, v in cv.items()} for cv in layer_curves],
        "rows": rows, "fig7": fig7, "fig8": fig8,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "blas": blas_info()},
        "tokens": tokens, "warmup": warmup, "rounds": rounds,
    }


# --- reports


TABLE2 = [("config", "config", "{}"), ("FFN in DRAM (GB)", "ffn_dram_gb", "{:.2f}"),
          ("flash→DRAM (GB/token)", "flash_to_dram_gb", "{:.3f}"), ("reads", "reads", "{:.0f}"),
          ("read size (KiB)", "read_kib", "{:.1f}"), ("throughput (GB/s)", "throughput_gbs", "{:.2f}"),
          ("I/O latency (ms)", "io_ms", "{:.0f}")]
TABLE3 = [("config", "config", "{}"), ("I/O (ms)", "io_ms", "{:.0f}"), ("mem (ms)", "mem_ms", "{:.0f}"),
          ("predictor (ms)", "predict_ms", "{:.0f}"), ("compute (ms)", "compute_ms", "{:.0f}"),
          ("total (ms)", "total_ms", "{:.0f}"), ("vs naive", "speedup", "{:.2f}x"),
          ("floor (ms)", "floor_ms", "{:.0f}"), ("measured / floor", "measured_over_floor", "{:.2f}"),
          ("predicted (ms)", "predicted_ms", "{:.0f}"), ("measured / predicted", "measured_over_predicted", "{:.2f}"),
          ("measured / predicted at the round's disk curve", "measured_over_predicted_run_curve", "{:.2f}"),
          ("disk GB/s in decode", "decode_disk_gbs", "{:.2f}"),
          ("measured / predicted at it", "measured_over_predicted_run_disk", "{:.2f}")]


def _table(rows, cols):
    out = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt.format(r[k]) if r.get(k) is not None else "—"
                                     for _, k, fmt in cols) + " |")
    return "\n".join(out)


def report(res):
    rows = res["rows"]
    subjects = res.get("subjects") or [{"dtype": res["flash_dtype"], "resident_bytes": res["resident_bytes"],
                                        "resident_dtype": res.get("resident_dtype", "float32")}]
    first = subjects[0]["dtype"]
    for r in rows:  # against naive of the same weights, and the same configuration of the first dtype's
        dt = r.get("dtype", first)
        base = next((b for b in rows if b["config"].split(" [")[0] == "naive" and b.get("dtype", first) == dt), None)
        ref = next((b for b in rows if b["config"].split(" [")[0] == r["config"].split(" [")[0]
                    and b.get("dtype", first) == first), None)
        r["speedup"] = base["total_ms"] / r["total_ms"] if base else None
        r["io_vs_naive"] = r["flash_to_dram_gb"] / base["flash_to_dram_gb"] if base else None
        r["speedup_vs_first"] = ref["total_ms"] / r["total_ms"] if ref else None
        r["bytes_vs_first"] = (r["flash_to_dram_gb"] / ref["flash_to_dram_gb"]
                               if ref and ref["flash_to_dram_gb"] else None)
    m = res["machine"]
    t = res["trace"]
    held = "; ".join(f"{s['dtype']}: {s['resident_bytes'] / 1e9:.2f} GB held at {s['resident_dtype'] or 'float32'}"
                     for s in subjects)
    head = (f"{res['shape']} shape, random weights; {res['flash_dtype']} on flash, {res.get('compute_dtype', 'float32')} compute"
            f" on {res.get('device', 'the default device')}; "
            f"reads {'checked (CRC32C)' if res.get('verify', True) else 'unchecked (--no-verify)'}; "
            f"memory budget {res['memory_budget']} of the float32 model "
            f"({res['model_bytes_float32'] / 1e9:.1f} GB; resident attention + embeddings: {held}); "
            f"{m['platform']}, {m['blas']}; "
            f"trace {t['active']:.1%} active, {t['new']:.1%} new at k={t['k']}; predictor rank "
            f"{res['predictor_rank']}; {res['tokens']} decode tokens per sparse row after the warm-up "
            f"(a quarter for naive / hybrid), {res['rounds']} alternating rounds, medians; "
            f"disk {', '.join(f'{int(c) // KiB} KiB {v:.2f}' for c, v in res['disk_curve_gbs'].items())} GB/s "
            f"(uncached, 32 threads; per chunk size the best of {len(res.get('disk_curves_gbs') or [1])} "
            f"measurements, one per round); memory {res['memory_gbs']:.1f} GB/s (the best seen), float32 "
            f"matvec {res['matvec_gbs']:.1f} GB/s. The floors use these best figures.")
    md = [f"# Paper benchmark: {res['shape']}", "", head, "", "## Table 2 (loading)", "",
          _table(rows, TABLE2), "", "## Table 3 (latency per token)", "", _table(rows, TABLE3)]
    if len(subjects) > 1:
        md += ["", f"## Against {first} (same configuration, same run)", "",
               _table(rows, [("config", "config", "{}"), ("flash→DRAM (GB/token)", "flash_to_dram_gb", "{:.3f}"),
                             (f"bytes vs {first}", "bytes_vs_first", "{:.2f}x"),
                             ("total (ms)", "total_ms", "{:.0f}"),
                             (f"speed vs {first}", "speedup_vs_first", "{:.2f}x"),
                             ("measured / floor", "measured_over_floor", "{:.2f}")])]
    if res["fig7"]:
        md += ["", "## Figure 7 (window size vs DRAM vs loading latency)", "",
               _table(res["fig7"], [("window", "window", "{}"), ("window kept", "window_kept", "{:.1f}"),
                                    ("FFN in DRAM (GB)", "ffn_dram_gb", "{:.2f}"),
                                    ("flash→DRAM (GB/token)", "flash_to_dram_gb", "{:.4f}"),
                                    ("I/O (ms)", "io_ms", "{:.0f}"), ("mem (ms)", "mem_ms", "{:.0f}"),
                                    ("load total (ms)", "load_ms", "{:.0f}")])]
    if res["fig8"]:
        io = np.array([x["io_ms"] for x in res["fig8"]])
        md += ["", "## Figure 8 (long generation)", "",
               f"{len(io)} tokens: I/O per token median {np.median(io):.0f} ms, p10 "
               f"{np.percentile(io, 10):.0f}, p90 {np.percentile(io, 90):.0f}; first 100 "
               f"{io[:100].mean():.0f} ms, last 100 {io[-100:].mean():.0f} ms."]
    return "\n".join(md) + "\n"


def write_outputs(res, out="out", json_path=None):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (f"paper-{res['shape']}-{res['flash_dtype'].replace(',', '+')}"
            + ("" if res.get("verify", True) else "-unchecked"))
    if res["flash_dtype"] in ("q4", "q8") and res.get("resident_dtype") != "quantized":
        stem += "-resident-" + str(res.get("resident_dtype"))
    md_path, csv_path = out / (stem + ".md"), out / (stem + ".csv")
    md = report(res)
    md_path.write_text(md)
    keys = list(res["rows"][0]) if res["rows"] else []
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(res["rows"])
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=1))
    plots = _plots(res, out / stem)
    return md, [md_path, csv_path] + plots


def _plots(res, stem):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    def save(name, title, xlabel, ylabel, draw, figsize):
        fig, ax = plt.subplots(figsize=figsize)
        draw(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{res['shape']}: {title}")
        fig.tight_layout()
        paths.append(Path(f"{stem}-{name}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    def fig7(ax):
        xs = [r["ffn_dram_gb"] for r in res["fig7"]]
        ax.plot(xs, [r["load_ms"] for r in res["fig7"]], "o-")
        for r, x in zip(res["fig7"], xs):
            ax.annotate(f"k={r['window']}", (x, r["load_ms"]), fontsize=7)

    def fig8(ax):
        ax.plot([r["token"] for r in res["fig8"]], [r["io_ms"] for r in res["fig8"]], lw=0.7)

    paths = []
    if res["fig7"]:
        save("fig7", "window size trade-off (Fig. 7)", "FFN weights in DRAM (GB)",
             "loading latency per token (ms)", fig7, (5, 3.5))
    if res["fig8"]:
        save("fig8", "long generation (Fig. 8)", "token", "I/O latency (ms)", fig8, (6, 3.5))
    return paths

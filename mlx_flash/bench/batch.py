"""`mlx_flash.benchmark batch`: decode throughput of a batch of prompts against one at a time
(FlexGen §4.2: the rows a decode step reads, converts and multiplies serve every sequence of the
batch), on a checkpoint of a real shape with random weights (convert/random_model.py), in one
exact mode under a weights budget.

Per batch size B: B prompts of random token ids, each decoding --tokens tokens with no stop
token, through mlx_flash.batch_generate (B = 1 is the one-by-one baseline: a sequence at a time
costs the same per token whichever sequence it is). Decode time only (prompt processing apart);
the sizes alternate in order from round to round, and the medians are reported with the bytes
each decode step read from flash, the physical floor of those bytes at the disk's rate and,
with the machine's profile cached, the cost model's time for the step (plan/cost.py: the
profile's rates for a batch's step of that many sequences) beside the measured one.

With --memory-limit instead of a weights budget, each batch size runs under a plan of its own
(load(memory_limit=..., batch_size=B)): B sequences' KV caches and prompt temporaries come off
the limit, so a larger batch holds fewer weights; the model is loaded again whenever the batch
size changes (load time is not decode time).
"""

import dataclasses
import gc
import json
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..layout.format import read_manifest

EXACT_MODES = ("naive", "hybrid", "dense")


def release_batch_model(held):
    """Close the held model's runtime and give its memory back (before the next load measures
    this process's memory as its runtime)."""
    import mlx.core as mx

    from ..loader import release_heap

    held["model"].runtime.close()
    held.clear()
    gc.collect()
    mx.clear_cache()
    release_heap()


def load_for_batch(held, plans, b, folder, mode, memory_budget, memory_limit, ctx_size, resident_dtype,
                   random_prompts):
    """The model for batch size `b`: under a memory limit each size has a plan of its own, else one
    model serves every size. held: {"key", "model", "tok"} of the loaded one, replaced when it is
    not that; plans: {key: (budget, weights, cost.Work of one position)} of each plan loaded.
    A model just loaded runs one short batch, untimed (MLX's kernels and the store's buffers
    warmed). -> (model, tokenizer)."""
    import mlx_flash

    key = b if memory_limit is not None else 1
    if held.get("key") != key:
        if held:  # (gone before the next load measures this process's memory as its runtime)
            release_batch_model(held)
        opts = ({"memory_limit": memory_limit, "batch_size": b, "ctx_size": ctx_size}
                if memory_limit is not None else
                {"memory_budget": None if mode == "dense" else memory_budget})
        model, tok = mlx_flash.load(folder, mode=mode, progress=False, resident_dtype=resident_dtype, **opts)
        held.update(key=key, model=model, tok=tok)
        rt = model.runtime
        plans[key] = (rt.budget_bytes, rt.plan.weights_bytes if rt.plan is not None else None, rt.work())
        # one short batch, untimed: MLX's kernels and the store's buffers warmed
        mlx_flash.batch_generate(model, tok, random_prompts(min(b, 2) if memory_limit is not None else 2),
                                 max_tokens=2, stop=False)
    return held["model"], held["tok"]


def time_batch(model, tokenizer, prompts, tokens, folder):
    """One batch decoded, `tokens` a sequence -> its figures, with the rate the disk holding
    `folder` delivered during it."""
    import mlx_flash
    from ..io import device

    t, before = time.perf_counter(), device.counters(folder)
    res = mlx_flash.batch_generate(model, tokenizer, prompts, max_tokens=tokens, stop=False)
    return {"decode_s": res.decode_seconds, "steps": res.steps,
            "generated": res.generation_tokens, "prompt_s": res.prompt_seconds,
            "wall_s": time.perf_counter() - t, "bytes_per_step": res.bytes_per_step,
            "reads_per_step": res.reads_per_step,
            # what the disk delivered during the run (its prompt's reads too: the same rows)
            "disk_gbs": device.rate(before, device.counters(folder))}


def batch_rows(batches, runs):
    """{batch size: its runs} -> a row per size: the runs' medians, the speed against one by one."""
    rows = []
    for b in batches:
        tps = [x["generated"] / x["decode_s"] for x in runs[b]]
        step_ms = [1e3 * x["decode_s"] / x["steps"] for x in runs[b]]
        rows.append({"batch": b, "decode_tps": float(np.median(tps)), "step_ms": float(np.median(step_ms)),
                     "bytes_per_step": float(np.median([x["bytes_per_step"] for x in runs[b]])),
                     "reads_per_step": float(np.median([x["reads_per_step"] for x in runs[b]])), "runs": runs[b]})
    base = rows[0]["decode_tps"]
    for row in rows:
        row["vs_one_by_one"] = row["decode_tps"] / base
    return rows


def add_batch_prediction(row, work, profile, curves):
    """The cost model's step for the row's batch size beside the measured one (work: one position's
    under its plan): at the profile's rates, at each round's disk, and at the rate the disk gave
    during the row's runs."""
    from ..plan.cost import predict, predict_at_disk_rate

    work = dataclasses.replace(work, positions=row["batch"])
    try:
        pred = predict(work, profile)
    except FlashError:  # (a profile without one of the plan's weight forms: no prediction)
        return
    row["predicted"] = pred.as_dict() | {"batch_priced": pred.batch_priced}
    row["measured_over_predicted"] = row["step_ms"] / pred.total_ms
    # again at each round's disk (the median): the model's error apart from the disk's drift
    # since the profile, as `benchmark paper` gives it; none from a curve whose sizes stop
    # below the step's reads (files smaller than them: the curve held flat past its last size)
    at = [predict(work, dataclasses.replace(profile, disk=dict(c))).total_ms for c in curves
          if c and max(c) >= work.read_size]
    if at:
        row["predicted_run_curve_ms"] = float(np.median(at))
        row["measured_over_predicted_run_curve"] = row["step_ms"] / row["predicted_run_curve_ms"]
    # and at the rate the device's counters gave while the row's runs read, prompt and decode
    # (io/device.py; the median of its runs'), as `benchmark paper` gives it: the probe a
    # minute before can be far from the disk the decode got (a step 1.42x its prediction
    # at the probed disk)
    rates = [x["disk_gbs"] for x in row["runs"] if x.get("disk_gbs")]
    if rates and work.read_bytes:
        row["decode_disk_gbs"] = float(np.median(rates))
        got = predict_at_disk_rate(work, profile, row["decode_disk_gbs"])
        row["predicted_run_disk_ms"] = got.total_ms
        row["measured_over_predicted_run_disk"] = row["step_ms"] / got.total_ms


def run_batch_bench(shape, dtype="float16", mode="hybrid", memory_budget="50%", batches=(1, 16), tokens=4,
                    prompt_tokens=16, rounds=2, seed=0, progress=True, memory_limit=None, profile=None,
                    resident_dtype=None, disk_seconds=1.0):
    """profile: the machine's (plan/profile.py), to predict each batch size's step, from its rates and
    again from the disk probed at the start of each round (`disk_seconds` a read size, as the
    profile probes it, on the checkpoint's files). resident_dtype: mlx_flash.load's (float16: a
    float16 checkpoint's weights held as stored)."""
    from ..convert.random_model import build_checkpoint, shape_config
    from ..plan.measure import model_disk_curve

    if mode not in EXACT_MODES:
        raise FlashError(f"--mode {mode}: the batch benchmark runs the exact modes ({', '.join(EXACT_MODES)}); "
                         "flash mode's rows depend on each sequence's sparsity")
    if 1 not in batches:
        batches = (1,) + tuple(batches)  # the one-by-one baseline, always in the same run
    folder = build_checkpoint(shape, dtype, progress=progress)
    held = {}  # the loaded model: (batch size it was planned for, model, tokenizer)
    plans = {}  # batch size -> (budget, weights, cost.Work of one position) of its plan
    vocab = shape_config(shape)["vocab_size"]
    rng = np.random.default_rng(seed)

    def random_prompts(n):
        return [rng.integers(1, vocab, prompt_tokens).tolist() for _ in range(n)]

    runs = {b: [] for b in batches}
    # each round's disk, probed as the profile probes it (for the prediction at it); not under a
    # memory limit: the probe's reader threads would leave what a load then measures as its runtime
    curves = []
    probe = profile is not None and memory_limit is None
    if profile is not None and not probe and progress:
        print("under --memory-limit the disk is not probed each round (its threads would count in the "
              "plan's measured runtime): no prediction at the run's disk", flush=True)
    files = [folder / e["file"] for e in read_manifest(folder).ffn_files] if probe else []
    try:
        for r in range(rounds):
            if probe:  # (other offsets each round: a cache below the guest's would serve a repeat)
                curves.append(model_disk_curve(files, threads=profile.threads, seconds=disk_seconds, seed=seed + r))
                if progress:
                    print(f"round {r + 1} disk: " + ", ".join(f"{c // 1024} KiB {v:.2f}" for c, v in curves[-1].items())
                          + " GB/s", flush=True)
            order = list(batches) if r % 2 == 0 else list(reversed(batches))
            for b in order:
                prompts = random_prompts(b)
                runs[b].append(time_batch(*load_for_batch(held, plans, b, folder, mode, memory_budget, memory_limit,
                                                          prompt_tokens + tokens, resident_dtype, random_prompts),
                                          prompts, tokens, folder))
                if progress:
                    x = runs[b][-1]
                    print(f"round {r + 1} batch {b}: {x['generated']} tokens in {x['steps']} steps, "
                          f"{x['decode_s']:.2f} s decode ({x['generated'] / x['decode_s']:.2f} tok/s), "
                          f"{x['bytes_per_step'] / 1e9:.3f} GB read per step", flush=True)
    finally:
        if held:
            held["model"].runtime.close()
    rows = batch_rows(batches, runs)
    for row in rows:
        row["budget_bytes"], row["weights_bytes"], work = plans[row["batch"] if memory_limit is not None else 1]
        if profile is not None and work is not None:
            add_batch_prediction(row, work, profile, curves)
    return {"shape": shape, "dtype": dtype, "mode": mode, "resident_dtype": resident_dtype,
            "memory_budget": memory_budget if memory_limit is None else None, "memory_limit": memory_limit,
            "budget_bytes": rows[0]["budget_bytes"], "weights_bytes": rows[0]["weights_bytes"],
            "tokens": tokens, "prompt_tokens": prompt_tokens, "rounds": rounds, "rows": rows,
            "disk_curves_gbs": [{str(c): v for c, v in curve.items()} for curve in curves]}


def read_size(row):
    return row["bytes_per_step"] / row["reads_per_step"] if row["reads_per_step"] else 0


def report(res, profile=None):
    """profile: the machine's (plan/profile.py): the floor is each step's bytes at its disk rate
    for the step's mean read size."""
    limited = res.get("memory_limit") is not None
    held_at = f", held at {res['resident_dtype']}" if res.get("resident_dtype") else ""
    lines = [f"# Batch decode: {res['shape']} at {res['dtype']}{held_at}, --mode {res['mode']}, "
             + (f"--memory-limit {res['memory_limit']}" if limited else f"--memory-budget {res['memory_budget']}"), "",
             f"{res['tokens']} decode tokens per sequence after a {res['prompt_tokens']}-token prompt of random ids; "
             f"{res['rounds']} rounds, batch sizes alternating in order; medians. One-by-one = batch 1 in the same run. "
             "Floor: the bytes a step reads at the machine profile's uncached rate for its mean read size"
             + (f" ({profile.machine}, measured {profile.measured}{', quick probe' if profile.quick else ''})."
                if profile else " (no machine profile cached: `mlx_flash.benchmark profile`).")
             + (" Under the limit each batch size has a plan of its own (its KV caches off the limit): the "
                "weights it holds in DRAM are in the last column." if limited else "")
             + (" Predicted: the cost model's step (I/O, compute) from the profile's rates for a step of that many "
                "sequences; measured ÷ predicted beside it. Then again with the disk probed at the start of each "
                "round as the profile probes it (on the checkpoint's files; the median of the rounds): the disk's "
                "drift since the profile set apart; and at the rate the disk's own counters gave while the row's "
                "runs read, prompt and decode (the median of its runs; Linux block devices only; what the reads "
                "beside the compute and their placing cost is in that rate, so not added again)."
                if profile else ""),
             "", "| batch | decode tok/s | vs one-by-one | ms per step | read per step (GB) | floor per step (ms) |"
             " predicted ms per step (I/O, compute) | measured ÷ predicted | predicted at the run's disk (ms) |"
             " measured ÷ predicted at the run's disk | disk during the runs (GB/s) | predicted at it (ms) |"
             " measured ÷ predicted at it |" + (" weights in DRAM (GB) |" if limited else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
             + (" --- |" if limited else "")]
    for r in res["rows"]:
        floor = ""
        if profile is not None and r["bytes_per_step"]:
            floor = f"{1e3 * r['bytes_per_step'] / 1e9 / profile.disk_gbs(read_size(r)):.0f}"
        held = (f" {r['weights_bytes'] / 1e9:.2f} |" if r.get("weights_bytes") else " – |") if limited else ""
        pred, ratio = "–", "–"
        if r.get("predicted"):
            p = r["predicted"]
            pred = f"{p['total_ms']:.0f} ({p['io_ms']:.0f}, {p['compute_ms']:.0f})"
            if not p.get("batch_priced", True):
                pred += " as one-position steps: the profile has no batch rates"
            ratio = f"{r['measured_over_predicted']:.2f}"
        at, at_ratio = "–", "–"
        if r.get("predicted_run_curve_ms"):
            at, at_ratio = f"{r['predicted_run_curve_ms']:.0f}", f"{r['measured_over_predicted_run_curve']:.2f}"
        dev = "– | – | –"
        if r.get("predicted_run_disk_ms"):
            dev = (f"{r['decode_disk_gbs']:.2f} | {r['predicted_run_disk_ms']:.0f} | "
                   f"{r['measured_over_predicted_run_disk']:.2f}")
        lines.append(f"| {r['batch']} | {r['decode_tps']:.3f} | {r['vs_one_by_one']:.2f}x | {r['step_ms']:.0f} | "
                     f"{r['bytes_per_step'] / 1e9:.3f} | {floor} | {pred} | {ratio} | {at} | {at_ratio} | {dev} |"
                     + held)
    return "\n".join(lines) + "\n"


def write(res, out_dir, profile=None):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = (f"batch-{res['shape']}-{res['dtype']}-{res['mode']}" + ("-limit" if res.get("memory_limit") else "")
            + (f"-held-{res['resident_dtype']}" if res.get("resident_dtype") else ""))
    (out / f"{stem}.json").write_text(json.dumps(res | {"profile": profile.as_dict() if profile else None}, indent=1))
    (out / f"{stem}.md").write_text(report(res, profile))
    return out / f"{stem}.md"

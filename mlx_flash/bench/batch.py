"""`mlx_flash.benchmark batch`: decode throughput of a batch of prompts against one at a time
(FlexGen §4.2: the rows a decode step reads, converts and multiplies serve every sequence of the
batch), on a checkpoint of a real shape with random weights (bench/random_model.py), in one
exact mode under a weights budget.

Per batch size B: B prompts of random token ids, each decoding --tokens tokens with no stop
token, through mlx_flash.batch_generate (B = 1 is the one-by-one baseline: a sequence at a time
costs the same per token whichever sequence it is). Decode time only (prompt processing apart);
the sizes alternate in order from round to round, and the medians are reported with the bytes
each decode step read from flash and the physical floor of those bytes at the disk's rate.
"""

import json
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError

EXACT_MODES = ("naive", "hybrid", "dense")


def run_batch_bench(shape, dtype="float16", mode="hybrid", memory_budget="50%", batches=(1, 16), tokens=4,
                    prompt_tokens=16, rounds=2, seed=0, progress=True):
    import mlx_flash
    from .random_model import build_checkpoint, shape_config

    if mode not in EXACT_MODES:
        raise FlashError(f"--mode {mode}: the batch benchmark runs the exact modes ({', '.join(EXACT_MODES)}); "
                         "flash mode's rows depend on each sequence's sparsity")
    if 1 not in batches:
        batches = (1,) + tuple(batches)  # the one-by-one baseline, always in the same run
    folder = build_checkpoint(shape, dtype, progress=progress)
    model, tok = mlx_flash.load(folder, mode=mode, memory_budget=None if mode == "dense" else memory_budget,
                                progress=False)
    rt = model.runtime
    vocab = shape_config(shape)["vocab_size"]
    rng = np.random.default_rng(seed)
    runs = {b: [] for b in batches}
    try:
        # one short batch of two, untimed: MLX's kernels and the store's buffers warmed
        mlx_flash.batch_generate(model, tok, [rng.integers(1, vocab, prompt_tokens).tolist() for _ in range(2)],
                                 max_tokens=2, stop=False)
        for r in range(rounds):
            order = list(batches) if r % 2 == 0 else list(reversed(batches))
            for b in order:
                prompts = [rng.integers(1, vocab, prompt_tokens).tolist() for _ in range(b)]
                t = time.perf_counter()
                res = mlx_flash.batch_generate(model, tok, prompts, max_tokens=tokens, stop=False)
                runs[b].append({"decode_s": res.decode_seconds, "steps": res.steps,
                                "generated": res.generation_tokens, "prompt_s": res.prompt_seconds,
                                "wall_s": time.perf_counter() - t, "bytes_per_step": res.bytes_per_step,
                                "reads_per_step": res.reads_per_step})
                if progress:
                    x = runs[b][-1]
                    print(f"round {r + 1} batch {b}: {x['generated']} tokens in {x['steps']} steps, "
                          f"{x['decode_s']:.2f} s decode ({x['generated'] / x['decode_s']:.2f} tok/s), "
                          f"{x['bytes_per_step'] / 1e9:.3f} GB read per step", flush=True)
    finally:
        rt.close()
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
    return {"shape": shape, "dtype": dtype, "mode": mode, "memory_budget": memory_budget,
            "budget_bytes": rt.budget_bytes, "weights_bytes": rt.plan.weights_bytes if rt.plan is not None else None,
            "tokens": tokens, "prompt_tokens": prompt_tokens, "rounds": rounds, "rows": rows}


def read_size(row):
    return row["bytes_per_step"] / row["reads_per_step"] if row["reads_per_step"] else 0


def report(res, profile=None):
    """profile: the machine's (plan/profile.py): the floor is each step's bytes at its disk rate
    for the step's mean read size."""
    lines = [f"# Batch decode: {res['shape']} at {res['dtype']}, --mode {res['mode']}, "
             f"--memory-budget {res['memory_budget']}", "",
             f"{res['tokens']} decode tokens per sequence after a {res['prompt_tokens']}-token prompt of random ids; "
             f"{res['rounds']} rounds, batch sizes alternating in order; medians. One-by-one = batch 1 in the same run. "
             "Floor: the bytes a step reads at the machine profile's uncached rate for its mean read size"
             + (f" ({profile.machine}, measured {profile.measured}{', quick probe' if profile.quick else ''})."
                if profile else " (no machine profile cached: `mlx_flash.benchmark profile`)."),
             "", "| batch | decode tok/s | vs one-by-one | ms per step | read per step (GB) | floor per step (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        floor = ""
        if profile is not None and r["bytes_per_step"]:
            floor = f"{1e3 * r['bytes_per_step'] / 1e9 / profile.disk_gbs(read_size(r)):.0f}"
        lines.append(f"| {r['batch']} | {r['decode_tps']:.3f} | {r['vs_one_by_one']:.2f}x | {r['step_ms']:.0f} | "
                     f"{r['bytes_per_step'] / 1e9:.3f} | {floor} |")
    return "\n".join(lines) + "\n"


def write(res, out_dir, profile=None):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"batch-{res['shape']}-{res['dtype']}-{res['mode']}"
    (out / f"{stem}.json").write_text(json.dumps(res | {"profile": profile.as_dict() if profile else None}, indent=1))
    (out / f"{stem}.md").write_text(report(res, profile))
    return out / f"{stem}.md"

"""Dense decode speed of mlx_flash vs mlx_lm on the same weights, in one process.

    python scripts/bench_dense_vs_mlx_lm.py --model models/smollm2-135m-instruct

Exports the flash folder to a plain HF folder (float32, the same values), loads
it with mlx_lm and the flash folder with mlx_flash, then alternates the two
(greedy, same prompt) for several rounds so that machine noise hits both.
Prints decode tokens/s for each, their ratio (median over rounds), and whether
the generated tokens are identical.
"""

import argparse
import json
import platform
import statistics
import tempfile
import time

import mlx_flash  # noqa: F401  (BLAS set-up before mlx)
import mlx.core as mx
from mlx_lm import load as lm_load
from mlx_lm import stream_generate as lm_stream_generate

from mlx_flash import load, stream_generate
from mlx_flash.blas import blas_info
from mlx_flash.layout.export import export_hf

PROMPT = (
    "Explain, step by step and in detail, how a steam engine converts heat into motion, "
    "and why it changed the way factories were organised in the nineteenth century."
)


def run(gen, model, tok, prompt, n):
    toks, resp = [], None
    for resp in gen(model, tok, prompt, max_tokens=n):
        toks.append(resp.token)
    return resp.generation_tps, resp.prompt_tps, toks


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(a.model, tmp, dtype="float32")
        ref, ref_tok = lm_load(tmp)
    model, tok = load(a.model, dtype="float32")
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)

    run(lm_stream_generate, ref, ref_tok, prompt, 8)  # warm-up both
    run(stream_generate, model, tok, prompt, 8)
    rows = []
    for r in range(a.rounds):
        order = [("mlx_lm", lm_stream_generate, ref, ref_tok), ("mlx_flash", stream_generate, model, tok)]
        if r % 2:
            order.reverse()
        res = {}
        for name, gen, m, t in order:
            res[name] = run(gen, m, t, prompt, a.tokens)
        rows.append(res)
        print(f"round {r}: mlx_lm {res['mlx_lm'][0]:.1f} tok/s, mlx_flash {res['mlx_flash'][0]:.1f} tok/s, "
              f"ratio {res['mlx_flash'][0] / res['mlx_lm'][0]:.3f}")
    ratios = [r["mlx_flash"][0] / r["mlx_lm"][0] for r in rows]
    same = all(r["mlx_flash"][2] == r["mlx_lm"][2] for r in rows)
    summary = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.system()}".strip(),
        "device": str(mx.default_device()),
        "blas": blas_info(),
        "model": a.model,
        "dtype": "float32 compute, " + model.runtime.manifest.dtype + " on flash",
        "tokens": a.tokens,
        "rounds": a.rounds,
        "mlx_lm_decode_tps_median": statistics.median(r["mlx_lm"][0] for r in rows),
        "mlx_flash_decode_tps_median": statistics.median(r["mlx_flash"][0] for r in rows),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "identical_tokens": same,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "rounds": [{k: v[:2] for k, v in r.items()} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()

"""WikiText-2 perplexity of the sparse modes, token by token, and the naive/hybrid/flash breakdown.

    python scripts/sparse_quality.py --model models/smollm2-135m-instruct --tokens 256 \
        --budget 50% --out results/sparse_quality

Each configuration decodes the first --tokens tokens of WikiText-2's test split
(../shared/data/wikitext-2-raw/wiki.test.raw, or --text FILE) one token at a
time through the real runtime — reads from flash, caches, eviction — and
scores the next token: so DIP-CA's cache-dependent choices are what a user
gets. Writes <out>.md and <out>.json.
"""

import argparse
import json
import math
import platform
import time
from pathlib import Path

import mlx_flash
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_flash.blas import blas_info

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


def perplexity(model, tokens):
    cache = make_prompt_cache(model)
    nll, t0 = 0.0, time.perf_counter()
    for i in range(len(tokens) - 1):
        logits = model(mx.array([[tokens[i]]]), cache=cache)[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        nll -= lp[tokens[i + 1]].item()
    n = len(tokens) - 1
    return math.exp(nll / n), 1e3 * (time.perf_counter() - t0) / n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--text", default=str(DATA))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--budget", default="50%")
    p.add_argument("--densities", default="1.0,0.75,0.5,0.25")
    p.add_argument("--sources", default="threshold,dip,dip-ca")
    p.add_argument("--out", default="results/sparse_quality")
    a = p.parse_args()

    text = Path(a.text).read_text(encoding="utf-8").replace("\r\n", "\n")
    configs = [dict(name="dense", mode="dense")]
    for src in a.sources.split(","):
        for d in map(float, a.densities.split(",")):
            # the gate-as-predictor keeps the whole gate resident: it cannot meet a tight budget
            budget = None if src == "threshold" else a.budget
            configs.append(dict(name=f"{src} {d:.0%}", mode="flash", sparsity=src, density=d,
                                memory_budget=budget))
    rows = []
    tok_ids = None
    for c in configs:
        kw = {k: v for k, v in c.items() if k != "name"}
        try:
            model, tok = mlx_flash.load(a.model, **kw)
        except mlx_flash.FlashError as e:
            rows.append(dict(c, error=str(e)))
            print(f"{c['name']}: {e}")
            continue
        if tok_ids is None:
            tok_ids = tok.encode(text[: a.tokens * 8])[: a.tokens]
        ppl, ms = perplexity(model, tok_ids)
        s = model.runtime.stats()["summary"]
        row = dict(c, ppl=ppl, ms_per_token=ms, **{k: s.get(k) for k in (
            "weights_in_dram_bytes", "memory_budget_bytes", "mean_io_ms", "mean_mem_ms", "mean_compute_ms",
            "mean_bytes_read", "mean_hit_rate")})
        rows.append(row)
        print(f"{c['name']:>16}: ppl {ppl:8.2f}  {ms:6.1f} ms/token  "
              f"DRAM {row['weights_in_dram_bytes'] / 1e6:6.1f} MB  read {(row['mean_bytes_read'] or 0) / 1e6:6.2f} MB/token")
    meta = dict(machine=f"{platform.machine()} {platform.system()}", blas=blas_info(), model=a.model,
                tokens=a.tokens, text=a.text, budget=a.budget, compute="float32", flash="float16")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"WikiText-2 test, first {a.tokens} tokens, token by token; {meta['machine']}, BLAS {meta['blas']}, "
             f"float32 compute, float16 on flash; budget {a.budget} for dip/dip-ca (threshold: none).", "",
             "| config | perplexity | ms/token | weights in DRAM (MB) | read/token (MB) | I/O ms | mem ms | hit rate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | — ({r['error']}) | | | | | | |")
            continue
        f = lambda v, s=1.0, fmt="{:.1f}": fmt.format(v * s) if v is not None else "—"
        lines.append(f"| {r['name']} | {r['ppl']:.2f} | {r['ms_per_token']:.0f} | {f(r['weights_in_dram_bytes'], 1e-6)} | "
                     f"{f(r['mean_bytes_read'], 1e-6, '{:.2f}')} | {f(r['mean_io_ms'])} | {f(r['mean_mem_ms'])} | "
                     f"{f(r['mean_hit_rate'], 1, '{:.2f}')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

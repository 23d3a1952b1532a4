"""Decode speed of the sparse flash sources against the exact modes, under one memory budget
(issue 19's second acceptance line), in alternating rounds.

    .venv/bin/python scripts/sparsity_speed.py                  # SmolLM2, --memory-budget 50%, ~3 min
    .venv/bin/python scripts/sparsity_speed.py --budget 40% --tokens 64 --rounds 3

Every configuration is loaded once; each round decodes --tokens greedy tokens after
the same prompt with each configuration in turn (the order rotates by round), so
drift of the machine spreads over all of them. Per configuration: median decode
ms/token over rounds (each round's mean), FFN bytes read from flash per token, the
share of the FFN's weights a token used (DIP-store sources), and the weights in
DRAM against the budget. The calibrated sources need `mlx_flash.calibrate` first.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

PROMPT = "Explain in a few sentences why the sky is blue, and what changes at sunset."
CONFIGS = {
    "dense (no budget)": dict(mode="dense"),
    "hybrid": dict(mode="hybrid"),
    "hybrid float32 rows": dict(mode="hybrid", ffn_rows="float32"),
    "calibrated 0.5": dict(mode="flash", sparsity="calibrated", density=0.5),
    "calibrated 0.4": dict(mode="flash", sparsity="calibrated", density=0.4),
    "dip 0.5": dict(mode="flash", sparsity="dip", density=0.5),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--budget", default="50%")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of: " + ", ".join(CONFIGS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    names = [n.strip() for n in a.configs.split(",")]
    models = {}
    for n in names:
        kw = dict(CONFIGS[n])
        if n != "dense (no budget)":
            kw["memory_budget"] = a.budget
        models[n], tok = mlx_flash.load(a.model, **kw)
    prompt = mx.array(tok.encode(PROMPT))
    res = {n: {"ms": [], "bytes": [], "share": []} for n in names}
    for r in range(a.rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            m = models[n]
            st = m.runtime.store.stats
            if st is not None:
                st.end()
                k0 = len(st.rows)
            times, t = [], time.perf_counter()
            for i, _ in enumerate(generate_step(prompt, m, max_tokens=a.tokens + 1)):
                now = time.perf_counter()
                if i:  # the first yield comes after the prompt
                    times.append(now - t)
                t = now
            res[n]["ms"].append(1e3 * float(np.mean(times)))
            if st is not None:
                st.end()
                rows = [x for x in st.rows[k0:] if x["tokens"] == 1]
                res[n]["bytes"].append(float(np.mean([x["bytes_read"] for x in rows])))
                res[n]["share"].append(float(np.mean([x["ffn_share"] for x in rows])))
        print(f"round {r + 1}: " + ", ".join(f"{n} {res[n]['ms'][-1]:.1f}" for n in names), flush=True)
    print(f"\n| config (budget {a.budget}) | ms/token (median of {a.rounds}) | rounds | FFN MB read/token | "
          "FFN weights used | weights in DRAM MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = []
    for n in names:
        s = models[n].runtime.stats()["summary"]
        ms = float(np.median(res[n]["ms"]))
        by = float(np.median(res[n]["bytes"])) / 1e6 if res[n]["bytes"] else 0.0
        sh = float(np.median(res[n]["share"])) if res[n]["share"] and res[n]["share"][0] else None
        print(f"| {n} | {ms:.1f} | {' / '.join(f'{v:.1f}' for v in res[n]['ms'])} | {by:.3f} | "
              f"{'' if sh is None else f'{100 * sh:.1f} %'} | {s['weights_in_dram_bytes'] / 1e6:.1f} |")
        out.append({"config": n, "ms_per_token": ms, "rounds_ms": res[n]["ms"], "bytes_per_token": by * 1e6,
                    "ffn_share": sh, "weights_in_dram_bytes": s["weights_in_dram_bytes"],
                    "budget_bytes": s["memory_budget_bytes"]})
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": out}, indent=1))


if __name__ == "__main__":
    sys.exit(main())

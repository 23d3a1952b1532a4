"""Decode speed of the sparse flash sources against the exact modes, under one memory budget,
in alternating rounds (mlx_flash.eval.speed).

    .venv/bin/python benchmarks/sparsity/speed/sparsity_speed.py                  # SmolLM2, --memory-budget 50%, ~3 min
    .venv/bin/python benchmarks/sparsity/speed/sparsity_speed.py --budget 40% --tokens 64 --rounds 3

Per configuration: median decode ms/token over rounds (each round's mean), FFN bytes
read from flash per token, the share of the FFN's weights a token used (DIP-store
sources), and the weights in DRAM against the budget. The calibrated sources need
`mlx_flash.calibrate` first. The quality table runs the same measurement for each of
its rows: `mlx_flash.eval --table OUT --speed-tokens 32`.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx_flash  # noqa: F401  first: it chooses MLX's BLAS before MLX is imported
from mlx_flash.eval.speed import decode_speed

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
    configs = {n: CONFIGS[n] | ({} if n == "dense (no budget)" else {"memory_budget": a.budget}) for n in names}
    res = decode_speed(a.model, configs, a.tokens, a.rounds, log=lambda m: print(m, flush=True))
    print(f"\n| config (budget {a.budget}) | ms/token (median of {a.rounds}) | rounds | FFN MB read/token | "
          "FFN weights used | weights in DRAM MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, r in res.items():
        if "error" in r:
            print(f"| {n} | — | {r['error']} | | | |")
            continue
        sh = r["ffn_share"]
        print(f"| {n} | {r['ms_per_token']:.1f} | {' / '.join(f'{v:.1f}' for v in r['rounds_ms'])} | "
              f"{r['bytes_per_token'] / 1e6:.3f} | {'' if sh is None else f'{100 * sh:.1f} %'} | "
              f"{r['weights_in_dram_bytes'] / 1e6:.1f} |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": [{"config": n} | r for n, r in res.items()]},
                                           indent=1))


if __name__ == "__main__":
    sys.exit(main())

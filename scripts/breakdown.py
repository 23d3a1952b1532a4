"""Per-token breakdown of naive, hybrid and flash in one run (the paper's Table 3 columns).

    python scripts/breakdown.py --model models/smollm2-135m-instruct --budget 50% --tokens 32

Every mode decodes the same prompt under the same memory budget; the means
over decode tokens are printed as a markdown table (and --json writes them).
"""

import argparse
import json
import platform

import mlx_flash
from mlx_flash.blas import blas_info

PROMPT = "Write a detailed paragraph about the history of the printing press in Europe."


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--budget", default="50%")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--density", type=float, default=0.5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    configs = [
        ("naive", dict(mode="naive", prefetch=False)),  # the paper's baselines: no overlap
        ("hybrid", dict(mode="hybrid", prefetch=False)),
        (f"flash dip {a.density:.0%}", dict(mode="flash", sparsity="dip", density=a.density)),
        (f"flash dip-ca {a.density:.0%}", dict(mode="flash", sparsity="dip-ca", density=a.density)),
    ]
    rows = []
    for name, kw in configs:
        model, tok = mlx_flash.load(a.model, memory_budget=a.budget, **kw)
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        mlx_flash.generate(model, tok, prompt, max_tokens=a.tokens)
        s = model.runtime.stats()["summary"]
        rows.append(dict(name=name, **s))
    print(f"SmolLM2 decode, {a.tokens} tokens, budget {a.budget} ({rows[0]['memory_budget_bytes'] / 1e6:.0f} MB); "
          f"{platform.machine()} {platform.system()}, BLAS {blas_info()}, float32 compute, float16 on flash\n")
    print("| mode | I/O ms | mem ms | predict ms | compute ms | total ms | read MB | reads | hit rate | DRAM MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['name']} | {r['mean_io_ms']:.1f} | {r['mean_mem_ms']:.1f} | {r['mean_predict_ms']:.1f} | "
              f"{r['mean_compute_ms']:.1f} | {r['mean_total_ms']:.1f} | {r['mean_bytes_read'] / 1e6:.1f} | "
              f"{r['mean_reads']:.0f} | {r['mean_hit_rate']:.2f} | {r['weights_in_dram_bytes'] / 1e6:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

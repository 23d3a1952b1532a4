"""What each step of the CPU kernels' work buys a mixture of experts' decode: ms per token with
the steps added one at a time, each in its own process, rounds alternating the order.

    .venv/bin/python scripts/moe_decode_steps.py MODEL [--budget 50%] [--tokens 12] [--rounds 2]

Steps: (1) the kernels' workers sleep between calls (MLX_FLASH_KERNEL_SPIN_US=0), AVX2 loops,
one native call per expert matrix; (2) + workers that spin 0.2 ms before they sleep; (3) + a
layer's routed experts in two native calls (kernels.qmv_many); (4) + AVX-512 BF16 for 4-bit
products (where the CPU has it: the default). Each process loads MODEL under --memory-budget,
runs a 4-token prompt and 4 warm-up tokens, then times --tokens decode tokens (median).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STEPS = [
    ("workers sleep, AVX2, a call per matrix", {"MLX_FLASH_KERNEL_SPIN_US": "0", "MLX_FLASH_KERNEL_SIMD": "avx2"}, False),
    ("+ workers spin 0.2 ms", {"MLX_FLASH_KERNEL_SIMD": "avx2"}, False),
    ("+ two native calls a layer (qmv_many)", {"MLX_FLASH_KERNEL_SIMD": "avx2"}, True),
    ("+ AVX-512 BF16 (the default)", {}, True),
]

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
import mlx_flash
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_flash.kernels import kernels_module
if not {many}:  # one native call per expert matrix, as before qmv_many (its limit set to none)
    kernels_module()[0].MAX_MANY = 0
model, _ = mlx_flash.load({model!r}, memory_budget={budget!r})
cache = make_prompt_cache(model)
mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
token = mx.array([[5]])
for _ in range(4):
    mx.eval(model(token, cache=cache))
times = []
for _ in range({tokens}):
    t0 = time.perf_counter()
    mx.eval(model(token, cache=cache))
    times.append(time.perf_counter() - t0)
k, _ = kernels_module()
print(json.dumps({{"times": times, "simd": k.simd(-1)}}))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--budget", default="50%")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", help="a JSON file for the results")
    a = p.parse_args()
    runs = {name: [] for name, _, _ in STEPS}
    simd = {}
    for r in range(a.rounds):
        for name, env, many in STEPS if r % 2 == 0 else reversed(STEPS):
            code = CHILD.format(root=str(ROOT), model=a.model, budget=a.budget, tokens=a.tokens, many=many)
            env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_FLASH_KERNEL_")} | env
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{name}: the child failed:\n{out.stderr[-2000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name] += res["times"]
            simd[name] = res["simd"]
            print(f"round {r + 1}: {name}: {1e3 * statistics.median(res['times']):.0f} ms/token", flush=True)
    first = statistics.median(runs[STEPS[0][0]])
    print(f"\n{a.model}, --memory-budget {a.budget}, {a.tokens} tokens x {a.rounds} rounds, medians\n")
    print("| step | kernels' SIMD level | ms/token | tok/s | vs step 1 |")
    print("| --- | --- | --- | --- | --- |")
    for name, _, _ in STEPS:
        ms = statistics.median(runs[name])
        print(f"| {name} | {simd[name]} | {1e3 * ms:.0f} | {1 / ms:.2f} | {first / ms:.2f}x |")
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "budget": a.budget, "runs": runs, "simd": simd}, indent=1))


if __name__ == "__main__":
    main()

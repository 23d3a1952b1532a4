"""A/B, one process: a float16 model's hybrid held at float16, a decode step's held rows through
the native kernels (now) or converted into the float32 arena for BLAS (before: the store's kernels
switched off, which is the path a build without them takes). Alternating rounds, median ms/token.

usage: .venv/bin/python benchmarks/float16-weights/hybrid_ab.py MODEL BUDGET [TOKENS] [ROUNDS]"""
import statistics
import sys
import time

import mlx.core as mx

import mlx_flash
from mlx_lm.models.cache import make_prompt_cache

folder, budget = sys.argv[1], sys.argv[2]
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 32
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
model, tok = mlx_flash.load(folder, mode="hybrid", resident_dtype="float16", memory_budget=budget)
store = model.runtime.store
kernels = store.kernels
plan = model.runtime.plan
print(f"{folder}: hybrid held at float16, budget {budget}: {plan.capacity} of {plan.n_neurons} neurons a layer "
      f"held, prefetch {plan.prefetch}")
ids = tok.encode("The history of the domestic cat begins")


def decode(n):
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[:, -1]
    times, out = [], []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        out.append(t)
        t0 = time.perf_counter()
        logits = model(mx.array([[t]]), cache=cache)[:, -1]
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


res = {"kernels": [], "arena": []}
outs = {}
for r in range(rounds):
    for name in (("kernels", "arena") if r % 2 == 0 else ("arena", "kernels")):
        store.kernels = kernels if name == "kernels" else None
        ms, out = decode(tokens)
        res[name].append(ms)
        outs[name] = out
print("| held rows of a decode step | ms/token (median of rounds) | rounds |")
print("| --- | --- | --- |")
for name, v in res.items():
    print(f"| {name} | {statistics.median(v):.1f} | {' / '.join(f'{x:.1f}' for x in v)} |")
print("same greedy tokens:", outs["kernels"] == outs["arena"])

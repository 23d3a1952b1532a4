"""A/B, one process: MLX's buffer-cache limit (mx.set_cache_limit) against prompt and decode speed,
alternating rounds, the same model and plan. Also prints mx.get_cache_memory after each round: how
much of the limit MLX actually kept.

usage: .venv/bin/python benchmarks/memory-limit/mlx-cache/cache_ab.py MODEL MODE BUDGET [TOKENS] [ROUNDS] [LIMITS_MB]
  BUDGET: --memory-budget (weights only, so the plan stays the same); 'none' for no budget
  LIMITS_MB: comma-separated cache limits in MB (default 0,4,8,32)"""
import statistics
import sys
import time

import mlx_flash  # first: it points MLX at OpenBLAS (blas.py)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

folder, mode, budget = sys.argv[1], sys.argv[2], sys.argv[3]
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 3
limits = [int(x) for x in (sys.argv[6] if len(sys.argv) > 6 else "0,4,8,32").split(",")]
kw = {} if budget == "none" else {"memory_budget": budget}
model, tok = mlx_flash.load(folder, mode=mode, **kw)
prompt = tok.encode("The history of the domestic cat begins in the Near East. " * 24)
print(f"{folder}: {mode}, budget {budget}, prompt {len(prompt)} tokens, {tokens} decode tokens, {rounds} rounds")


def run(n):
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for i in range(0, len(prompt), 128):
        logits = model(mx.array([prompt[i:i + 128]]), cache=cache)[:, -1]
        mx.eval(logits)
    t_prompt = time.perf_counter() - t0
    times = []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        t0 = time.perf_counter()
        logits = model(mx.array([[t]]), cache=cache)[:, -1]
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return len(prompt) / t_prompt, statistics.median(times) * 1e3


res = {lim: [] for lim in limits}
kept = {lim: [] for lim in limits}
for r in range(rounds):
    for lim in (limits if r % 2 == 0 else limits[::-1]):
        mx.set_cache_limit(lim << 20)
        mx.clear_cache()
        res[lim].append(run(tokens))
        kept[lim].append(mx.get_cache_memory() / 2**20)
print("| cache limit MB | prompt tok/s (median) | decode ms/token (median) | rounds (prompt tok/s, ms/token) | MLX cache kept MB |")
print("| --- | --- | --- | --- | --- |")
for lim in limits:
    p = statistics.median(x[0] for x in res[lim])
    d = statistics.median(x[1] for x in res[lim])
    rr = " / ".join(f"{a:.0f}, {b:.1f}" for a, b in res[lim])
    print(f"| {lim} | {p:.0f} | {d:.1f} | {rr} | {max(kept[lim]):.1f} |")

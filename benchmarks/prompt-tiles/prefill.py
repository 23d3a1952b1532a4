"""A prompt's prefill through the pass kernels' tiles (kernels.PROMPT_PASS = 256) against
dequantized chunks + BLAS (PROMPT_PASS = 0, the default), in one process: rounds
alternate the two and flip their order; each time is a prompt of random token ids fed to
stream_generate with max_tokens=1 (the time to the first token: the prefill, then one sample),
median of the rounds; the first tokens of both paths are compared.

usage: .venv/bin/python benchmarks/prompt-tiles/prefill.py MODEL MODE [--memory-budget B]
        [--lengths 16,64,128,256] [--rounds 3]
"""
import argparse, statistics, time
import mlx_flash
import numpy as np
from mlx_flash import load
from mlx_flash.kernels import passes as kernels  # (the pass kernels' caps)
from mlx_flash.generate import stream_generate

ap = argparse.ArgumentParser()
ap.add_argument("model"), ap.add_argument("mode")
ap.add_argument("--memory-budget")
ap.add_argument("--lengths", default="16,64,128,256")
ap.add_argument("--rounds", type=int, default=3)
a = ap.parse_args()
kw = dict(mode=a.mode)
if a.memory_budget:
    kw["memory_budget"] = a.memory_budget
model, tok = load(a.model, **kw)
lengths = [int(v) for v in a.lengths.split(",")]
vocab = min(tok.vocab_size, 30000)
prompts = {n: np.random.default_rng(n).integers(100, vocab, n).tolist() for n in lengths}
tiles = kernels.BATCH_PASS  # (PROMPT_PASS: 0 by default)


def ttft(ids):
    t0 = time.perf_counter()
    for r in stream_generate(model, tok, ids, max_tokens=1):
        return time.perf_counter() - t0, r.token


ttft(prompts[lengths[0]])  # warm
got, first = {}, {}
for rnd in range(a.rounds):
    for cap in ((tiles, 0) if rnd % 2 == 0 else (0, tiles)):
        kernels.PROMPT_PASS = cap
        for n in lengths:
            s, token = ttft(prompts[n])
            got.setdefault((cap, n), []).append(s)
            first.setdefault((cap, n), set()).add(token)
kernels.PROMPT_PASS = 0
print(f"{a.model} --mode {a.mode} budget={a.memory_budget}: time to the first token (s), median of {a.rounds} rounds")
print(f"{'prompt tokens':>14s} {'tiles':>8s} {'BLAS':>8s} {'BLAS / tiles':>13s}  first token (tiles, BLAS)")
for n in lengths:
    t, b = statistics.median(got[(tiles, n)]), statistics.median(got[(0, n)])
    print(f"{n:14d} {t:8.2f} {b:8.2f} {b / t:12.2f}x  {sorted(first[(tiles, n)])} {sorted(first[(0, n)])}")

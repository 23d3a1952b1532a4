"""Where a batch's decode step spends its CPU (stop 49): 4-bit OPT-6.7B (benchmark paper's random
checkpoint), --mode hybrid --memory-budget 50%, 16 prompts of 4 tokens; after a warm-up batch it
prints READY and its pid, sleeps 1 s, then runs the measured batch (prompt, then `tokens` steps).
Attach perf to the decode steps only (the prompt's 64 positions go through BLAS and take ~7 s):

  .venv/bin/python results/batch/stop49/step_perf.py 12 > /tmp/step16.log 2>&1 &
  # once READY is printed:
  sleep 9.5; perf record -F 499 -p PID -o /tmp/perf.step -- sleep 10
  perf report -i /tmp/perf.step --no-children --sort symbol

With `1` as the second argument, one prompt (one-by-one decode) instead of 16.
"""
import os, sys, time

import mlx_flash
import numpy as np
from mlx_flash.bench.random_model import build_checkpoint

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 12
prompts_n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
folder = build_checkpoint("opt-6.7b", "q4", progress=False)
model, tok = mlx_flash.load(folder, mode="hybrid", memory_budget="50%", progress=False)
rng = np.random.default_rng(0)
prompts = [rng.integers(1, 1000, 4).tolist() for _ in range(prompts_n)]
mlx_flash.batch_generate(model, tok, prompts, max_tokens=2)
print("READY", os.getpid(), flush=True)
time.sleep(1.0)
t = time.perf_counter()
r = mlx_flash.batch_generate(model, tok, prompts, max_tokens=tokens)
print("decode_tps", r.decode_tps, "total", time.perf_counter() - t, flush=True)

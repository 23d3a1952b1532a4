"""Where a batch decode step of 4-bit OPT-6.7B (hybrid, --memory-budget 50%) spends its time: one
batch_generate of B random prompts (16 tokens each, 4 decode tokens, after a 2-token warm-up
batch) under cProfile, the native kernels as built-ins. Stop 44 read the pass kernels' share of a
step off it (qmm_cols / qmm_rows / qmm tottime over the steps); the prompt is in the same profile.

usage: .venv/bin/python results/batch/stop44-opt-6.7b-q4/profile_step.py 16 hybrid 4 [noverify]
"""
import sys, time, cProfile, pstats
import mlx_flash
import numpy as np
from mlx_flash.bench.random_model import build_checkpoint, shape_config
B = int(sys.argv[1]); mode = sys.argv[2] if len(sys.argv) > 2 else "hybrid"
folder = build_checkpoint("opt-6.7b", "q4", progress=False)
model, tok = mlx_flash.load(folder, mode=mode, memory_budget="50%", progress=False, **({"verify": False} if len(sys.argv) > 4 else {}))
rng = np.random.default_rng(0); V = shape_config("opt-6.7b")["vocab_size"]
mlx_flash.batch_generate(model, tok, [rng.integers(1, V, 16).tolist() for _ in range(2)], max_tokens=2, stop=False)
prompts = [rng.integers(1, V, 16).tolist() for _ in range(B)]
pr = cProfile.Profile()
pr.enable()
res = mlx_flash.batch_generate(model, tok, prompts, max_tokens=int(sys.argv[3]) if len(sys.argv)>3 else 4, stop=False)
pr.disable()
print("decode_s", res.decode_seconds, "steps", res.steps, "prompt_s", res.prompt_seconds, "ms/step", 1e3*res.decode_seconds/res.steps)
pstats.Stats(pr).sort_stats("tottime").print_stats(25)

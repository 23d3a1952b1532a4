"""ms a decode step of 16 prompts of the 4-bit OPT-6.7B checkpoint of `benchmark batch`
(~/.cache/mlx_flash/bench/opt-6.7b-q4), dense (reads nothing) or hybrid at 50 % (reads 1.2 GB a
step while it computes): 2 runs of 5 tokens after a warm-up. LABEL=... is printed with the line.

usage: .venv/bin/python results/batch/stop46-opt-6.7b-q4/step16.py dense|hybrid
"""
import mlx_flash, numpy as np, sys, os, time
M = os.path.expanduser("~/.cache/mlx_flash/bench/opt-6.7b-q4")
mode = sys.argv[1] if len(sys.argv) > 1 else "dense"
model, tok = mlx_flash.load(M, mode=mode, memory_budget=None if mode == "dense" else "50%", progress=False)
rng = np.random.default_rng(0)
P = lambda b: [rng.integers(1, 50000, 4).tolist() for _ in range(b)]
mlx_flash.batch_generate(model, tok, P(16), max_tokens=2, stop=False)
out = []
for i in range(2):
    r = mlx_flash.batch_generate(model, tok, P(16), max_tokens=5, stop=False)
    out.append(1e3 * r.decode_seconds / r.steps)
print(os.environ.get("LABEL", ""), mode, "ms a step of 16:", [round(x) for x in out])

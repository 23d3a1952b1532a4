"""Where a 4-bit OPT-6.7B batch step goes besides the pass kernels: cProfile of batch_generate over 16
prompts of 4 random tokens (dense, every weight in DRAM), 6 decode steps less a 1-step run, tottime
a step by function (stop 45: qmm_cols 607, qmm_rows 532, qmm 530 ms; host_f32 60 ms, which is MLX
evaluating the attention and norms before the kernels; native_product 15, batch_generate 12).

usage: .venv/bin/python results/batch/stop45-opt-6.7b-q4/steps_prof.py
"""
import cProfile, pstats
import mlx_flash, numpy as np
from mlx_flash.bench.random_model import build_checkpoint, shape_config
folder = build_checkpoint("opt-6.7b", "q4", progress=False)
model, tok = mlx_flash.load(folder, mode="dense", progress=False)
rng = np.random.default_rng(0); V = shape_config("opt-6.7b")["vocab_size"]
mlx_flash.batch_generate(model, tok, [rng.integers(1, V, 4).tolist() for _ in range(2)], max_tokens=2, stop=False)
prompts = [rng.integers(1, V, 4).tolist() for _ in range(16)]
stats = {}
for n in (1, 6):
    pr = cProfile.Profile(); pr.enable()
    r = mlx_flash.batch_generate(model, tok, prompts, max_tokens=n, stop=False)
    pr.disable()
    print(n, "steps", r.steps, "decode_s", r.decode_seconds)
    st = pstats.Stats(pr); stats[n] = {k: v[2] for k, v in st.stats.items()}  # tottime
diff = {k: stats[6].get(k, 0) - stats[1].get(k, 0) for k in stats[6]}
tot = sum(diff.values())
print("total tottime diff (5 steps)", tot)
for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:25]:
    print(f"{1e3*v/5:8.1f} ms/step  {k[0].split('/')[-1]}:{k[1]}({k[2]})")

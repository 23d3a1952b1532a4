"""Tried in stop 46 and not kept: a prompt chunk of up to kernels.BATCH_PASS positions through the
pass kernels' tiles (each row dequantized once into L1) instead of dequantized chunks + BLAS.
Times one prefill (model(prompt) with a fresh cache, the last position's logits evaluated) of
random ids, both ways alternating, 2 rounds, best kept. Not kept: the logits moved from
1-1.7e-5 to 0.9-1.0e-4 of mlx_lm's (parity_text.py).

usage: .venv/bin/python results/prefill-stop46/prefill_tiles.py MODEL MODE LENGTHS
  e.g. ~/.cache/mlx_flash/bench/opt-6.7b-q4 dense 16,64,128,256
"""
import mlx_flash, numpy as np, sys, os, time, mlx.core as mx
from mlx_flash import kernels as K
import mlx_flash.models.half as H
from mlx_lm.models.cache import make_prompt_cache
M = os.path.expanduser(sys.argv[1])
mode = sys.argv[2]
model, tok = mlx_flash.load(M, mode=mode, memory_budget=None if mode == "dense" else "50%", progress=False)
orig = K.pass_kernels
def prompts_too(module, x):
    positions = x.size // x.shape[-1]
    if positions > K.SMALL_PASS and positions <= K.BATCH_PASS and K.batched(module):
        return True
    return orig(module, x)
rng = np.random.default_rng(0)
def prefill(T, tiles):
    K.pass_kernels = H.pass_kernels = prompts_too if tiles else orig
    c = make_prompt_cache(model)
    x = mx.array([rng.integers(1, 50000, T).tolist()])
    t = time.perf_counter()
    y = model(x, cache=c)
    mx.eval(y[:, -1])
    return time.perf_counter() - t
prefill(16, True); prefill(16, False)
for T in map(int, sys.argv[3].split(",")):
    r = {True: [], False: []}
    for i in range(2):
        for tiles in ((True, False) if i % 2 == 0 else (False, True)):
            r[tiles].append(prefill(T, tiles))
    print(f"{mode} prompt {T}: tiles {min(r[True]):.2f} s, chunks+BLAS {min(r[False]):.2f} s")

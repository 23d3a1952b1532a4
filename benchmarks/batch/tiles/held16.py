"""A batch's decode step over weights held at float16 (SmolLM2-135M-Instruct converted at float16,
`--resident-dtype float16`): the pass kernels' tiles (gather_mm / gather_mm_cols) against
the float32 arena + BLAS every 16-bit batch step took before (kernels.BATCH_PASS set to SMALL_PASS
sends every step of more than 4 sequences there), and one prompt at a time. Alternating rounds,
medians; random prompts of 16 tokens, `tokens` decode tokens each.

usage: .venv/bin/python benchmarks/batch/tiles/held16.py MODEL MODE [BUDGET] [ROUNDS] [BATCH]
  e.g. /work/big/smollm2-f16 dense ; /work/big/smollm2-f16 hybrid 60%
"""
import sys
import time

import mlx_flash
import numpy as np
from mlx_flash.kernels import passes as K  # (the pass kernels' caps: BATCH_PASS, PROMPT_PASS, SMALL_PASS)

model_dir, mode = sys.argv[1], sys.argv[2]
budget = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
batch = int(sys.argv[5]) if len(sys.argv) > 5 else 16
tokens = 8
model, tok = mlx_flash.load(model_dir, mode=mode, memory_budget=budget, resident_dtype="float16", progress=False)
rng = np.random.default_rng(0)
vocab = model.args.vocab_size
cap = K.BATCH_PASS


def run(b, tiles):
    K.BATCH_PASS = cap if tiles else K.SMALL_PASS
    prompts = [rng.integers(1, vocab, 16).tolist() for _ in range(b)]
    with K.pass_notes_off():
        r = mlx_flash.batch_generate(model, tok, prompts, max_tokens=tokens, stop=False)
    K.BATCH_PASS = cap
    return 1e3 * r.decode_seconds / r.steps, r.generation_tokens / r.decode_seconds


run(2, True)
run(batch, True)
run(batch, False)  # warm
res = {"one": [], "tiles": [], "blas": []}
for i in range(rounds):
    order = [("one", 1, True), ("tiles", batch, True), ("blas", batch, False)]
    for name, b, tiles in (order if i % 2 == 0 else order[::-1]):
        res[name].append(run(b, tiles))
med = {k: (float(np.median([a for a, _ in v])), float(np.median([t for _, t in v]))) for k, v in res.items()}
print(f"{model_dir} {mode} budget {budget} held float16, {rounds} rounds, batch {batch}, {tokens} decode tokens a sequence")
for k, (ms, tps) in med.items():
    print(f"  {k:6s} {ms:8.1f} ms a step  {tps:8.1f} tok/s  ({tps / med['one'][1]:.2f}x one at a time)  "
          f"steps: {', '.join(f'{a:.0f}' for a, _ in res[k])}")
print(f"  tiles / BLAS step: {med['blas'][0] / med['tiles'][0]:.2f}x faster")

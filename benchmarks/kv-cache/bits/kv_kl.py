"""The quantized KV cache's distance from the float cache on SmolLM2 (test_kv_bits' prompt):
the largest and mean logit difference and the next-token KL, at 8 and 4 bits.

  .venv/bin/python benchmarks/kv-cache/bits/kv_kl.py
"""

import sys
from pathlib import Path

import mlx_flash
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_parity import TOKENS  # noqa: E402

MODEL = "models/smollm2-135m-instruct"
dense, _ = mlx_flash.load(MODEL, progress=False)
want = dense(mx.array([TOKENS]), cache=make_prompt_cache(dense))[0, -1]
for bits in (8, 4):
    model, _ = mlx_flash.load(MODEL, kv_bits=bits, progress=False)
    got = model(mx.array([TOKENS]), cache=make_prompt_cache(model))[0, -1]
    lp, lq = want - mx.logsumexp(want), got - mx.logsumexp(got)
    kl = (mx.exp(lp) * (lp - lq)).sum().item()
    print(f"{bits}-bit: max |logit difference| {mx.abs(got - want).max().item():.4f}, mean "
          f"{mx.abs(got - want).mean().item():.4f}, KL {kl:.3g}, same argmax "
          f"{mx.argmax(got).item() == mx.argmax(want).item()}")
    model.runtime.close()

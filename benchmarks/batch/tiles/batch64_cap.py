"""benchmark batch's run (4-bit OPT-6.7B, --mode hybrid --memory-budget 50%, batches 1 and 64, 4 decode
tokens after 4-token prompts) with kernels.BATCH_PASS set to the argument: 32 (a step of 64
sequences through dequantized chunks + BLAS) or 256 (the pass kernels' tiles).

usage: .venv/bin/python benchmarks/batch/tiles/batch64_cap.py 32|256 [rounds, default 2]
"""
import sys

import mlx_flash  # noqa: F401 (before mlx.core)
from mlx_flash.kernels import passes as K  # (the pass kernels' caps: BATCH_PASS, PROMPT_PASS, SMALL_PASS)
from mlx_flash.bench import batch
from mlx_flash.plan.profile import load_profile

K.BATCH_PASS = int(sys.argv[1])
profile = load_profile()
res = batch.run_batch_bench("opt-6.7b", "q4", "hybrid", "50%", (1, 64), tokens=4, prompt_tokens=4,
                            rounds=int(sys.argv[2]) if len(sys.argv) > 2 else 2, profile=profile)
print(f"BATCH_PASS {K.BATCH_PASS}")
print(batch.report(res, profile))

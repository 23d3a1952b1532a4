#!/bin/bash
# Qwen2.5-Coder-1.5B under memory cgroups of its runtime + 35 % and + 50 % of the GGUF's size:
# flash mode with the calibrated thresholds against the exact plan --mode auto chooses and against
# llama.cpp on the same GGUF, alternating rounds (`benchmark peers`). Needs `make model-large`,
# `mlx_flash.calibrate --model models/qwen2.5-coder-1.5b-instruct` and `make peers-setup`; root
# (cgroup v1, page cache counted and dropped before each run). Writes OUT (default
# benchmarks/sparsity/qwen-1.5b/limits): peers.md / .csv / .json. A run past TIMEOUT seconds (300) is
# killed and reported so (llama.cpp may page its mapped weights for many minutes at these limits).
set -euo pipefail
cd "$(dirname "$0")/../../.."
M=${M:-models/qwen2.5-coder-1.5b-instruct}
OUT=${OUT:-benchmarks/sparsity/qwen-1.5b/limits}
.venv/bin/python -m mlx_flash benchmark peers --model "$M" \
    --systems "mlx_flash:auto,mlx_flash:flash:calibrated:0.65,mlx_flash:flash:calibrated:0.5,llama.cpp-gguf" \
    --limit "${LIMITS:-544MB,712MB}" --prompt-tokens 160 --tokens 16 --rounds ${ROUNDS:-2} --timeout ${TIMEOUT:-300} --out "$OUT" | tail -12

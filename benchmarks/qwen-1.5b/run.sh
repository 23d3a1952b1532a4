#!/bin/bash
# Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, `make model-large`) against llama.cpp on the same file:
# WikiText-2 perplexity on the same token windows, then dense decode and prompt speed in one
# alternating run (`benchmark peers`, no memory limit). Needs `make peers-setup` (llama.cpp).
# Writes OUT (default benchmarks/qwen-1.5b/out): perplexity JSONs, peers.md / .csv / .json.
# PPL=0 skips the perplexity runs (speed only); LIMITS=610MB,... adds runs under memory cgroups.
set -euo pipefail
cd "$(dirname "$0")/../.."
M=${M:-models/qwen2.5-coder-1.5b-instruct}
G=${G:-models/download/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
OUT=${OUT:-benchmarks/qwen-1.5b/out}
mkdir -p "$OUT"
if [ "${PPL:-1}" != 0 ]; then
  .venv/bin/python -m mlx_flash eval --model "$M" --task wikitext --limit 2048 --context 512 --mode dense \
      --no-progress --json "$OUT/ppl-mlx_flash.json" | grep perplexity
  .venv/bin/python scripts/llama_cpp_perplexity.py --model "$M" --gguf "$G" --task wikitext --limit 2048 \
      --context 512 --json "$OUT/ppl-llama.cpp.json" | tail -1
fi
.venv/bin/python -m mlx_flash benchmark peers --model "$M" --systems "mlx_flash:dense@none,llama.cpp-gguf@none" \
    --limit none --prompt-tokens 160 --tokens 32 --rounds ${ROUNDS:-3} --out "$OUT" | tail -4
# under memory cgroups (v1, page cache counted; root): mlx_flash's automatic plan against llama.cpp
if [ -n "${LIMITS:-}" ]; then
  .venv/bin/python -m mlx_flash benchmark peers --model "$M" --systems "mlx_flash:auto,llama.cpp-gguf" \
      --limit "$LIMITS" --prompt-tokens 160 --tokens 16 --rounds 2 --out "$(dirname "$OUT")/limits" | tail -8
fi

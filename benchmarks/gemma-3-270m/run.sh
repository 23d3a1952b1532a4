#!/bin/bash
# Gemma 3 270M (Q4_K_M GGUF, `make model-gemma`) against llama.cpp on the same file: the tokens of
# WikiText-2 against llama.cpp's own tokenizer, perplexity on the same token windows, then dense
# decode and prompt speed in one alternating run (`benchmark peers`, no memory limit).
# Needs `make peers-setup` (llama.cpp). Writes OUT (default benchmarks/gemma-3-270m/out).
# PPL=0 skips the tokenizer and perplexity runs (speed only).
set -euo pipefail
cd "$(dirname "$0")/../.."
M=${M:-models/gemma-3-270m}
G=${G:-models/download/gemma-3-270m-q4_k_m.gguf}
OUT=${OUT:-benchmarks/gemma-3-270m/out}
mkdir -p "$OUT"
if [ "${PPL:-1}" != 0 ]; then
  .venv/bin/python benchmarks/gemma-3-270m/tokens.py "$M" "$G" | tee "$OUT/tokens.txt"
  .venv/bin/python -m mlx_flash eval --model "$M" --task wikitext --limit 2048 --context 512 --mode dense \
      --no-progress --json "$OUT/ppl-mlx_flash.json" | grep perplexity
  .venv/bin/python scripts/llama_cpp_perplexity.py --model "$M" --gguf "$G" --task wikitext --limit 2048 \
      --context 512 --json "$OUT/ppl-llama.cpp.json" | tail -1
fi
.venv/bin/python -m mlx_flash benchmark peers --model "$M" --systems "mlx_flash:dense@none,llama.cpp-gguf@none" \
    --limit none --prompt-tokens 160 --tokens 32 --rounds ${ROUNDS:-3} --out "$OUT" | tail -4

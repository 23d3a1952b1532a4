#!/bin/bash
# The GPU path on a machine with MLX's CUDA build (see README.md beside this file): the paper's
# rows on the GPU and on the CPU in one run, then generate on the GPU, dense against flash with
# threshold sparsity at 50 %, staged and host cache writes. Everything lands in $R, then $OUT/gpu-path.tgz.
set -uo pipefail
# the native reader (parallel uncached reads, CRC32C checks): both of its sources, as setup.py builds it
INC=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
SUF=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -O3 -march=native -shared -fPIC -pthread -I"$INC" mlx_flash/io/_native.c mlx_flash/io/crc32c.c \
    -o mlx_flash/io/_native"$SUF" || { echo "run.sh: the native reader did not build"; exit 3; }
R=${R:-/tmp/gpu-path}; rm -rf "$R"; mkdir -p "$R"
export MLX_FLASH_HOME=${MLX_FLASH_HOME:-/tmp/mlxf}
{ nvidia-smi -L; echo "cores $(nproc)"; python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx_lm', mlx_lm.__version__, mx.default_device())"; df -h /tmp | tail -1; } > "$R/machine.txt" 2>&1
cat "$R/machine.txt"
timeout ${PAPER_S:-420} python3 -m mlx_flash benchmark paper --shape opt-1.3b --dtype float16 --device gpu,cpu \
    --windows '' --long-tokens 0 --out "$R/paper" --json "$R/paper.json" --quiet 2>&1 | tee "$R/paper.log" | grep -v '^\[round' | tail -60
M=$MLX_FLASH_HOME/bench/opt-1.3b-float16
P="The quick brown fox jumps over the lazy dog, and then it runs far away into the forest where"
for run in "dense" "flash --sparsity threshold --density 0.5" "flash --sparsity threshold --density 0.5 --cache-writes host"; do
  echo "=== generate --device gpu --mode $run" | tee -a "$R/generate.log"
  timeout 60 python3 -m mlx_flash generate --model "$M" --device gpu --mode $run --prompt "$P" --max-tokens 64 --stats 2>&1 \
    | grep -v 'load ffn' | tail -7 | tee -a "$R/generate.log"
done
tar czf "$OUT/gpu-path.tgz" -C "$(dirname "$R")" "$(basename "$R")"

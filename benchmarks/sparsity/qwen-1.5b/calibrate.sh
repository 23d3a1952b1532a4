#!/bin/bash
# Calibrate Qwen2.5-Coder-1.5B's thresholds (`mlx_flash.calibrate`, its defaults) inside a memory
# cgroup of LIMIT (default 3 GB, under the model's 7.1 GB at float32): wall time, peak RSS
# (/usr/bin/time -v) and the cgroup's peak (page cache counted). Needs root and cgroup v1's memory
# controller. M: the folder calibrated (default models/qwen2.5-coder-1.5b-instruct; its manifest
# gets the thresholds). Writes OUT (default benchmarks/sparsity/qwen-1.5b/calibrate.txt).
set -euo pipefail
cd "$(dirname "$0")/../../.."
M=${M:-models/qwen2.5-coder-1.5b-instruct}
LIMIT=${LIMIT:-3G}
OUT=${OUT:-benchmarks/sparsity/qwen-1.5b/calibrate.txt}
CG=/sys/fs/cgroup/memory/mlx_flash_calibrate_$$
mkdir "$CG"
trap 'rmdir "$CG" 2>/dev/null || true' EXIT
echo "$LIMIT" > "$CG/memory.limit_in_bytes"
sync && echo 3 > /proc/sys/vm/drop_caches
start=$(date +%s)
( echo $BASHPID > "$CG/tasks" && exec /usr/bin/time -v .venv/bin/python -m mlx_flash calibrate --model "$M" ) \
    > /tmp/mlx_flash_calibrate.log 2>&1 || { tail -20 /tmp/mlx_flash_calibrate.log; exit 1; }
end=$(date +%s)
{
  echo "mlx_flash.calibrate --model $M under a memory cgroup of $LIMIT ($(uname -m), $(nproc) CPUs)"
  echo "wall: $((end - start)) s"
  grep -E "Maximum resident set size" /tmp/mlx_flash_calibrate.log
  echo "cgroup peak (page cache counted): $(( $(cat "$CG/memory.max_usage_in_bytes") / 1000000 )) MB"
  echo "cgroup OOM kills: $(grep -E '^oom_kill ' "$CG/memory.oom_control" | cut -d' ' -f2)"
  grep -E "^\[calibrate\]|thresholds of" /tmp/mlx_flash_calibrate.log
} | tee "$OUT"

#!/usr/bin/env bash
# System packages mlx_flash uses: OpenBLAS for MLX's CPU backend on Linux
# (the mlx-cpu wheel links the 60x slower reference BLAS), fio for the storage
# benchmark's reference figure. Nothing is needed on macOS (Accelerate, Metal).
set -euo pipefail
[ "$(uname -s)" = "Linux" ] || exit 0
if [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] ||
   [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  command -v fio >/dev/null 2>&1 && exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_system_deps: no apt-get; install OpenBLAS yourself for fast CPU matmuls" >&2
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q libopenblas0-pthread fio >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null 2>&1
  $SUDO apt-get install -y -q libopenblas0-pthread fio >/dev/null
}

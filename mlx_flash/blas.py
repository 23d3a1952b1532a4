"""Choose the BLAS that MLX's CPU backend uses, before MLX is imported.

The mlx-cpu wheel for Linux links netlib's reference BLAS (about 4 GFLOP/s
for float32 GEMM here). MLX only imports the `cblas_*` entry points, so
loading OpenBLAS with RTLD_GLOBAL before `import mlx.core` makes MLX's
lazily-bound calls resolve to OpenBLAS instead (60x faster GEMM, about 3x
faster decode). This is the same effect as LD_PRELOAD, without re-executing.
On macOS MLX uses Accelerate and Metal; nothing to do.
"""

import ctypes
import os
import platform
import sys
import warnings

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]

_state = {"blas": None}


def _global_openblas():
    """True if an OpenBLAS already serves the global `cblas_*` symbols (LD_PRELOAD, or
    loaded with RTLD_GLOBAL). NumPy's bundled OpenBLAS does not count: its symbols are
    renamed (scipy_openblas), so MLX would still bind to the reference BLAS."""
    try:
        ctypes.CDLL(None).openblas_get_config
        return True
    except (AttributeError, OSError):
        return False


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def openblas_coretype():
    """The OPENBLAS_CORETYPE to pin on this x86 CPU, or None to let OpenBLAS detect it.

    On these virtual Xeons OpenBLAS's own detection reports SkylakeX but its
    float32 GEMM runs at 40-57 GFLOP/s; with OPENBLAS_CORETYPE=SkylakeX set
    before the library loads, 225-295 GFLOP/s (2048^3, 2 cores, measured
    2026-11-22). Only the kernel families the CPU's flags allow are chosen.
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def setup_blas():
    """Load OpenBLAS globally on Linux if MLX has not been imported yet.

    Set MLX_FLASH_BLAS=reference to keep the wheel's own BLAS, or
    MLX_FLASH_BLAS=/path/libopenblas.so to pick a library.
    """
    if _state["blas"] is not None:
        return _state["blas"]
    if platform.system() == "Darwin":
        _state["blas"] = "Accelerate (macOS)"
        return _state["blas"]
    choice = os.environ.get("MLX_FLASH_BLAS", "")
    if _global_openblas():
        _state["blas"] = "OpenBLAS (preloaded)"
        return _state["blas"]
    if choice == "reference":
        _state["blas"] = "reference BLAS (MLX_FLASH_BLAS=reference)"
        return _state["blas"]
    if "mlx.core" in sys.modules:
        _state["blas"] = "reference BLAS (mlx was imported before mlx_flash)"
        if any(os.path.exists(p) for p in OPENBLAS_CANDIDATES):  # it could have had OpenBLAS
            # measured: a 512-token SmolLM2 forward took 56 s instead of 2.9 s
            warnings.warn("mlx_flash: mlx was imported before mlx_flash, so MLX's CPU backend keeps the "
                          "wheel's reference BLAS (matrix products 10-20x slower); import mlx_flash "
                          "first", stacklevel=3)
        return _state["blas"]
    for path in [choice] if choice else OPENBLAS_CANDIDATES:
        if path and os.path.exists(path):
            core = os.environ.get("OPENBLAS_CORETYPE") or openblas_coretype()
            if core and "OPENBLAS_CORETYPE" not in os.environ:
                os.environ["OPENBLAS_CORETYPE"] = core  # read by OpenBLAS when it loads
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _state["blas"] = f"OpenBLAS ({path}, core {core or 'auto'})"
            return _state["blas"]
    _state["blas"] = (
        "reference BLAS (slow; install OpenBLAS: apt-get install libopenblas0-pthread)"
    )
    return _state["blas"]


def blas_info():
    return _state["blas"] or setup_blas()

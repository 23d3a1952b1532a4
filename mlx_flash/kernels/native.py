"""The native kernels' module (_matvec.c, built by setup.py; optional): loaded with its pool of
threads and its SIMD level set on first use, and both said in words (doctor, --stats)."""

import os
import sys

from ..errors import FlashError


def kernels_module():
    """-> (the _matvec module, its pool sized by default_threads() on first use, "") or
    (None, why not)."""
    if os.environ.get("MLX_FLASH_NO_NATIVE"):
        return None, "MLX_FLASH_NO_NATIVE is set"
    try:
        from . import _matvec
    except ImportError as e:
        return None, f"the native kernels are not built ({e})"
    if not _matvec.threads():  # never set (the C default runs every row on the caller's thread)
        level = os.environ.get("MLX_FLASH_KERNEL_SIMD")
        if level:
            if level not in SIMD_LEVELS:
                raise FlashError(f"MLX_FLASH_KERNEL_SIMD={level!r}: one of {', '.join(SIMD_LEVELS)} (the widest "
                                 "this CPU has is the default)")
            _matvec.simd(SIMD_LEVELS.index(level))
        _matvec.set_threads(default_threads())
    return _matvec, ""


SIMD_LEVELS = ("portable", "avx2", "avx512-bf16", "avx512-vnni")  # _matvec.simd's levels 0 .. 3, by name


def simd_name(module):
    """The loops the kernels run here, in words (doctor, --stats)."""
    return {0: "the portable loops", 1: "AVX2", 2: "AVX-512 BF16 for 4-bit products, AVX2 for the rest",
            3: "AVX-512 VNNI for 4- and 8-bit products, AVX-512 BF16 and AVX2 for the rest"}[module.simd(-1)]


def pinning_name(module):
    """Where the kernels' workers run, in words (doctor): pinned on Linux each to a CPU of its own
    other than the caller's (kernels/_matvec.c, pin_workers), unless MLX_FLASH_KERNEL_PIN=0,
    set_pinning(False), a placement the system refused, or more threads than the process has
    CPUs; placed by the OS elsewhere."""
    threads = module.threads() or default_threads()
    if threads <= 1:
        return "one thread (no workers)"
    if not sys.platform.startswith("linux"):
        return "workers placed by the OS"
    if not module.pinning():
        return "workers not pinned (MLX_FLASH_KERNEL_PIN=0, set_pinning(False) or a placement the system refused)"
    if threads > len(os.sched_getaffinity(0)):
        return "workers not pinned (more threads than CPUs)"
    return "workers pinned, each to a CPU other than the caller's"


def default_threads():
    """The kernels' threads: MLX_FLASH_KERNEL_THREADS, else the CPUs this process may use (at most 16)."""
    env = os.environ.get("MLX_FLASH_KERNEL_THREADS")
    if env:
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(16, cpus or 1))

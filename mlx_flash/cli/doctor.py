"""mlx_flash.doctor: what this machine gives mlx_flash, in the lines a bug report wants.

Platform and memory (RAM, what is free, a cgroup's limit), MLX (version, device), the BLAS
MLX's CPU backend uses, the native extensions (the reader's pool, the quantized kernels and
their SIMD loops), uncached reads where the models live (O_DIRECT / F_NOCACHE: refused on a
tmpfs, and then every figure is the page cache's) with a short read probe, the free disk, and
the machine profile the planner uses. Each finding that costs speed or correctness is a
`warning:` line with what to do; --json prints the same as one object.
"""

import argparse
import json
import os
import platform
import shutil
import sys
import time

from . import run

GB = 1e9
LOW_DISK = 20 * GB  # a 7B model at float16 is ~13 GB, its conversion needs it twice for a moment


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where to probe uncached reads and free disk (default: the mlx_flash "
                   "home, $MLX_FLASH_HOME or ~/.cache/mlx_flash, where converted models go)")
    p.add_argument("--no-probe", action="store_true", help="no read probe (writes a 256 MiB file the first time)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return run(lambda: report(args), "mlx_flash.doctor")


def report(args):
    from pathlib import Path

    from ..home import default_home

    where = Path(args.dir).expanduser() if args.dir else default_home()
    where.mkdir(parents=True, exist_ok=True)
    found, warnings = {}, []
    for check in (_platform, _memory, _mlx, _blas, _native, _storage):
        check(found, warnings, where, args)
    _profile(found, warnings)
    if args.json:
        print(json.dumps(found | {"warnings": warnings}, indent=1))
        return 0
    width = max(len(k) for k in found)
    for k, v in found.items():
        print(f"{k:<{width}}  {v}")
    for w in warnings:
        print(f"warning: {w}")
    if not warnings:
        print("no problems found")
    return 0


def _platform(found, warnings, where, args):
    from .. import __version__
    from ..plan.profile import cpu_name

    found["mlx_flash"] = __version__
    found["python"] = f"{platform.python_version()} ({sys.executable})"
    found["platform"] = f"{platform.system()} {platform.release()} {platform.machine()}"
    found["cpu"] = f"{cpu_name() or platform.processor() or '?'}, {os.cpu_count()} cores"


def _memory(found, warnings, where, args):
    from ..runtime.memory import cgroup_limit, physical_memory

    ram = physical_memory()
    found["ram"] = f"{ram / GB:.1f} GB"
    free = _available_memory()
    if free is not None:
        found["ram available"] = f"{free / GB:.1f} GB"
    cg = cgroup_limit()
    if cg is not None:
        found["cgroup memory limit"] = f"{cg / GB:.2f} GB (--memory-limit N% is planned under it)"


def _available_memory():
    """Bytes the kernel says are available (Linux MemAvailable; elsewhere free pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _mlx(found, warnings, where, args):
    import mlx.core as mx

    found["mlx"] = mx.__version__
    device = mx.default_device()
    gpu = []
    if getattr(mx, "metal", None) is not None and mx.metal.is_available():
        gpu.append("Metal")
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and getattr(cuda, "is_available", lambda: False)():
        gpu.append("CUDA")
    found["mlx device"] = f"{device} (GPU backends: {', '.join(gpu) or 'none'})"


def _blas(found, warnings, where, args):
    from ..blas import blas_info

    found["blas"] = blas_info()
    if "reference" in found["blas"]:
        warnings.append("MLX's CPU backend uses the reference BLAS: matrix products 10-20x slower; install OpenBLAS "
                        "(apt-get install libopenblas0-pthread) and run again")


def _threads(kernels):
    n = kernels.threads()
    return "default threads" if not n else f"{n} thread" + ("s" if n != 1 else "")


def _native(found, warnings, where, args):
    from ..io import native_available
    from ..kernels import kernels_module, pinning_name, simd_name

    found["reader pool"] = "native (pthreads, GIL released)" if native_available() else "Python threads"
    if not native_available():
        warnings.append("the reader's native extension is not built: reads cost ~4x the CPU and checksums are not "
                        "verified on streamed attention; reinstall mlx_flash with a C compiler (pip install -e .)")
    else:
        from ..io import _native as reader

        hardware = reader.crc32c_hardware(-1)
        found["checksums"] = "CRC32C instruction" if hardware else "CRC32C by table"
        if not hardware:
            warnings.append("checksums run by table (this CPU or build has no CRC32C instruction): a checked read "
                            "costs ~2x the CPU; --no-verify skips the checks")
    kernels, why = kernels_module()
    if kernels is None:
        found["quantized kernels"] = f"none ({why})"
        warnings.append(f"no native quantized kernels ({why}): 4-bit weights on the CPU go through MLX's quantized "
                        "matmul, 2x (decode) to 50x (prompt) slower than float32")
    else:
        found["quantized kernels"] = (f"native, {_threads(kernels)}, {simd_name(kernels)}; "
                                      f"{pinning_name(kernels)}")


def _storage(found, warnings, where, args):
    from ..io import FlashReader

    usage = shutil.disk_usage(where)
    found["mlx_flash home"] = str(where)
    found["disk free"] = f"{usage.free / GB:.1f} of {usage.total / GB:.1f} GB"
    if usage.free < LOW_DISK:
        warnings.append(f"{where}: {usage.free / GB:.1f} GB free; a 7B model converted at float16 takes ~13 GB "
                        "(set MLX_FLASH_HOME to a larger disk)")
    probe = where / ".doctor-probe.bin"
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 20))
    try:
        with FlashReader(threads=1) as r:
            fh = r.open(probe)
            uncached = fh.direct
    finally:
        probe.unlink()
    mech = "O_DIRECT" if sys.platform.startswith("linux") else "F_NOCACHE"
    fs = _file_system(where)
    if fs is not None:
        found["file system"] = fs
    if fs in MEMORY_FILE_SYSTEMS:
        uncached = False  # (a tmpfs accepts O_DIRECT on recent kernels, and its pages are DRAM all the same)
    found["uncached reads"] = f"yes ({mech})" if uncached else "no: reads go through the page cache"
    if fs in MEMORY_FILE_SYSTEMS:
        warnings.append(f"{where}: a {fs}, held in memory: models there are in DRAM already (counted by a memory "
                        "cgroup) and read at memory speed, not the disk's; keep them on a disk (MLX_FLASH_HOME)")
    elif not uncached:
        warnings.append(f"{where}: the file system refuses uncached reads ({mech}); flash reads would be the page "
                        "cache's (counted in a memory limit, and not the disk's speed): keep the models on a disk "
                        "file system (MLX_FLASH_HOME), not a network mount")
    if args.no_probe:
        return
    from ..plan.measure import probe_file, disk_curve

    t = time.perf_counter()
    rates = disk_curve([probe_file()], [65536, 1 << 20], seconds=0.5)
    found["read probe"] = ", ".join(f"{size // 1024} KiB {gbs:.2f} GB/s" for size, gbs in rates.items()) + \
        f" (uncached, random, {time.perf_counter() - t:.1f} s)"


MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def _file_system(path):
    """The type of the file system holding `path` (Linux: the longest mount point in
    /proc/self/mounts above it), or None."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    path = os.path.realpath(path)
    best = None
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[0])):
            best = (point, kind)
    return None if best is None else best[1]


def _profile(found, warnings):
    from ..plan.profile import VERSION, load_profile, profile_path

    path = profile_path()
    p = load_profile()
    if p is not None:
        found["machine profile"] = (f"{path}, measured {p.measured}{' (quick probe)' if p.quick else ''}; disk "
                                    f"{p.disk_gbs(256 * 1024):.2f} GB/s at 256 KiB")
        return
    if path.exists():
        found["machine profile"] = f"{path}: stale (another machine, MLX, device or version than {VERSION})"
    else:
        found["machine profile"] = "none cached"
    warnings.append("no current machine profile: --mode auto picks the plan that reads the fewest bytes instead of "
                    "the one the cost model predicts fastest; run `mlx_flash.benchmark profile` (about a minute)")

"""Choose the BLAS that MLX's CPU backend uses, whether or not MLX was imported first.

The mlx-cpu wheel for Linux links netlib's reference BLAS (libblas-*.so in
mlx_cpu.libs; about 4 GFLOP/s for float32 GEMM here). OpenBLAS is 60x faster
at GEMM (about 3x faster decode). Two ways to put it under MLX:

- before `import mlx.core`: load OpenBLAS with RTLD_GLOBAL. libmlx.so is opened
  as a dependency of mlx/core*.so, and the dynamic linker looks a symbol up in
  the global scope (the executable, LD_PRELOADs, RTLD_GLOBAL libraries) before
  libmlx's own dependencies, so its `cblas_*` and LAPACK imports bind to
  OpenBLAS. The same effect as LD_PRELOAD, without re-executing.
- after: CPython opens extension modules with RTLD_NOW (sys.getdlopenflags()),
  so every PLT slot of libmlx.so was bound to the reference BLAS during
  `import mlx.core` (LD_DEBUG=bindings shows `cblas_sgemm` bound there, not at
  the first matmul). A later RTLD_GLOBAL load changes nothing; the binding is
  only in libmlx's GOT. `_rebind_mlx` redoes what the dynamic linker would
  have done: it reads the GOT slots of MLX's libraries from their ELF
  relocations, and moves each slot that holds a reference BLAS/LAPACK function
  (checked with dladdr: that exact symbol in a libblas/liblapack) to the same
  symbol in OpenBLAS. It touches nothing else, and gives up (reference BLAS,
  with a warning) on anything it does not recognise.

On macOS MLX uses Accelerate and Metal; nothing to do.
"""

import ctypes
import mmap
import os
import platform
import re
import struct
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
    before the library loads, 225-295 GFLOP/s (2048^3, 2 cores). Only the
    kernel families the CPU's flags allow are chosen.
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


# ---- the GOT slots of MLX's libraries (after-the-fact binding, Linux ELF64 only) ----

_RELOCS = {62: (7, 6), 183: (1026, 1025)}  # e_machine: its (JUMP_SLOT, GLOB_DAT) types; x86_64, aarch64
_REFERENCE = re.compile(r"lib(c?blas|lapack)[-.]")  # the wheel's libblas-<hash>.so.3, liblapack-<hash>.so.3


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_size_t), ("name", ctypes.c_char_p)]  # the head of struct dl_phdr_info


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libc.dlsym.restype = ctypes.c_void_p
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _where(libc, addr):
    """(file, symbol) that the dynamic linker says holds the code at addr, or (None, None)."""
    info = _DlInfo()
    if not addr or not libc.dladdr(addr, ctypes.byref(info)) or not info.fname:
        return None, None
    if info.saddr != addr or not info.sname:  # inside a function, not its entry point
        return os.fsdecode(info.fname), None
    return os.fsdecode(info.fname), info.sname.decode()


def _mlx_objects(libc):
    """[(path, load address)] of the loaded shared objects that belong to the mlx package."""
    mlx = sys.modules.get("mlx")
    roots = [os.path.realpath(p) + os.sep for p in getattr(mlx, "__path__", [])]
    found = []
    callback_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p)

    def visit(info, size, data):
        name = os.fsdecode(info.contents.name or b"")
        if name and any(os.path.realpath(name).startswith(r) for r in roots):
            found.append((name, info.contents.addr))
        return 0

    libc.dl_iterate_phdr(callback_t(visit), None)
    return found


def _elf_slots(path):
    """[(symbol, slot offset)] for the imported functions of an ELF64
    little-endian shared object: its JUMP_SLOT and GLOB_DAT relocations to undefined
    symbols, read from the file (the in-memory dynamic section may be relocated)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            return []
        machine, = struct.unpack_from("<H", m, 18)
        if machine not in _RELOCS:
            return []
        phoff, = struct.unpack_from("<Q", m, 32)
        phentsize, phnum = struct.unpack_from("<HH", m, 54)
        loads, dynamic = [], None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from(
                "<IIQQQQQQ", m, phoff + i * phentsize)
            if p_type == 1:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == 2:
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            return []

        def offset(vaddr):
            for v, o, n in loads:
                if v <= vaddr < v + n:
                    return o + vaddr - v
            raise ValueError(f"address {vaddr:#x} not in a loaded segment of {path}")

        dyn = {}
        for tag, val in struct.iter_unpack("<qQ", m[dynamic[0]:dynamic[0] + dynamic[1]]):
            if tag == 0:
                break
            dyn.setdefault(tag, val)
        if dyn.get(20, 7) != 7 or 5 not in dyn or 6 not in dyn:  # DT_PLTREL must be DT_RELA
            return []
        strtab, symtab = offset(dyn[5]), offset(dyn[6])
        jump_slot, glob_dat = _RELOCS[machine]
        slots = []
        for table, size in ((dyn.get(23), dyn.get(2)), (dyn.get(7), dyn.get(8))):  # JMPREL, RELA
            if not table or not size:
                continue
            start = offset(table)
            for r_offset, r_info, r_addend in struct.iter_unpack("<QQq", m[start:start + size]):
                sym = r_info >> 32
                if (r_info & 0xFFFFFFFF) not in (jump_slot, glob_dat) or not sym or r_addend:
                    continue
                st_name, _, _, st_shndx = struct.unpack_from("<IBBH", m, symtab + sym * 24)
                if st_shndx == 0:  # undefined here: imported
                    end = m.find(b"\0", strtab + st_name)
                    slots.append((m[strtab + st_name:end].decode(), r_offset))
        return slots


def _mlx_slots(libc):
    """[(slot address, symbol, library path)] of every imported function of MLX's libraries."""
    return [(base + off, name, path) for path, base in _mlx_objects(libc) for name, off in _elf_slots(path)]


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _protection(addr):
    """The PROT_* bits of the mapping that holds addr (from /proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return (perms[0] == "r") * 1 | (perms[1] == "w") * 2 | (perms[2] == "x") * 4
    return None


def mlx_blas_library(symbol="cblas_sgemm"):
    """The file whose `symbol` MLX's CPU backend calls (read from libmlx's GOT; for a slot
    not bound yet, the library the dynamic linker's lookup would bind it to), or None when
    that cannot be told (not Linux, MLX not loaded, no such import, an unknown ELF)."""
    if platform.system() != "Linux" or "mlx.core" not in sys.modules:
        return None
    try:
        libc = _libc()
        for slot, name, path in _mlx_slots(libc):
            if name != symbol:
                continue
            where, sname = _where(libc, ctypes.c_void_p.from_address(slot).value)
            if sname == symbol:
                return where
            if where and _same_file(where, path):  # lazy: still points at its own PLT
                own = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
                for scope in (None, own):  # the global scope first, then libmlx and its dependencies
                    where, sname = _where(libc, libc.dlsym(scope, symbol.encode()))
                    if sname == symbol:
                        return where
        return None
    except Exception:
        return None


def _rebind_mlx(handle, path):
    """Move MLX's calls from the reference BLAS/LAPACK to the library at `path` (loaded as
    `handle`). Returns how many slots now point into it, 0 if none could be moved."""
    libc = _libc()
    page = mmap.PAGESIZE
    moved = 0
    for slot, name, _ in _mlx_slots(libc):
        where, sname = _where(libc, ctypes.c_void_p.from_address(slot).value)
        if sname != name or not _REFERENCE.match(os.path.basename(where)):
            continue  # not bound (lazy), or not to the reference BLAS/LAPACK: leave it
        new = libc.dlsym(handle, name.encode())
        new_where, new_name = _where(libc, new)
        if new_name != name or not _same_file(new_where, path):
            continue  # not defined by that library itself (found in one of its dependencies)
        prot = _protection(slot)  # RW for lazy-binding slots; R for RELRO (GLOB_DAT, or -z now)
        if prot is None or slot % ctypes.sizeof(ctypes.c_void_p):
            continue
        start = slot - slot % page
        if not prot & 2 and libc.mprotect(start, page, prot | 2) != 0:
            continue
        try:
            ctypes.c_void_p.from_address(slot).value = new  # an aligned word: one atomic store
        finally:
            if not prot & 2:
                libc.mprotect(start, page, prot)  # as ld.so left it
        moved += 1
    return moved


def setup_blas():
    """Load OpenBLAS globally on Linux and put it under MLX's CPU backend.

    Before `import mlx.core` that is enough; after it, MLX's bound calls are moved
    to OpenBLAS (see the module's docstring). Set MLX_FLASH_BLAS=reference to keep
    the wheel's own BLAS, or MLX_FLASH_BLAS=/path/libopenblas.so to pick a library.
    """
    if _state["blas"] is not None:
        return _state["blas"]
    if platform.system() == "Darwin":
        _state["blas"] = "Accelerate (macOS)"
        return _state["blas"]
    choice = os.environ.get("MLX_FLASH_BLAS", "")
    mlx_first = "mlx.core" in sys.modules
    if _global_openblas():
        served = mlx_blas_library() if mlx_first else None
        if served is None or "openblas" in os.path.basename(served).lower():
            _state["blas"] = "OpenBLAS (preloaded)"
            return _state["blas"]
        # loaded globally, but after mlx: MLX still calls the reference BLAS (below)
    if choice == "reference":
        _state["blas"] = "reference BLAS (MLX_FLASH_BLAS=reference)"
        return _state["blas"]
    for path in [choice] if choice else OPENBLAS_CANDIDATES:
        if path and os.path.exists(path):
            core = os.environ.get("OPENBLAS_CORETYPE") or openblas_coretype()
            if core and "OPENBLAS_CORETYPE" not in os.environ:
                os.environ["OPENBLAS_CORETYPE"] = core  # read by OpenBLAS when it loads
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            if not mlx_first:
                _state["blas"] = f"OpenBLAS ({path}, core {core or 'auto'})"
                return _state["blas"]
            try:
                moved = _rebind_mlx(lib._handle, path)
            except Exception:  # never fail an import over speed
                moved = 0
            served = mlx_blas_library()
            if served and _same_file(served, path):
                how = "rebound" if moved else "loaded"
                _state["blas"] = f"OpenBLAS ({path}, core {core or 'auto'}; {how} after mlx was imported)"
                return _state["blas"]
            _state["blas"] = "reference BLAS (mlx was imported before mlx_flash)"
            # measured: a 512-token SmolLM2 forward took 56 s instead of 2.9 s
            warnings.warn(f"mlx_flash: mlx was imported before mlx_flash and its CPU backend could not be moved "
                          f"to OpenBLAS: it keeps the wheel's reference BLAS (matrix products 10-20x slower). "
                          f"Import mlx_flash before mlx and mlx_lm, or run with LD_PRELOAD={path}",
                          stacklevel=3)
            return _state["blas"]
    _state["blas"] = (
        "reference BLAS (slow; install OpenBLAS: apt-get install libopenblas0-pthread)"
    )
    return _state["blas"]


def blas_info():
    return _state["blas"] or setup_blas()

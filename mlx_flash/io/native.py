"""The native extension (_native.c + crc32c.c), when it is built and not switched off, and
the helpers that use it where it is (NumPy otherwise)."""

import os

import numpy as np

from .formats import convert_py


def native_module():
    """-> (module, "") or (None, why not)."""
    if os.environ.get("MLX_FLASH_NO_NATIVE"):
        return None, "MLX_FLASH_NO_NATIVE is set"
    try:
        from . import _native
    except ImportError as e:
        return None, f"the native extension is not built ({e})"
    return _native, ""


def native_available():
    return native_module()[0] is not None


def move_rows(v, dst, src):
    """v[dst] = v[src] for a C-contiguous 2-D array and disjoint int64 row sets (C when built)."""
    mod = native_module()[0]
    if mod is not None and v.flags.c_contiguous and hasattr(mod, "move_rows"):
        mod.move_rows(v, v.strides[0], np.ascontiguousarray(dst, dtype=np.int64),
                      np.ascontiguousarray(src, dtype=np.int64))
    else:
        v[dst] = v[src]


def native_convert():
    """convert(src, src_code, dst, dst_code, n): 16-bit rows -> float32 (codes 1 float16,
    2 bfloat16; 0 float32), F16C in C when the extension is built, NumPy otherwise."""
    mod = native_module()[0]
    if mod is not None:
        return mod.convert

    def convert(src, src_code, dst, dst_code, n):
        stage = np.asarray(src).reshape(-1).view(np.uint8)
        convert_py(stage, 0, n, "bfloat16" if src_code == 2 else "float16", dst.reshape(-1)[:n])

    return convert

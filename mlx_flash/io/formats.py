"""The value formats of a read_bundles segment: float32 / float16 / bfloat16 in the file
(a Quantized is quantized_rows.py's), float32 or float16 in the destination; their codes
in _native.c's seg table, and the conversion in NumPy that the pure-Python pool runs (and
the C conversion's fallback, native.native_convert)."""

import numpy as np

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
DST_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}


def convert_py(stage, a, n, src_dtype, out):
    """stage[a:] holds n values of src_dtype -> out (float32 or float16), converted."""
    if src_dtype == "bfloat16":
        bits = stage[a : a + 2 * n].view(np.uint16)
        if out.dtype == np.float32:
            o = out.view(np.uint32)
            o[:] = bits
            o <<= 16
        else:
            out[:] = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        isz = ITEMSIZE[src_dtype]
        out[:] = stage[a : a + isz * n].view(src_dtype)

"""Native compute kernels for the CPU (optional, built by setup.py from _matvec.c): the
quantized matvec and row dequantization of weights held at their bits; products over a
token's rows of a float32 or 16-bit matrix (gather_mv / gather_axpy); and a batch's decode
step through tiles, each row dequantized or converted once for every sequence (qmm,
qmm_rows, qmm_cols; 16-bit or float32 rows: gather_mm, gather_mm_cols).

native.py loads the module (kernels_module), matvec.py wraps its products, passes.py says
which kernels a pass of several positions goes through (its BATCH_PASS and PROMPT_PASS are
set there). They know arrays, not models: models/quantized.py and models/ffn.py decide
where they are used.
"""

from .matvec import (
    QuantMatrix,
    alike,
    dequantize_cols,
    dequantize_rows,
    gather_axpy,
    gather_mm,
    gather_mm_cols,
    gather_mv,
    host_f32,
    qaxpy_cols,
    qmm_cols,
    qmm_rows,
    qmv_many,
    qmv_rows,
)
from .native import default_threads, kernels_module, pinning_name, simd_name
from .passes import SMALL_PASS, batched, pass_kernels, pass_notes_off

__all__ = [
    "SMALL_PASS",
    "QuantMatrix",
    "alike",
    "batched",
    "default_threads",
    "dequantize_cols",
    "dequantize_rows",
    "gather_axpy",
    "gather_mm",
    "gather_mm_cols",
    "gather_mv",
    "host_f32",
    "kernels_module",
    "pass_kernels",
    "pass_notes_off",
    "pinning_name",
    "qaxpy_cols",
    "qmm_cols",
    "qmm_rows",
    "qmv_many",
    "qmv_rows",
    "simd_name",
]

"""Builds the optional native parts; everything else is in pyproject.toml.

- mlx_flash/io/_native.c: the reader's pool, conversions and checksums;
- mlx_flash/kernels/_matvec.c: matrix-vector products on the CPU (weights held at their bits; a
  token's active rows of a neuron cache), and a batch's decode step over quantized weights.

Both are optional: if one fails to compile, the install still succeeds, and
FlashReader falls back to its pure-Python pool, quantized weights to MLX's own
quantized_matmul (each says so once).
"""

import sys

from setuptools import Extension, setup

# the compilers' default C dialect (gnu17) declares pread/posix_memalign on
# Linux and macOS; never -ffast-math (the float16 conversion needs IEEE rounding),
# and no a * b + c contracted into one fused multiply-add (GCC's default, clang's
# on arm64): dequantization must match MLX's and NumPy's separate multiply and add
args = ["-O3", "-Wall", "-ffp-contract=off"]

setup(
    ext_modules=[
        Extension(
            "mlx_flash.io._native",
            sources=["mlx_flash/io/_native.c", "mlx_flash/io/crc32c.c"],
            depends=["mlx_flash/io/crc32c.h", "mlx_flash/kernels/quant.h"],
            extra_compile_args=args,
            extra_link_args=[] if sys.platform == "darwin" else ["-pthread"],
            optional=True,
        ),
        Extension(
            "mlx_flash.kernels._matvec",
            sources=["mlx_flash/kernels/_matvec.c"],
            depends=["mlx_flash/kernels/quant.h", "mlx_flash/kernels/avx512.h", "mlx_flash/kernels/vnni.h",
                     "mlx_flash/kernels/vnni_cols.h", "mlx_flash/kernels/gemm16.h"],
            extra_compile_args=args,
            extra_link_args=[] if sys.platform == "darwin" else ["-pthread"],
            optional=True,
        ),
    ]
)

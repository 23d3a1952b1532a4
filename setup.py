"""Builds the optional native reader (mlx_flash/io/_native.c); everything else is in pyproject.toml.

The extension is optional: if it fails to compile, the install still succeeds
and FlashReader falls back to its pure-Python pool (and says so once).
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
            depends=["mlx_flash/io/crc32c.h"],
            extra_compile_args=args,
            extra_link_args=[] if sys.platform == "darwin" else ["-pthread"],
            optional=True,
        )
    ]
)

"""OpenBLAS is chosen for MLX even when NumPy (with its own renamed OpenBLAS) came first."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("first", ["", "import numpy; "])
def test_openblas_serves_mlx(first):
    import mlx_flash.blas as blas

    if not blas.blas_info().startswith("OpenBLAS"):
        pytest.skip("no system OpenBLAS on this machine")
    code = (first + "import mlx_flash, ctypes; from mlx_flash.blas import blas_info; "
            "ctypes.CDLL(None).openblas_get_config; print(blas_info())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("OpenBLAS (/"), out.stdout + out.stderr


# mlx imported before mlx_flash: tests/test_blas_import_order.py

"""OpenBLAS serves MLX's CPU backend whatever the import order (mlx_flash/blas.py).

CPython opens extension modules with RTLD_NOW, so `import mlx.core` binds libmlx's
`cblas_*` and LAPACK imports to the wheel's reference BLAS at once; mlx_flash moves
those GOT slots to OpenBLAS when it is imported later. Each case runs in a fresh
interpreter. The proof is deterministic: the library that libmlx's `cblas_sgemm`
slot points into, read before and after `import mlx_flash` (dladdr on the slot's
value); a loose timing ratio backs it up.
"""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

BLAS_PY = Path(__file__).resolve().parents[1] / "mlx_flash" / "blas.py"

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="Linux: the mlx-cpu wheel's BLAS")

# blas.py on its own (no package __init__, so nothing is set up yet): it reads the binding
PRELUDE = f"""
import importlib.util, json, os, sys, time, warnings
warnings.simplefilter("always")
spec = importlib.util.spec_from_file_location("_blas_probe", {str(BLAS_PY)!r})
probe = importlib.util.module_from_spec(spec); spec.loader.exec_module(probe)
"""

TIMED = """
a = mx.random.normal((512, 512)); mx.eval(a)
def best():
    t = []
    for _ in range(3):
        s = time.perf_counter(); mx.eval(a @ a); t.append(time.perf_counter() - s)
    return min(t)
ref = a @ a; mx.eval(ref)
out = {"before": probe.mlx_blas_library(), "lapack_before": probe.mlx_blas_library("sgetrf_"), "t_before": best()}
"""

AFTER = """
from mlx_flash.blas import blas_info, mlx_blas_library
out.update(info=blas_info(), after=mlx_blas_library(), lapack_after=mlx_blas_library("sgetrf_"))
if "a" in globals():
    out.update(t_after=best(), err=mx.abs(a @ a - ref).max().item(), scale=mx.abs(ref).max().item())
print(json.dumps(out))
"""


def _openblas():
    for path in (os.environ.get("MLX_FLASH_BLAS", ""), *_candidates()):
        if path and path != "reference" and os.path.exists(path):
            return path
    pytest.skip("no system OpenBLAS on this machine")


def _candidates():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_blas_candidates", BLAS_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.OPENBLAS_CANDIDATES


def _run(body, env=None):
    full = {**os.environ, **(env or {})}
    full.pop("LD_PRELOAD", None)
    res = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=full,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def _is_reference(path):
    return path is not None and os.path.basename(path).startswith(("libblas", "liblapack", "libcblas"))


def _same(a, b):
    return a is not None and os.path.samefile(a, b)


@pytest.mark.parametrize("first", ["import mlx.core as mx", "import mlx_lm\nimport mlx.core as mx"])
def test_mlx_imported_first_gets_openblas(first):
    openblas = _openblas()
    out, err = _run(first + "\n" + TIMED + "from mlx_flash import load\n" + AFTER)
    if not _is_reference(out["before"]):
        pytest.skip(f"this mlx wheel's matmul is not on a reference BLAS to begin with: {out['before']}")
    assert _is_reference(out["lapack_before"]), out
    # the slots now point into OpenBLAS: GEMM and LAPACK, as when OpenBLAS is loaded first
    assert _same(out["after"], openblas), out
    assert _same(out["lapack_after"], openblas), out
    assert out["info"].startswith("OpenBLAS (/") and "rebound after mlx was imported" in out["info"], out
    assert "mlx_flash:" not in err, err
    assert out["err"] <= 1e-4 * max(1.0, out["scale"]), out  # the same product
    # and it is the fast one (~20-50x here; 3x leaves room for a busy shared machine)
    assert out["t_before"] > 3 * out["t_after"], out


def test_imported_before_mlx_still_preloads():
    openblas = _openblas()
    out, err = _run("import mlx_flash\nimport mlx.core as mx\nout = {}\n" + AFTER)
    assert _same(out["after"], openblas), out
    assert out["info"].startswith("OpenBLAS (/") and "after mlx" not in out["info"], out


def test_reference_choice_is_kept():
    _openblas()
    out, err = _run("import mlx.core as mx\nout = {'before': probe.mlx_blas_library()}\nimport mlx_flash\n" + AFTER,
                    env={"MLX_FLASH_BLAS": "reference"})
    if not _is_reference(out["before"]):
        pytest.skip(f"this mlx wheel's matmul is not on a reference BLAS to begin with: {out['before']}")
    assert out["info"] == "reference BLAS (MLX_FLASH_BLAS=reference)", out
    assert _same(out["after"], out["before"]), out
    assert "mlx_flash:" not in err, err


def test_lazy_binding_is_reported_truthfully():
    """With RTLD_LAZY the slots are not bound yet: the global OpenBLAS wins at the first call."""
    openblas = _openblas()
    out, err = _run("sys.setdlopenflags(os.RTLD_LAZY)\nimport mlx.core as mx\nout = {}\nimport mlx_flash\n"
                    "x = mx.ones((64, 64)); mx.eval(x @ x)\n" + AFTER)
    assert _same(out["after"], openblas), out
    assert out["info"].startswith("OpenBLAS (/") and "after mlx was imported" in out["info"], out


def test_when_it_cannot_switch_it_says_what_to_do():
    _openblas()
    body = ("import mlx.core as mx\nprobe._rebind_mlx = lambda handle, path: 0\n"
            "before = probe.mlx_blas_library()\n"
            "print(json.dumps({'before': before, 'info': probe.setup_blas(), 'after': probe.mlx_blas_library()}))\n")
    out, err = _run(body)
    if not _is_reference(out["before"]):
        pytest.skip(f"this mlx wheel's matmul is not on a reference BLAS to begin with: {out['before']}")
    assert out["info"] == "reference BLAS (mlx was imported before mlx_flash)", out
    assert _same(out["after"], out["before"]), out
    assert "Import mlx_flash before mlx" in err and "LD_PRELOAD=" in err, err

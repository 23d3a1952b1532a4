import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# A home of the tests' own (bench checkpoints, converted models, the machine profile), the same
# on every machine: --mode auto chooses by the cost model only where a profile is cached, so a
# developer's cached profile must not change what the tests see. Set before anything imports
# mlx_flash, and inherited by the CLI subprocesses.
os.environ["MLX_FLASH_HOME"] = tempfile.mkdtemp(prefix="mlx-flash-test-home-")
atexit.register(shutil.rmtree, os.environ["MLX_FLASH_HOME"], ignore_errors=True)

import mlx_flash  # noqa: E402,F401  (BLAS set-up before mlx is imported)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"
DEFAULT_GGUF = REPO / "models" / "download" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2():
    if not (DEFAULT_MODEL / "manifest.json").exists():
        pytest.skip("default model not built (make model)")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def smollm2_gguf():
    if not DEFAULT_GGUF.exists():
        pytest.skip("default GGUF not fetched (make model)")
    return DEFAULT_GGUF

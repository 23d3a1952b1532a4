import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

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

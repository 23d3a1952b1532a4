import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

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


class TinyLlama(NamedTuple):
    flash: Path  # the converted folder (<dir>/flash)
    hf: Path  # the Hugging Face folder it was converted from (<dir>/hf)
    config: dict
    tensors: dict
    dir: Path  # the fresh temporary folder holding both


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A factory: tiny_llama(name, dtype, dip=False, variant="llama", **overrides) writes a random
    llama (helpers.make_llama_folder, its config changed by `overrides`) into a fresh temporary
    folder named after `name`, converts it there at `dtype` (with DIP's orientation where dip)
    and returns a TinyLlama."""
    from helpers import make_llama_folder

    from mlx_flash.convert import convert

    def make(name, dtype, dip=False, variant="llama", **overrides):
        d = tmp_path_factory.mktemp(name)
        src, cfg, tensors = make_llama_folder(d / "hf", variant, **overrides)
        return TinyLlama(convert(src, d / "flash", dtype=dtype, progress=False, dip=dip), src, cfg, tensors, d)

    return make

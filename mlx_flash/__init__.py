"""mlx_flash: run language models larger than memory, FFN weights streamed from flash."""

from .blas import setup_blas

setup_blas()  # must run before mlx is imported (see blas.py)

from .errors import FlashError  # noqa: E402
from .generate import batch_generate, generate, stream_generate  # noqa: E402
from .loader import load  # noqa: E402

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "batch_generate", "FlashError", "__version__"]

"""Sources (Hub repo, HF / mlx-lm folder, GGUF) -> the flash layout: streaming, resumable.

May import layout, models (their tensor names), errors; never the runtime.
"""

from .convert import convert
from .sources import open_source

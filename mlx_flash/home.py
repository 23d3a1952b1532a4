"""Where mlx_flash keeps what it makes: converted models, benchmark checkpoints, the machine
profile ($MLX_FLASH_HOME, else ~/.cache/mlx_flash)."""

import os
from pathlib import Path


def default_home():
    return Path(os.environ.get("MLX_FLASH_HOME", Path.home() / ".cache" / "mlx_flash"))

"""Where mlx_flash keeps what it makes: converted models, benchmark checkpoints, the machine
profile ($MLX_FLASH_HOME, else ~/.cache/mlx_flash)."""

import os
from pathlib import Path

from .errors import FlashError


def default_home():
    """$MLX_FLASH_HOME (unset or empty: ~/.cache/mlx_flash): a folder, or a path where one can be
    made; a FlashError naming the variable where it, or a folder above it, is a file."""
    value = os.environ.get("MLX_FLASH_HOME")
    if not value:
        return Path.home() / ".cache" / "mlx_flash"
    home = Path(value).expanduser()
    for p in (home, *home.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == home else f"lies under {p}, a file"
            raise FlashError(f"MLX_FLASH_HOME={value} {what}, not a folder: point MLX_FLASH_HOME at a folder "
                             "(or unset it for ~/.cache/mlx_flash)")
        if p.exists():
            break
    return home

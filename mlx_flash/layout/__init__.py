"""The on-disk format: the manifest (format.py, its only writer), bundle layouts,
streaming safetensors, export back to HF. Imports nothing of mlx_flash but errors.
"""

from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    BundleLayout,
    Manifest,
    is_flash_folder,
    read_manifest,
)

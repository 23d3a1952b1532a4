"""The on-disk format: the manifest (format.py, its only writer; schema.py, what a manifest may
hold, checked whenever one is read), bundle layouts, streaming safetensors, quantization
(quant.py), export back to HF, whole-folder checks (verify.py). Imports nothing of mlx_flash but
errors and io (the reader's segment type, the checksum's C code), and the model families where
config.json is read (export; schema.missing_parts: a manifest against config.json).
"""

from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    BundleLayout,
    Manifest,
    is_flash_folder,
    read_manifest,
)

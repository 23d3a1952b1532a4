from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    BundleLayout,
    Manifest,
    is_flash_folder,
    read_manifest,
)

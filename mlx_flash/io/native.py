"""The native extension (_native.c + crc32c.c), when it is built and not switched off."""

import os


def native_module():
    """-> (module, "") or (None, why not)."""
    if os.environ.get("MLX_FLASH_NO_NATIVE"):
        return None, "MLX_FLASH_NO_NATIVE is set"
    try:
        from . import _native
    except ImportError as e:
        return None, f"the native extension is not built ({e})"
    return _native, ""

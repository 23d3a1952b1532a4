class FlashError(Exception):
    """A user-facing error: one clear line, no traceback."""

"""The one parser of sizes and shares that every option uses.

`parse_size`: '2GB' (decimal), '512MiB' / '512M' (binary), '16K', a plain byte
count. `parse_share`: the same, or 'N%' of a whole that the caller names
(the memory budget's "50%" is of the model's weights; the peers' limit's of
the float32 model, over 100 % allowed there). Errors name the option.
"""

import re

from .errors import FlashError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB,
         "t": 1 << 40, "tib": 1 << 40, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}
_SIZE = re.compile(r"([0-9]*\.?[0-9]+)([a-z]*)")


def parse_size(text, what="size", examples="2GB, 512MiB, 16K"):
    """'2GB' -> 2e9, '16KiB' / '16K' -> 16384 (K, M, G, T binary; KB, MB, GB, TB decimal)."""
    m = _SIZE.fullmatch(str(text).strip().lower().replace(" ", ""))
    if not m or m.group(2) not in UNITS:
        raise FlashError(f"{what}: cannot read {str(text)!r} (examples: {examples})")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def parse_share(text, what, max_percent=100.0, examples="50%, 4GB, 512MiB"):
    """'50%' -> ('fraction', 0.5); '4GB' -> ('bytes', 4e9)."""
    t = str(text).strip()
    if t.endswith("%"):
        try:
            v = float(t[:-1])
        except ValueError:
            raise FlashError(f"{what}: cannot read {t!r} (examples: {examples})")
        if not 0 < v <= max_percent:
            raise FlashError(f"{what}: {t} is not a percentage in (0, {max_percent:g}]")
        return ("fraction", v / 100)
    return ("bytes", parse_size(t, what, examples))

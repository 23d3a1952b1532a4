"""System specs for the peers benchmark: `mlx_flash:flash:dip:0.5@none` -> System, and
the --limit / --flash-budget texts -> (kind, value). Imports nothing of the package."""

import re
from dataclasses import dataclass

from ...errors import FlashError
from ...sizes import MiB, parse_share

MB = 1e6
RUNTIMES = ("mlx_flash", "mlx_lm", "llama.cpp")
MLX_FLASH_MODES = ("auto", "dense", "naive", "hybrid", "flash")
SPARSITIES = ("oracle", "threshold", "dip", "dip-ca", "predictor", "calibrated", "calibrated-ca", "calibrated-uniform")
GGUF_TYPES = ("f32", "f16", "q4_1", "gguf")  # gguf: the source GGUF at its own blocks (q4_1: the same)
# the default model is 4-bit: under a limit its resident weights are held at their bits
DEFAULT_SYSTEMS = ("mlx_flash:dense@none,mlx_flash:hybrid,mlx_flash:naive,mlx_flash:flash:dip:0.5,"
                   "mlx_lm,llama.cpp-q4_1,llama.cpp-f16")
DEFAULT_MODEL = "models/smollm2-135m-instruct"

SPEC_HELP = ("mlx_flash:auto (the mode --mode auto chooses), mlx_flash:dense, mlx_flash:naive, mlx_flash:hybrid, mlx_flash:flash:<sparsity>:<density> "
             "(e.g. mlx_flash:flash:dip:0.5), each with ':f16' to hold the weights at float16 in DRAM "
             "(e.g. mlx_flash:hybrid:f16), mlx_lm, llama.cpp-f32, llama.cpp-f16, llama.cpp-gguf (the GGUF the model was converted from, as it is; "
             "llama.cpp-q4_1 says the same); "
             "append @none for no memory limit or @<size> (e.g. @400MB) for a limit of its own")


# --- systems ---


@dataclass(frozen=True)
class System:
    spec: str  # as written on the command line
    runtime: str  # mlx_flash | mlx_lm | llama.cpp
    mode: str = None  # mlx_flash
    sparsity: str = None  # mlx_flash flash mode
    density: float = None
    gguf: str = None  # llama.cpp: f32 | f16 | q4_1 | gguf
    limit: str = None  # None: the run's --limit; "none": no limit; else a size
    resident_dtype: str = None  # mlx_flash: "float16" holds the weights at 16 bits (":f16")

    @property
    def name(self):
        return self.spec.split("@")[0]


def parse_system(spec):
    """'mlx_flash:flash:dip:0.5@none' -> System; FlashError naming the valid forms otherwise."""
    text = spec.strip()
    if not text:
        raise FlashError(f"empty system spec (valid: {SPEC_HELP})")
    base, at, limit = text.partition("@")
    if at:
        if limit.lower() == "none":
            limit = "none"
        else:
            parse_limit(limit, what=f"system '{text}': limit")
    else:
        limit = None

    def bad(why):
        return FlashError(f"system '{text}': {why} (valid: {SPEC_HELP})")

    parts = base.split(":")
    head = parts[0]
    if head == "mlx_flash":
        held = None
        if len(parts) > 2 and parts[-1] == "f16":  # weights held at float16 in DRAM
            held, parts = "float16", parts[:-1]
        if len(parts) < 2:
            raise bad("mlx_flash needs a mode")
        mode = parts[1]
        if mode not in MLX_FLASH_MODES:
            raise bad(f"unknown mlx_flash mode '{mode}' (modes: {', '.join(MLX_FLASH_MODES)})")
        if mode != "flash":
            if len(parts) > 2:
                raise bad(f"mode {mode} takes no sparsity or density")
            return System(text, "mlx_flash", mode=mode, limit=limit, resident_dtype=held)
        if len(parts) != 4:
            raise bad("the flash mode needs a sparsity source and a density, e.g. mlx_flash:flash:dip:0.5")
        sparsity, density = parts[2], parts[3]
        if sparsity not in SPARSITIES:
            raise bad(f"unknown sparsity '{sparsity}' (sources: {', '.join(SPARSITIES)})")
        try:
            d = float(density)
        except ValueError:
            raise bad(f"density '{density}' is not a number")
        if not 0 < d <= 1:
            raise bad(f"density {density} is not in (0, 1]")
        return System(text, "mlx_flash", mode="flash", sparsity=sparsity, density=d, limit=limit,
                      resident_dtype=held)
    if head == "mlx_lm":
        if len(parts) > 1:
            raise bad("mlx_lm takes no options")
        return System(text, "mlx_lm", limit=limit)
    m = re.fullmatch(r"llama\.cpp-([a-z0-9_]+)", base)
    if m:
        if m.group(1) not in GGUF_TYPES:
            raise bad(f"unknown llama.cpp weights '{m.group(1)}' (choose from {', '.join(GGUF_TYPES)})")
        return System(text, "llama.cpp", gguf=m.group(1), limit=limit)
    raise bad(f"unknown system '{base}'")


def parse_systems(text):
    systems = [parse_system(s) for s in str(text).split(",") if s.strip()]
    if not systems:
        raise FlashError(f"no systems given (valid: {SPEC_HELP})")
    seen = set()
    for s in systems:
        if s.spec in seen:
            raise FlashError(f"system '{s.spec}' is given twice")
        seen.add(s.spec)
    return systems


LIMIT_OF = ("float32", "stored")  # what --limit N% is a share of: the float32 weights, or the files' bytes


def parse_limit(text, what="--limit"):
    """'50%' -> ('fraction', 0.5); '400MB' -> ('bytes', 400e6); 'none' -> ('none', None)."""
    if str(text).strip().lower() == "none":
        return ("none", None)
    kind, v = parse_share(text, what, max_percent=1000, examples="50%, 400MB, 512MiB, none")
    if kind == "bytes" and v < MiB:
        raise FlashError(f"{what}: {text} is under 1 MiB")
    return (kind, v)


def parse_flash_budget(text):
    """--flash-budget: limit | auto | full | N% (of the float32 model) | a size."""
    t = str(text).strip().lower()
    if t in ("limit", "auto", "full"):
        return (t, None)
    kind, v = parse_limit(text, what="--flash-budget")
    if kind == "none":
        raise FlashError("--flash-budget: none is not a budget (limit, auto, full, 40%, 200MB)")
    return (kind, v)

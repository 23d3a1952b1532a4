"""Command-line tools: thin main() functions over the library.

Each main parses, calls the library, prints; model options come from
runtime.FlashConfig (add_cli_args / from_cli).
"""

import os
import sys
from pathlib import Path

from ..errors import FlashError

DEFAULT_MODEL = "models/smollm2-135m-instruct"


def default_model():
    return os.environ.get("MLX_FLASH_MODEL", DEFAULT_MODEL)


def run(main_fn, prog):
    """Run a CLI body; user mistakes become one line on stderr and exit code 2."""
    try:
        return main_fn() or 0
    except FlashError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130


DEVICES = ("cpu", "gpu")


def add_device_arg(p):
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="where MLX computes (default: MLX's default device, the GPU where this MLX has one)")


def use_device(name):
    """Make `name` ("cpu" | "gpu" | None: leave MLX's default) MLX's default device for this
    command; a clear error where this MLX has no GPU backend."""
    if name is None:
        return
    import platform

    import mlx.core as mx

    if name not in DEVICES:
        raise FlashError(f"--device {name}: choose from {', '.join(DEVICES)}")
    if name == "gpu" and not mx.is_available(mx.gpu):
        raise FlashError(f"--device gpu: this MLX ({mx.__version__} on {platform.system()} {platform.machine()}) "
                         "has no GPU backend (Metal on a Mac, CUDA builds elsewhere); use --device cpu")
    mx.set_default_device(mx.gpu if name == "gpu" else mx.cpu)


def check_model_arg(model):
    p = Path(model)
    if model == DEFAULT_MODEL and not p.exists():
        raise FlashError(
            f"the default model is not at {model}; build it with `make model` "
            "(or pass --model <hf-repo | folder | file.gguf>)"
        )
    return model

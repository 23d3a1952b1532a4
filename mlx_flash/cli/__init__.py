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


def check_model_arg(model):
    p = Path(model)
    if model == DEFAULT_MODEL and not p.exists():
        raise FlashError(
            f"the default model is not at {model}; build it with `make model` "
            "(or pass --model <hf-repo | folder | file.gguf>)"
        )
    return model

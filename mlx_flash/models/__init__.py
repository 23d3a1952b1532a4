"""Model families: MLX definitions whose FFN reads from the flash layout.

Models never open files: their FFN asks a store (runtime/) for rows. May import
errors, io (half.py's converter); never the runtime, the loader or the CLI.
"""

import importlib

from ..errors import FlashError

FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "smollm2": "llama",
    "phi3": "llama",
    "granite": "llama",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "gemma3": "gemma",
    "opt": "opt",
    "phi": "neox",
    "persimmon": "neox",
    "falcon": "neox",
    "mixtral": "moe",
    "qwen2_moe": "moe",
    "qwen3_moe": "moe",
    "olmoe": "moe",
}


def get_family(model_type):
    """The module defining `model_type`: ModelArgs, Model, ffn_kinds, ffn_tensors, resident_name."""
    if model_type not in FAMILIES:
        raise FlashError(
            f"unsupported model type '{model_type}' (supported: {', '.join(sorted(FAMILIES))})"
        )
    return importlib.import_module(f".{FAMILIES[model_type]}", __name__)


def model_args(config):
    """config.json dict -> (family module, ModelArgs), with clear errors."""
    model_type = config.get("model_type")
    if not model_type:
        raise FlashError("config.json has no 'model_type'")
    family = get_family(model_type)
    try:
        args = family.ModelArgs.from_dict(config)
    except TypeError as e:
        raise FlashError(f"config.json does not describe a {model_type} model ({e})")
    family.check_supported(args)
    return family, args

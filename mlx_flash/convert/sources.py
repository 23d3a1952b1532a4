"""Model sources for the converter: each yields HF-named float32 tensors, one at a time.

A source has `config` (the HF config dict), `names()`, `shape(name)`,
`read(name)` (float32 numpy, HF orientation), `write_tokenizer(dir)`, `close()`;
and for quantized weights `quant(name)` (a QuantSpec when the tensor is stored
in MLX's affine form, exactly), `read_quantized(name)` (its values as they are:
layout/quant.py's QuantTensor) and `lossy(name)` (the name of a quantized type
with no exact MLX form, which the converter re-quantizes).
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..layout.safetensors_io import ST_TO_NUMPY, SafetensorsFile

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class SafetensorsFolderSource:
    """A Hugging Face or mlx-lm model folder (config.json + *.safetensors).

    mlx-lm folders may be quantized (`quantization` in config.json): a weight
    then comes with `.scales` and `.biases`, and is dequantized here.
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        cfg_path = self.folder / "config.json"
        if not cfg_path.is_file():
            raise FlashError(f"{folder}: no config.json; not a Hugging Face or mlx-lm model folder")
        try:
            self.config = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise FlashError(f"{cfg_path}: invalid JSON ({e})")
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            other = [p.name for p in self.folder.glob("*.bin")] + [p.name for p in self.folder.glob("*.pth")]
            hint = f" (found {', '.join(other)}: PyTorch pickles are not read; use a safetensors copy)" if other else ""
            raise FlashError(f"{folder}: no .safetensors weight files{hint}")
        self.files = {}
        for path in files:
            st = SafetensorsFile(path)
            for name in st.names():
                self.files[name] = st
        q = self.config.get("quantization") or self.config.get("quantization_config")
        self.quantization = q if q and "bits" in q and "group_size" in q else None
        if self.quantization and self.quantization.get("mode", "affine") != "affine":
            raise FlashError(f"{cfg_path}: quantization mode '{self.quantization['mode']}' is not "
                             "supported (only MLX's affine mode)")
        self.config.pop("quantization", None)
        self.config.pop("quantization_config", None)
        self._specs = {}

    def names(self):
        return [
            n
            for n in self.files
            if not (self.quantization and (n.endswith(".scales") or n.endswith(".biases")))
        ]

    def _is_quantized(self, name):
        return (
            self.quantization is not None
            and name.endswith(".weight")
            and name[: -len("weight")] + "scales" in self.files
        )

    def quant(self, name):
        if not self._is_quantized(name):
            return None
        if name not in self._specs:
            from ..layout.quant import QuantSpec, check_quant

            stem = name[: -len(".weight")]
            per_module = self.quantization.get(stem)
            q = per_module if isinstance(per_module, dict) else self.quantization
            group = q["group_size"]
            w_shape = self.files[name].shape(name)
            words = w_shape[-1]
            for part in ("scales", "biases"):
                p_name = f"{stem}.{part}"
                if p_name not in self.files:
                    raise FlashError(f"{self.folder}: {name} is quantized but has no {part}")
                p_shape = self.files[p_name].shape(p_name)
                if p_shape[:-1] != w_shape[:-1] or p_shape != self.files[stem + ".scales"].shape(stem + ".scales"):
                    raise FlashError(f"{self.folder}: {p_name} has shape {tuple(p_shape)}, which does not "
                                     f"match the weight {tuple(w_shape)}")
            groups = self.files[stem + ".scales"].shape(stem + ".scales")[-1]
            n_in = groups * group
            bits = words * 32 // n_in
            where = f"{self.folder}: {name}"
            check_quant(bits, group, where)
            if words * 32 != n_in * bits or (isinstance(per_module, dict) and per_module.get("bits", bits) != bits):
                raise FlashError(f"{where}: {words} packed words and {groups} scales per row fit no "
                                 f"{group}-value groups (config.json's quantization does not match the weights)")
            dtype = self.files[stem + ".scales"].tensors[stem + ".scales"]["dtype"]
            scale_dtype = ST_TO_NUMPY.get(dtype)
            if scale_dtype is None:
                raise FlashError(f"{where}: scales of dtype {dtype} are not supported")
            self._specs[name] = QuantSpec(bits, group, scale_dtype)
        return self._specs[name]

    def lossy(self, name):
        return None

    def read_quantized(self, name):
        from ..layout.quant import QuantTensor

        spec = self.quant(name)
        stem = name[: -len("weight")]
        w = self.files[name].read_raw(name)[0]
        scales, biases = (self.files[stem + p].read_raw(stem + p)[0] for p in ("scales", "biases"))
        if scales.shape != biases.shape or scales.shape[0] != w.shape[0]:
            raise FlashError(f"{self.folder}: {stem}scales {scales.shape} / biases {biases.shape} do "
                             f"not match the weight {w.shape}")
        return QuantTensor(np.ascontiguousarray(w), scales, biases, spec)

    def shape(self, name):
        shape = self.files[name].shape(name)
        if self._is_quantized(name):
            shape = shape[:-1] + (shape[-1] * 32 // self.quant(name).bits,)
        return shape

    def read(self, name):
        if not self._is_quantized(name):
            x = self.files[name].read(name)
            return x if x.dtype != np.float64 else x.astype(np.float32)
        return self.read_quantized(name).dequantized()

    def write_tokenizer(self, out_dir):
        found = False
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                shutil.copy2(self.folder / name, Path(out_dir) / name)
                found = found or name.startswith("tokenizer")
        if not found:
            raise FlashError(f"{self.folder}: no tokenizer files (tokenizer.json / tokenizer.model)")

    def close(self):
        pass


def looks_like_repo_id(s):
    return re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", s) is not None and not s.startswith(".")


def download(repo_id, revision=None):
    """A Hub repo -> local snapshot folder (huggingface_hub's cache; works offline once cached)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # the hub raises many kinds; all mean "could not get it"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashError(f"could not get '{repo_id}' from the Hugging Face Hub: {msg}")


CONVERSION_FILES = ("manifest.json", "resident.safetensors", "ffn", "experts", "journal.json")
CONVERT_HINT = "mlx_flash.convert --model <hf-repo | folder | file.gguf> --out <folder>"


def check_not_flash_folder(folder):
    """Refuse, as a model to convert, a folder an mlx_flash conversion wrote: a converted model
    (its manifest.json), or a conversion's files without the manifest that lists them."""
    folder = Path(folder)
    if (folder / "manifest.json").is_file():
        raise FlashError(f"{folder} is a converted mlx_flash model folder already (it has manifest.json): load "
                         "it as it is; the converter reads Hugging Face and mlx-lm folders and .gguf files")
    found = [name for name in CONVERSION_FILES if (folder / name).exists()]
    if found:
        raise FlashError(f"{folder} has no manifest.json: not an mlx_flash model folder (its {', '.join(found)} "
                         "are a conversion's files without the manifest that lists them: an unfinished or "
                         f"damaged conversion); convert the model again with {CONVERT_HINT}")


def open_source(source, revision=None):
    """A path (folder or .gguf) or a Hub repo id -> a source object."""
    s = str(source)
    path = Path(s).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from .gguf import GGUFSource

            return GGUFSource(path)
        raise FlashError(f"{path}: not a model (expected a folder, a .gguf file or a Hub repo id)")
    if path.is_dir():
        check_not_flash_folder(path)
        return SafetensorsFolderSource(path)
    if not looks_like_repo_id(s):
        raise FlashError(f"{s}: no such file or folder")
    return SafetensorsFolderSource(download(s, revision))

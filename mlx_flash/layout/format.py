"""The flash layout: a converted model folder, written down and versioned.

    <model>/
      config.json            the model's own Hugging Face config
      tokenizer files        tokenizer.json, tokenizer_config.json, ...
      resident.safetensors   everything that stays in DRAM: embeddings,
                             attention, norms, FFN biases (MLX parameter names)
      ffn/layer_000.bin ...  one file per layer: neuron i's bundle at offset
                             i * bundle_stride, holding its rows of each weight
                             kind back to back ([gate_i | up_i | down_i] for
                             SwiGLU, [up_i | down_i] for a ReLU FFN; down_i is
                             column i of the down projection), zero-padded to
                             a multiple of `align` bytes so that one uncached
                             (O_DIRECT / F_NOCACHE) read fetches one bundle
      manifest.json          this format's name and version, dtypes, the bundle
                             layout, every file's size and sha256
      dip/in_NNN.bin,        optional (convert --dip), for Dynamic Input Pruning:
      dip/down_NNN.bin       input dim j's bundle [gate[:, j] | up[:, j]] (the
                             columns input pruning selects), and neuron i's
                             down row alone (what GLU pruning selects)

A folder is complete only if manifest.json exists: the converter writes into
a temporary folder and renames it into place last.
"""

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import FlashError
from .safetensors_io import from_storage

FORMAT_NAME = "mlx_flash"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RESIDENT = "resident.safetensors"
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def round_up(n, align):
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class BundleLayout:
    """Where bundle i of a layer lives in a file of bundles.

    For the neuron orientation a bundle is a neuron and its rows have d_model
    values; for the DIP input orientation a bundle is an input dimension and
    its rows (columns of gate / up) have n_ff values: `d_model` is the row
    length, `n_neurons` the number of bundles.
    """

    kinds: tuple  # e.g. ("gate", "up", "down")
    d_model: int  # values per row
    n_neurons: int  # bundles per file
    dtype: str  # float32 | float16 | bfloat16
    align: int = 512

    @property
    def itemsize(self):
        return DTYPES[self.dtype]

    @property
    def row_bytes(self):
        return self.d_model * self.itemsize

    @property
    def bundle_bytes(self):
        return len(self.kinds) * self.row_bytes

    @property
    def stride(self):
        return round_up(self.bundle_bytes, self.align)

    @property
    def file_size(self):
        return self.n_neurons * self.stride

    def offset(self, neuron):
        return neuron * self.stride

    def storage_dtype(self):
        return np.uint16 if self.dtype == "bfloat16" else np.dtype(self.dtype)

    def split(self, raw):
        """Bytes of consecutive bundles -> {kind: float32 array [n, d_model]}."""
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.stride)
        out = {}
        for j, kind in enumerate(self.kinds):
            part = raw[:, j * self.row_bytes : (j + 1) * self.row_bytes]
            part = np.ascontiguousarray(part).view(self.storage_dtype())
            out[kind] = from_storage(part, self.dtype)
        return out

    def pack(self, rows):
        """{kind: float array [n, d_model]} -> bytes of n padded bundles."""
        from .safetensors_io import to_storage

        n = next(iter(rows.values())).shape[0]
        buf = np.zeros((n, self.stride), dtype=np.uint8)
        for j, kind in enumerate(self.kinds):
            data = to_storage(rows[kind], self.dtype).reshape(n, self.d_model)
            buf[:, j * self.row_bytes : (j + 1) * self.row_bytes] = data.view(np.uint8)
        return buf


@dataclass
class Manifest:
    model_type: str
    dtype: str
    layout: BundleLayout
    ffn_files: list  # [{"file", "size", "sha256"}] one per layer
    resident: dict  # {"file", "size", "sha256"}
    source: str = ""
    calibration: dict = field(default_factory=dict)
    dip: dict = field(default_factory=dict)  # {"input"|"down": {"layout": BundleLayout, "files": [...]}}
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self):
        d = asdict(self)
        d["layout"]["kinds"] = list(self.layout.kinds)
        for part in d["dip"].values():
            part["layout"]["kinds"] = list(part["layout"]["kinds"])
        return json.dumps(d, indent=1)

    @classmethod
    def from_dict(cls, d, where=""):
        if d.get("format") != FORMAT_NAME:
            raise FlashError(f"{where}: not an mlx_flash manifest")
        if d.get("version") != FORMAT_VERSION:
            raise FlashError(
                f"{where}: flash layout version {d.get('version')} is not supported "
                f"(this mlx_flash reads version {FORMAT_VERSION}); convert the model again"
            )
        try:
            lay = dict(d["layout"])
            lay["kinds"] = tuple(lay["kinds"])
            d = dict(d)
            d["layout"] = BundleLayout(**lay)
            d["dip"] = {
                name: {"layout": BundleLayout(**dict(part["layout"], kinds=tuple(part["layout"]["kinds"]))),
                       "files": part["files"]}
                for name, part in d.get("dip", {}).items()
            }
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise FlashError(f"{where}: malformed manifest ({e})")


def is_flash_folder(path):
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder):
    path = Path(folder) / MANIFEST
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise FlashError(f"{folder}: no {MANIFEST}; not a converted mlx_flash model")
    except (OSError, ValueError) as e:
        raise FlashError(f"{path}: unreadable manifest ({e})")
    return Manifest.from_dict(d, where=str(path))


def write_manifest(folder, manifest):
    """The only writer of manifest.json: a temporary file, fsync, rename over the old one,
    so a reader sees the old manifest or the new one, never half of one."""
    path = Path(folder) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # the rename itself durable
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def add_manifest_section(folder, name, value):
    """Set one section of a converted folder's manifest ("calibration", "dip") and write it
    back atomically; -> the new Manifest."""
    manifest = read_manifest(folder)
    if name not in ("calibration", "dip"):
        raise ValueError(f"unknown manifest section '{name}'")
    setattr(manifest, name, value)
    write_manifest(folder, manifest)
    return manifest


def sha256_file(path, chunk=8 << 20):
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = f.readinto(view)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def check_file(folder, entry, checksum=True):
    """Raise FlashError if a manifest file is missing, resized or altered."""
    path = Path(folder) / entry["file"]
    try:
        size = os.path.getsize(path)
    except OSError:
        raise FlashError(f"{path}: missing (the model folder is incomplete; convert again)")
    if size != entry["size"]:
        raise FlashError(
            f"{path}: size {size} != {entry['size']} in the manifest "
            "(file truncated or changed since conversion)"
        )
    if checksum and sha256_file(path) != entry["sha256"]:
        raise FlashError(
            f"{path}: sha256 differs from the manifest (file changed since conversion)"
        )

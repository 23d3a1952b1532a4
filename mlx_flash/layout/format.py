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
      ffn/scales_000.safetensors ...  quantized layouts only: per layer, the
                             scales and biases of the weight kinds stored as
                             columns (see below)
      dip/in_NNN.bin,        optional (convert --dip), for Dynamic Input Pruning:
      dip/down_NNN.bin       input dim j's bundle [gate[:, j] | up[:, j]] (the
                             columns input pruning selects), and neuron i's
                             down row alone (what GLU pruning selects)

Quantized layouts (version 2, `layout.quant`): every weight W [out, in] is
quantized as MLX does (layout/quant.py: groups along `in`), and its values are
kept bit-exact. A bundle's gate and up parts are rows of W (a neuron's packed
values, then its scales, then its biases: one read fetches them). Its down
part is column i of W_down [d_model, n_ff], whose d_model values belong to
d_model different groups: the bundle holds the column's packed values, and
the scales and biases stay in DRAM as a table, in the layer's
`ffn/scales_NNN.safetensors`: "<table>.<kind>.scales" / ".biases",
[n_bundles / group_size, row length] (row i // group_size is bundle i's),
<table> being the layout's `tables`. The
DIP input orientation is all columns (of gate and up); its down rows share
the main layout's down table. A float layout (version 1 and 2) has no tables.

Checksums (version 2): next to every file of bundles X.bin, X.crc32c holds
the CRC32C of each bundle's part of each weight kind (uint32 little-endian,
[n_bundles, n_kinds]), so that the reader checks every part it reads
(io/checksum.py); the manifest entry names it ("crc32c": {file, size, sha256}).
A version 1 folder has none and loads unchecked, with a line that says so.

Mixtures of experts (version 3): no neuron bundles (`ffn_files` empty); the
manifest's `experts` section names an ExpertLayout and, per layer, its file of
expert bundles with their checksums (layout/experts.py).

A folder is complete only if manifest.json exists: the converter writes into
a temporary folder and renames it into place last. read_manifest checks a
manifest against its schema (layout/schema.py) before anything uses it: every
field's type and range, every file named inside the folder.
"""

import hashlib
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import FlashError, ModelFileError
from .quant import SCALE_DTYPES, QuantSpec, dequantize
from .safetensors_io import from_storage
from .schema import FORMAT_NAME, READ_VERSIONS, check_sizes, validate_manifest

FORMAT_VERSION = 2  # 2: quantized layouts (layout.quant, scales.safetensors)
MOE_VERSION = 3  # 3: expert bundles (layout/experts.py); written for mixture-of-experts models only
MANIFEST = "manifest.json"
RESIDENT = "resident.safetensors"
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def round_up(n, align):
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class BundleLayout:
    """Where bundle i of a layer lives in a file of bundles, and what it holds.

    For the neuron orientation a bundle is a neuron and its rows have d_model
    values; for the DIP input orientation a bundle is an input dimension and
    its rows (columns of gate / up) have n_ff values: `d_model` is the row
    length, `n_neurons` the number of bundles.

    quant: the bundle's values are quantized (see the module docstring); the
    kinds in `columns` are columns of their weight, whose scales live in the
    table `tables`.<kind> of the layer's scales file.
    """

    kinds: tuple  # e.g. ("gate", "up", "down")
    d_model: int  # values per row
    n_neurons: int  # bundles per file
    dtype: str  # float32 | float16 | bfloat16 (a float layout's values)
    align: int = 512
    quant: QuantSpec | None = None
    columns: tuple = ()  # quantized kinds stored as columns (scales in a table)
    tables: str = ""  # their tables' prefix in the scales files

    @property
    def itemsize(self):
        return DTYPES[self.dtype]

    def kind_bytes(self, kind):
        """Bytes of one weight kind's part of a bundle."""
        if self.quant is None:
            return self.d_model * self.itemsize
        if kind in self.columns:
            return self.quant.packed_bytes(self.d_model)
        return self.quant.row_bytes(self.d_model)

    def kind_offset(self, kind):
        return sum(self.kind_bytes(k) for k in self.kinds[: self.kinds.index(kind)])

    def parts(self):
        """[(offset, bytes)] of each weight kind's part of a bundle: what a checksum covers."""
        return [(self.kind_offset(k), self.kind_bytes(k)) for k in self.kinds]

    @property
    def row_bytes(self):
        """Bytes of one row of a float layout."""
        if self.quant is not None:
            raise AttributeError("a quantized layout's rows differ by kind: use kind_bytes(kind)")
        return self.d_model * self.itemsize

    @property
    def bundle_bytes(self):
        return sum(self.kind_bytes(k) for k in self.kinds)

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

    def table_name(self, kind):
        return f"{self.tables}.{kind}"

    @property
    def table_shape(self):
        """A column kind's scales (or biases) table: (neuron groups, d_model); None without one."""
        if self.quant is None or not self.columns:
            return None
        return (self.n_neurons // self.quant.group_size, self.d_model)

    @property
    def table_bytes(self):
        """One layer's column tables in DRAM (read_tables' arrays: scales and biases of each column
        kind), 0 without them. (A layer's scale file may hold other layouts' tables too.)"""
        shape = self.table_shape
        if shape is None:
            return 0
        return len(self.columns) * 2 * shape[0] * shape[1] * SCALE_DTYPES[self.quant.scale_dtype]

    def segments(self, views, tables=None, kinds=None):
        """FlashReader.read_bundles segments placing each kind of `kinds` (default all) into
        views[kind], each at its offset in the bundle; tables: {kind: (scales, biases)} of a
        layer, for the column kinds."""
        from ..io import Quantized

        out = []
        for k in kinds or self.kinds:
            src = self.dtype
            if self.quant is not None:
                q = self.quant
                table = tables[k] if k in self.columns else None
                src = Quantized(q.bits, q.group_size, q.scale_dtype, table)
            out.append((self.kind_offset(k), self.d_model, src, views[k]))
        return out

    def raw_segments(self, views, kinds=None):
        """Segments copying each kind's part of a quantized bundle as it is (packed values and
        inline scales) into views[kind], float32 containers of kind_bytes / 4 values a row."""
        return [(self.kind_offset(k), self.kind_bytes(k) // 4, "float32", views[k]) for k in kinds or self.kinds]

    def raw_parts(self, raw):
        """Bytes of consecutive bundles -> {kind: float32 container [n, kind_bytes / 4]} of each
        kind's part as it is (a quantized layout's packed values and inline scales): the rows a
        packed cache holds."""
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.stride)
        return {k: np.ascontiguousarray(raw[:, o : o + n]).view(np.float32) for k, (o, n) in zip(self.kinds, self.parts())}

    def stored(self, raw):
        """A float16 layout's bundles -> {kind: float16 array [n, d_model]} as stored: what a held
        float16 cache keeps, with no float32 copy on the way."""
        if self.quant is not None or self.dtype != "float16":
            raise ValueError(f"stored(): a float16 layout's rows, not {self.dtype}'s (a quantized one's: raw_parts)")
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.stride)
        return {k: np.ascontiguousarray(raw[:, off : off + self.kind_bytes(k)]).view(self.storage_dtype())
                for k in self.kinds for off in (self.kind_offset(k),)}

    def split(self, raw, tables=None, first=0):
        """Bytes of consecutive bundles (the first one bundle `first`) -> {kind: float32 array
        [n, d_model]}; tables: {kind: (scales, biases)} of the layer, for column kinds."""
        raw = np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.stride)
        out = {}
        for k in self.kinds:
            off = self.kind_offset(k)
            part = np.ascontiguousarray(raw[:, off : off + self.kind_bytes(k)])
            if self.quant is None:
                out[k] = from_storage(part.view(self.storage_dtype()), self.dtype)
                continue
            q, n = self.quant, self.d_model
            packed = part[:, : q.packed_bytes(n)]
            if k in self.columns:
                ids = (first + np.arange(part.shape[0])) // q.group_size
                scales, biases = (from_storage(np.ascontiguousarray(t[ids, :n]), q.scale_dtype) for t in tables[k])
                out[k] = dequantize(packed, scales, biases, q.bits, 1, n)  # a scale per value
                continue
            g = n // q.group_size
            sb = np.ascontiguousarray(part[:, q.packed_bytes(n):])
            sb = sb.view(np.uint16 if q.scale_dtype == "bfloat16" else np.dtype(q.scale_dtype))
            sb = from_storage(sb, q.scale_dtype)
            out[k] = dequantize(packed, sb[:, :g], sb[:, g:], q.bits, q.group_size, n)
        return out

    def pack(self, rows):
        """{kind: float array [n, d_model]} -> bytes of n padded bundles (a float layout), or
        for a quantized one {kind: uint8 array [n, kind_bytes(kind)]} (layout/quant.py's
        bundle parts) -> the same."""
        from .safetensors_io import to_storage

        n = next(iter(rows.values())).shape[0]
        buf = np.zeros((n, self.stride), dtype=np.uint8)
        for k in self.kinds:
            off, size = self.kind_offset(k), self.kind_bytes(k)
            if self.quant is None:
                data = to_storage(rows[k], self.dtype).reshape(n, self.d_model).view(np.uint8)
            else:
                data = rows[k]
                if data.dtype != np.uint8 or data.shape != (n, size):
                    raise ValueError(f"{k}: expected uint8 [{n}, {size}], got {data.dtype} {data.shape}")
            buf[:, off : off + size] = data
        return buf

    @classmethod
    def from_dict(cls, d):
        d = dict(d, kinds=tuple(d["kinds"]), columns=tuple(d.get("columns", ())))
        if d.get("quant") is not None:
            d["quant"] = QuantSpec(**d["quant"])
        return cls(**d)


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
    scales: list = field(default_factory=list)  # quantized layouts: per layer {"file", "size", "sha256"}
    options: dict = field(default_factory=dict)  # the conversion's options ({"quant": ...})
    experts: dict = field(default_factory=dict)  # MoE: {"layout": ExpertLayout, "files": [entry | None per layer]}
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self):
        return json.dumps(asdict(self), indent=1)

    @property
    def quant(self):
        return self.layout.quant

    @classmethod
    def from_dict(cls, d, where=""):
        if d.get("format") != FORMAT_NAME:
            raise FlashError(f"{where}: not an mlx_flash manifest")
        if d.get("version") not in READ_VERSIONS:
            raise FlashError(
                f"{where}: flash layout version {d.get('version')} is not supported "
                f"(this mlx_flash reads versions {', '.join(map(str, READ_VERSIONS))}); "
                "convert the model again"
            )
        try:
            d = dict(d)
            d["layout"] = BundleLayout.from_dict(d["layout"])
            d["dip"] = {name: {"layout": BundleLayout.from_dict(part["layout"]), "files": part["files"]}
                        for name, part in d.get("dip", {}).items()}
            if d.get("experts"):
                from .experts import ExpertLayout

                d["experts"] = dict(d["experts"], layout=ExpertLayout.from_dict(d["experts"]["layout"]))
            return cls(**d)
        except (KeyError, TypeError, ValueError) as e:
            raise FlashError(f"{where}: malformed manifest ({e})")


def is_flash_folder(path):
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder):
    """A model folder's manifest, checked against the schema (layout/schema.py) -> Manifest."""
    path = Path(folder) / MANIFEST
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise FlashError(f"{folder} has no {MANIFEST}: not an mlx_flash model folder; convert a model into "
                         "it with mlx_flash.convert --model <hf-repo | folder | file.gguf> --out <folder>")
    except (OSError, ValueError) as e:
        raise FlashError(f"{path}: unreadable manifest ({e}); convert the model again")
    validate_manifest(d, path)
    manifest = Manifest.from_dict(d, where=str(path))
    check_sizes(manifest, path)
    return manifest


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


def add_manifest_section(folder, name, value, merge=False):
    """Set one section of a converted folder's manifest ("calibration", "dip") and write it
    back atomically; merge: set only value's keys, keep the section's others (calibrations of
    different sources share the "calibration" section). -> the new Manifest."""
    manifest = read_manifest(folder)
    if name not in ("calibration", "dip"):
        raise ValueError(f"unknown manifest section '{name}'")
    setattr(manifest, name, dict(getattr(manifest, name)) | value if merge else value)
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
    """Raise ModelFileError (a FlashError: the model's files, not the caller, are at fault) if a
    manifest file is missing, not a regular file, unreadable, resized or altered."""
    path = Path(folder) / entry["file"]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: missing (the model folder is incomplete; convert again)")
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror}); check the path and its permissions")
    if not stat.S_ISREG(st.st_mode):
        what = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ModelFileError(f"{path}: {what}, where the manifest lists a data file (the model folder is "
                             "damaged; convert again)")
    if st.st_size != entry["size"]:
        raise ModelFileError(
            f"{path}: size {st.st_size} != {entry['size']} in the manifest "
            "(file truncated or changed since conversion)"
        )
    if checksum and file_sha256(path) != entry["sha256"]:
        raise ModelFileError(
            f"{path}: sha256 differs from the manifest (file changed since conversion)"
        )


def file_sha256(path):
    """sha256_file, an unreadable file a ModelFileError naming it."""
    try:
        return sha256_file(path)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror}); check its permissions")


def read_tables(folder, manifest, layout, verify=True):
    """The column kinds' scale tables of a quantized layout, per layer:
    [{kind: (scales, biases)}] as stored (bfloat16 as uint16); [] for a float layout."""
    if layout.quant is None or not layout.columns:
        return []
    from .safetensors_io import SafetensorsFile

    if len(manifest.scales) != len(manifest.ffn_files):
        raise FlashError(f"{folder}: the manifest lists {len(manifest.scales)} scale files for "
                         f"{len(manifest.ffn_files)} layers; convert the model again")
    q = layout.quant
    storage = np.dtype(np.uint16 if q.scale_dtype == "bfloat16" else q.scale_dtype)
    shape = layout.table_shape
    out = []
    for entry in manifest.scales:
        check_file(folder, entry, checksum=verify)
        st = SafetensorsFile(Path(folder) / entry["file"])
        tables = {}
        for k in layout.columns:
            pair = []
            for part in ("scales", "biases"):
                name = f"{layout.table_name(k)}.{part}"
                if name not in st.names():
                    raise FlashError(f"{st.path}: no tensor {name}; convert the model again")
                a = np.ascontiguousarray(st.read_raw(name)[0])
                if a.dtype != storage or a.shape != shape:
                    raise FlashError(f"{st.path}: {name} is {a.dtype} {a.shape}, the layout needs "
                                     f"{q.scale_dtype} {shape}; convert the model again")
                pair.append(a)
            tables[k] = tuple(pair)
        out.append(tables)
    return out


def checksum_name(rel):
    """The checksum file of a file of bundles: ffn/layer_000.bin -> ffn/layer_000.crc32c."""
    return str(Path(rel).with_suffix(".crc32c"))


def read_checksums(folder, entry, layout, verify=True):
    """A bundle file's per-part CRC32Cs, uint32 [n_bundles, n_kinds], or None (version 1)."""
    crc = entry.get("crc32c")
    if crc is None:
        return None
    check_file(folder, crc, checksum=verify)
    try:
        table = np.fromfile(Path(folder) / crc["file"], dtype="<u4").astype(np.uint32)
    except OSError as e:
        raise ModelFileError(f"{Path(folder) / crc['file']}: cannot be read ({e.strerror}); check its permissions")
    if table.size != layout.n_neurons * len(layout.kinds):
        raise FlashError(f"{Path(folder) / crc['file']}: {table.size} checksums, expected "
                         f"{layout.n_neurons} x {len(layout.kinds)}")
    return table.reshape(layout.n_neurons, len(layout.kinds))

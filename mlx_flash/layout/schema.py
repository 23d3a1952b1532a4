"""What a manifest.json may hold, checked before anything reads it (format.read_manifest).

validate_manifest: the type and range of every field the loader, the stores and the tools
read, and every file the manifest names a relative path that stays inside the model folder
(symlinks resolved). check_sizes: each file of bundles as large as its layout says.
missing_parts: what the model config.json describes that the manifest does not list (every
layer, every weight kind, the experts of a mixture of experts).

A damaged or hand-edited manifest is one FlashError naming manifest.json and the field, never
a crash further on.
"""

import re
from pathlib import Path

from ..errors import FlashError
from .experts import FLOAT_BYTES, layer_groups
from .quant import BITS, GROUP_SIZES, SCALE_DTYPES

FORMAT_NAME = "mlx_flash"
READ_VERSIONS = (1, 2, 3)
FLOAT_DTYPES = tuple(FLOAT_BYTES)
WEIGHT_KINDS = ("gate", "up", "down")
DIP_PARTS = ("input", "down")
SHA256 = re.compile(r"[0-9a-f]{64}")

TOP_REQUIRED = ("format", "version", "model_type", "dtype", "layout", "ffn_files", "resident")
TOP_OPTIONAL = ("source", "calibration", "dip", "scales", "options", "experts")
LAYOUT_REQUIRED = ("kinds", "d_model", "n_neurons", "dtype")
LAYOUT_OPTIONAL = ("align", "quant", "columns", "tables")
EXPERT_LAYOUT_REQUIRED = ("n_experts", "d_model", "d_expert", "dtype")
EXPERT_LAYOUT_OPTIONAL = ("quant", "align")
QUANT_FIELDS = ("bits", "group_size", "scale_dtype")
FIX = "the manifest is damaged or was edited by hand; convert the model again"


def fail(path, field, what):
    raise FlashError(f"{path}: {field}: {what} ({FIX})")


def shown(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def expect(path, field, ok, wanted, value):
    if not ok:
        fail(path, field, f"expected {wanted}, got {shown(value)}")


def check_object(path, field, value, required=(), optional=None):
    """A JSON object with every `required` key, and (optional not None) no key beyond
    required + optional."""
    expect(path, field, isinstance(value, dict), "an object", value)
    for key in required:
        if key not in value:
            fail(path, field, f"no '{key}'")
    if optional is not None:
        unknown = sorted(set(value) - set(required) - set(optional))
        if unknown:
            fail(path, field, f"unknown field '{unknown[0]}'")
    return value


def check_list(path, field, value):
    expect(path, field, isinstance(value, list), "a list", value)
    return value


def check_int(path, field, value, low=0):
    expect(path, field, isinstance(value, int) and not isinstance(value, bool) and value >= low,
           f"an integer >= {low}", value)
    return value


def check_number_of(path, field, value, choices):
    """An integer among `choices` (bits, a group size)."""
    expect(path, field, isinstance(value, int) and not isinstance(value, bool) and value in choices,
           f"one of {', '.join(map(str, choices))}", value)
    return value


def check_choice(path, field, value, choices):
    expect(path, field, isinstance(value, str) and value in choices, f"one of {', '.join(choices)}", value)
    return value


def check_str(path, field, value):
    expect(path, field, isinstance(value, str), "a string", value)
    return value


def check_power_of_two(path, field, value):
    expect(path, field, isinstance(value, int) and not isinstance(value, bool) and value > 0
           and not value & (value - 1), "a power of two", value)
    return value


def check_inside(folder, rel, path, field):
    """`rel` names a file inside `folder`: relative, no '..', and (symlinks resolved) still under it."""
    if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        fail(path, field, f"{shown(rel)} is not a path inside the model folder (a manifest names its "
                          "own files only)")
    root = Path(folder).resolve()
    real = (root / rel).resolve()
    if real != root and not real.is_relative_to(root):
        raise FlashError(f"{path}: {field}: {shown(rel)} resolves to {real}, outside the model folder {root} "
                         "(a symlink out of it); a model's files are read only inside its folder: copy the "
                         "file in, or convert the model again")


def check_entry(folder, path, field, entry, bundles=False, crc=False):
    """A file entry {"file", "size", "sha256"} (+ "crc32c", itself an entry, for a file of bundles:
    required where `crc`)."""
    check_object(path, field, entry, ("file", "size", "sha256"))
    check_str(path, f"{field}.file", entry["file"])
    check_inside(folder, entry["file"], path, f"{field}.file")
    check_int(path, f"{field}.size", entry["size"])
    expect(path, f"{field}.sha256", isinstance(entry["sha256"], str) and SHA256.fullmatch(entry["sha256"]),
           "64 hexadecimal digits", entry["sha256"])
    if bundles and (crc or "crc32c" in entry):
        if "crc32c" not in entry:
            fail(path, field, "no 'crc32c' (the bundles' checksum file)")
        check_entry(folder, path, f"{field}.crc32c", entry["crc32c"])


def check_quant_spec(path, field, value):
    if value is None:
        return None
    check_object(path, field, value, QUANT_FIELDS, ())
    check_number_of(path, f"{field}.bits", value["bits"], BITS)
    check_number_of(path, f"{field}.group_size", value["group_size"], GROUP_SIZES)
    check_choice(path, f"{field}.scale_dtype", value["scale_dtype"], tuple(SCALE_DTYPES))
    return value


def check_layout(path, field, layout, bundles_needed=True):
    """A BundleLayout's dict (format.py)."""
    check_object(path, field, layout, LAYOUT_REQUIRED, LAYOUT_OPTIONAL)
    kinds = check_list(path, f"{field}.kinds", layout["kinds"])
    expect(path, f"{field}.kinds", kinds and all(isinstance(k, str) and k in WEIGHT_KINDS for k in kinds)
           and len(set(kinds)) == len(kinds), f"distinct weight kinds of {', '.join(WEIGHT_KINDS)}", kinds)
    check_int(path, f"{field}.d_model", layout["d_model"], 1)
    check_int(path, f"{field}.n_neurons", layout["n_neurons"], 1 if bundles_needed else 0)
    check_choice(path, f"{field}.dtype", layout["dtype"], FLOAT_DTYPES)
    check_power_of_two(path, f"{field}.align", layout.get("align", 512))
    q = check_quant_spec(path, f"{field}.quant", layout.get("quant"))
    columns = check_list(path, f"{field}.columns", layout.get("columns", []))
    expect(path, f"{field}.columns", all(isinstance(k, str) and k in kinds for k in columns),
           f"kinds of {kinds}", columns)
    check_str(path, f"{field}.tables", layout.get("tables", ""))
    if q is not None:
        for name in ("d_model", "n_neurons"):
            if layout[name] % q["group_size"]:
                fail(path, f"{field}.{name}", f"{layout[name]} is not a multiple of the quantization "
                                              f"group size {q['group_size']}")


def check_expert_layout(path, field, layout):
    """An ExpertLayout's dict (experts.py)."""
    check_object(path, field, layout, EXPERT_LAYOUT_REQUIRED, EXPERT_LAYOUT_OPTIONAL)
    for name in ("n_experts", "d_model", "d_expert"):
        check_int(path, f"{field}.{name}", layout[name], 1)
    check_choice(path, f"{field}.dtype", layout["dtype"], FLOAT_DTYPES)
    check_power_of_two(path, f"{field}.align", layout.get("align", 4096))
    q = check_quant_spec(path, f"{field}.quant", layout.get("quant"))
    if q is not None:
        for name in ("d_model", "d_expert"):
            if layout[name] % q["group_size"]:
                fail(path, f"{field}.{name}", f"{layout[name]} is not a multiple of the quantization "
                                              f"group size {q['group_size']}")


def check_experts(folder, path, section, crc):
    """The experts section: {"layout", "files": [entry | {"groups": [...]} | None per layer]}."""
    check_object(path, "experts", section, ("layout", "files"), ())
    check_expert_layout(path, "experts.layout", section["layout"])
    n_experts = section["layout"]["n_experts"]
    files = check_list(path, "experts.files", section["files"])
    if not any(e is not None for e in files):
        fail(path, "experts.files", "no layer has experts")
    for i, entry in enumerate(files):
        field = f"experts.files[{i}]"
        if entry is None:
            continue
        if not (isinstance(entry, dict) and "groups" in entry):
            check_entry(folder, path, field, entry, bundles=True, crc=crc)
            continue
        if section["layout"].get("quant") is None:
            fail(path, field, "experts at several bit widths need a quantized layout")
        groups = check_list(path, f"{field}.groups", entry["groups"])
        seen = []
        for j, g in enumerate(groups):
            gf = f"{field}.groups[{j}]"
            check_entry(folder, path, gf, g, bundles=True, crc=crc)
            check_object(path, gf, g, ("bits", "experts"))
            check_number_of(path, f"{gf}.bits", g["bits"], BITS)
            ids = check_list(path, f"{gf}.experts", g["experts"])
            expect(path, f"{gf}.experts", ids and all(isinstance(e, int) and not isinstance(e, bool)
                                                      and 0 <= e < n_experts for e in ids),
                   f"expert numbers 0..{n_experts - 1}", ids)
            seen += ids
        if sorted(seen) != list(range(n_experts)):
            fail(path, f"{field}.groups", f"the groups do not hold each of the layer's {n_experts} experts "
                                          "exactly once")


def check_calibration(folder, path, section):
    """The calibration section: its files' entries (predictors, recovery, expert_paths, the
    thresholds' norms); the rest is read by the sparsity sources that use it."""
    check_object(path, "calibration", section)
    for name, part in section.items():
        if isinstance(part, dict) and "file" in part:
            check_entry(folder, path, f"calibration.{name}", part)
        if isinstance(part, dict) and isinstance(part.get("norms"), dict):
            check_entry(folder, path, f"calibration.{name}.norms", part["norms"])


def validate_manifest(d, path):
    """Raise FlashError naming `path` (a model folder's manifest.json) and the field, unless the
    parsed manifest `d` holds every field the readers use, of its type and in its range."""
    path = Path(path)
    folder = path.parent
    expect(path, "the top level", isinstance(d, dict), "a JSON object", d)
    if d.get("format") != FORMAT_NAME:
        raise FlashError(f"{path}: not an mlx_flash manifest (format {shown(d.get('format'))}, "
                         f"expected '{FORMAT_NAME}')")
    version = d.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version not in READ_VERSIONS:
        raise FlashError(
            f"{path}: flash layout version {d.get('version')} is not supported "
            f"(this mlx_flash reads versions {', '.join(map(str, READ_VERSIONS))}); "
            "convert the model again")
    check_object(path, "the top level", d, TOP_REQUIRED, TOP_OPTIONAL)
    crc = d["version"] >= 2  # (version 1 folders have no bundle checksums)
    check_str(path, "model_type", d["model_type"])
    check_choice(path, "dtype", d["dtype"], FLOAT_DTYPES)
    check_str(path, "source", d.get("source", ""))
    check_object(path, "options", d.get("options", {}))
    experts = check_object(path, "experts", d.get("experts", {}))
    check_layout(path, "layout", d["layout"], bundles_needed=not experts)
    ffn = check_list(path, "ffn_files", d["ffn_files"])
    if not ffn and not experts:
        fail(path, "ffn_files", "lists no layer")
    for i, entry in enumerate(ffn):
        check_entry(folder, path, f"ffn_files[{i}]", entry, bundles=True, crc=crc)
    check_entry(folder, path, "resident", d["resident"])
    scales = check_list(path, "scales", d.get("scales", []))
    for i, entry in enumerate(scales):
        check_entry(folder, path, f"scales[{i}]", entry)
    layout = d["layout"]
    if layout.get("quant") is not None and layout.get("columns") and len(scales) != len(ffn):
        fail(path, "scales", f"lists {len(scales)} scale files for {len(ffn)} layers")
    for name, part in check_object(path, "dip", d.get("dip", {}), (), DIP_PARTS).items():
        check_object(path, f"dip.{name}", part, ("layout", "files"), ())
        check_layout(path, f"dip.{name}.layout", part["layout"])
        files = check_list(path, f"dip.{name}.files", part["files"])
        if len(files) != len(ffn):
            fail(path, f"dip.{name}.files", f"lists {len(files)} files for {len(ffn)} layers")
        for i, entry in enumerate(files):
            check_entry(folder, path, f"dip.{name}.files[{i}]", entry, bundles=True, crc=crc)
    if experts:
        check_experts(folder, path, experts, crc)
    check_calibration(folder, path, d.get("calibration", {}))


def check_sizes(manifest, path):
    """Every file of bundles as large as its layout's bundles, and its checksum file as large as a
    checksum per bundle and kind: what the readers read at the offsets the layout gives."""

    def check(field, entry, layout):
        if entry["size"] != layout.file_size:
            fail(path, f"{field}.size", f"{entry['size']} bytes, but {layout.n_neurons} bundles of "
                                        f"{layout.stride} bytes are {layout.file_size}")
        crc = entry.get("crc32c")
        if crc is not None and crc["size"] != 4 * layout.n_neurons * len(layout.kinds):
            fail(path, f"{field}.crc32c.size", f"{crc['size']} bytes, but {layout.n_neurons} bundles of "
                                               f"{len(layout.kinds)} parts have "
                                               f"{4 * layout.n_neurons * len(layout.kinds)} bytes of checksums")

    for i, entry in enumerate(manifest.ffn_files):
        check(f"ffn_files[{i}]", entry, manifest.layout)
    for name, part in manifest.dip.items():
        for i, entry in enumerate(part["files"]):
            check(f"dip.{name}.files[{i}]", entry, part["layout"])
    if manifest.experts:
        for i in range(len(manifest.experts["files"])):
            for j, group in enumerate(layer_groups(manifest.experts, i)):
                grouped = "groups" in manifest.experts["files"][i]
                check(f"experts.files[{i}]" + (f".groups[{j}]" if grouped else ""), group.entry, group.layout)


def layers_named(numbers):
    """[1] -> "layer 1"; [3, 4, 5, 9] -> "layers 3..5, 9"."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}..{n}")
            start = None
    return ("layer " if len(numbers) == 1 else "layers ") + ", ".join(out)


def missing_parts(manifest, config):
    """What the model config.json describes (`config`, its dict) that the manifest does not
    list, or lists otherwise: ["layers 3..29 missing (...)", ...]; [] for a complete manifest."""
    from ..models import model_args

    family, args = model_args(config)
    n = args.num_hidden_layers
    out = []
    if hasattr(family, "expert_tensors"):  # a mixture of experts
        if not manifest.experts:
            return [f"no experts listed (config.json describes a mixture of experts, {args.model_type})"]
        files, lay = manifest.experts["files"], manifest.experts["layout"]
        want = [i for i in range(n) if family.expert_tensors(args, i) is not None]
        lacking = [i for i in want if i >= len(files) or files[i] is None]
        if lacking:
            out.append(f"the experts of {layers_named(lacking)} missing (config.json has {n} layers)")
        extra = [i for i, e in enumerate(files) if e is not None and i not in want]
        if extra:
            out.append(f"experts listed in {layers_named(extra)}, where config.json has none")
        for name, got, wanted in (("experts per layer", lay.n_experts, args.n_experts),
                                  ("hidden size", lay.d_model, args.hidden_size),
                                  ("expert size", lay.d_expert, args.d_expert)):
            if got != wanted:
                out.append(f"{name} {got}, config.json says {wanted}")
        return out
    if manifest.experts:
        return [f"experts listed, but config.json describes a dense {args.model_type} model"]
    listed = len(manifest.ffn_files)
    if listed < n:
        out.append(f"{layers_named(list(range(listed, n)))} missing (it lists {listed} of config.json's {n} layers)")
    elif listed > n:
        out.append(f"{listed} layers listed, config.json has {n}")
    kinds = tuple(family.ffn_kinds(args))
    if tuple(manifest.layout.kinds) != kinds:
        out.append(f"weight kinds {', '.join(manifest.layout.kinds)}, the model needs {', '.join(kinds)}")
    if manifest.layout.d_model != args.hidden_size:
        out.append(f"hidden size {manifest.layout.d_model}, config.json says {args.hidden_size}")
    return out

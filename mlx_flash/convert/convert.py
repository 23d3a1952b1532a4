"""Convert a model into the flash layout, streaming: one tensor or one layer's FFN in memory at a time.

The output is written under a temporary name next to the target and renamed
into place only when every file and the manifest are on disk, so a killed or
failed conversion never leaves a half-written model folder.
"""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..layout.format import DTYPES, MANIFEST, RESIDENT, BundleLayout, Manifest, is_flash_folder
from ..layout.safetensors_io import SafetensorsWriter
from ..models import model_args
from .sources import open_source

NEURON_CHUNK = 1024  # neurons packed per write: bounds the staging buffer


def _progress(total, enabled, desc):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, leave=False)


def _stale_temp_dirs(out):
    """Temp folders of earlier conversions to `out` whose process is gone."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            yield p
        except PermissionError:
            pass


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def convert(source, out, dtype="float16", align=512, force=False, progress=True, revision=None,
            dip=False):
    """Convert `source` (Hub repo id, HF/mlx-lm folder, or .gguf) into the flash layout at `out`.

    Returns the output folder. If `out` already holds a complete conversion of
    the same source at the same dtype, it is kept (idempotent) unless `force`.
    dip: also write the input orientation Dynamic Input Pruning reads (gate/up
    columns per input dimension, down rows alone): 5/3 of the FFN bytes more.
    """
    if dtype not in DTYPES:
        raise FlashError(f"unsupported dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    out = Path(out).expanduser().resolve()
    if hasattr(source, "read"):  # a source object (the paper benchmark's random checkpoints)
        source_name = source.name
    else:
        local = Path(str(source)).expanduser()
        source_name = str(local.resolve()) if local.exists() else str(source)
    if out.exists():
        if is_flash_folder(out) and not force:
            m = json.loads((out / MANIFEST).read_text())
            if m.get("source") == source_name and m.get("dtype") == dtype and (bool(m.get("dip")) or not dip):
                return out
            raise FlashError(
                f"{out} already holds a converted model (from {m.get('source')}, {m.get('dtype')}); "
                "use --force to replace it"
            )
        if not is_flash_folder(out) and any(out.iterdir()) and not force:
            raise FlashError(f"{out} exists and is not an mlx_flash model; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale_temp_dirs(out):
        shutil.rmtree(stale, ignore_errors=True)

    src = source if hasattr(source, "read") else open_source(source, revision=revision)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        _write_folder(src, tmp, source_name, dtype, align, progress, dip)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        src.close()
    return out


def _write_bundles(path, layout, rows, bar):
    """Pack {kind: [n, row]} into `path` in chunks; returns the manifest entry's sha256."""
    h = hashlib.sha256()
    n = next(iter(rows.values())).shape[0]
    with open(path, "wb") as f:
        for start in range(0, n, NEURON_CHUNK):
            chunk = {k: v[start : start + NEURON_CHUNK] for k, v in rows.items()}
            data = memoryview(layout.pack(chunk)).cast("B")
            f.write(data)
            h.update(data)
            bar.update(len(data))
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def _write_folder(src, tmp, source_name, dtype, align, progress, dip=False):
    family, args = model_args(src.config)
    kinds = family.ffn_kinds(args)
    n_layers = args.num_hidden_layers
    ffn_names = {}
    for layer in range(n_layers):
        for kind, (name, transposed) in family.ffn_tensors(args, layer).items():
            ffn_names[name] = (layer, kind, transposed)
    # Families may accept several namings of one tensor (OPT: decoder.* and
    # model.decoder.*); the rest of the converter sees the canonical names.
    canonical = getattr(family, "canonical_name", lambda name: name)
    original = {canonical(n): n for n in src.names()}
    missing = [n for n in ffn_names if n not in original]
    if missing:
        raise FlashError(f"source has no tensor {missing[0]} (is config.json right for these weights?)")

    d_model = args.hidden_size
    first = src.shape(original[family.ffn_tensors(args, 0)[kinds[0]][0]])
    n_neurons = first[0]
    layout = BundleLayout(tuple(kinds), d_model, n_neurons, dtype, align)

    resident = []
    for name, orig in original.items():
        if name in ffn_names:
            continue
        new = family.resident_name(args, name)
        if new is not None:
            resident.append((orig, new, src.shape(orig)))
    in_kinds = tuple(k for k in kinds if k != "down")
    in_layout = BundleLayout(in_kinds, n_neurons, d_model, dtype, align)
    down_layout = BundleLayout(("down",), d_model, n_neurons, dtype, align)
    dip_files = {"in": [], "down": []}
    total = sum(int(np.prod(s)) * DTYPES[dtype] for _, _, s in resident) + layout.file_size * n_layers
    if dip:
        total += (in_layout.file_size + down_layout.file_size) * n_layers
        (tmp / "dip").mkdir()
    bar = _progress(total, progress, "convert")

    writer = SafetensorsWriter(
        tmp / RESIDENT, [(new, shape, dtype) for _, new, shape in resident], {"format": "mlx"}
    )
    for name, new, shape in resident:
        writer.write(new, src.read(name))
        bar.update(int(np.prod(shape)) * DTYPES[dtype])
    writer.close()

    (tmp / "ffn").mkdir()
    ffn_files = []
    for layer in range(n_layers):
        rows = {}
        for kind, (name, transposed) in family.ffn_tensors(args, layer).items():
            w = src.read(original[name])
            w = w.T if transposed else w
            if w.shape != (n_neurons, d_model):
                raise FlashError(f"tensor {name} has shape {tuple(w.shape)}, expected neurons x {d_model}")
            rows[kind] = w
        rel = f"ffn/layer_{layer:03d}.bin"
        digest = _write_bundles(tmp / rel, layout, rows, bar)
        ffn_files.append({"file": rel, "size": layout.file_size, "sha256": digest})
        if dip:
            for name, lay, part in (
                ("in", in_layout, {k: np.ascontiguousarray(rows[k].T) for k in in_layout.kinds}),
                ("down", down_layout, {"down": rows["down"]}),
            ):
                rel = f"dip/{name}_{layer:03d}.bin"
                digest = _write_bundles(tmp / rel, lay, part, bar)
                dip_files[name].append({"file": rel, "size": lay.file_size, "sha256": digest})
        del rows

    from ..layout.format import sha256_file

    resident_entry = {
        "file": RESIDENT,
        "size": os.path.getsize(tmp / RESIDENT),
        "sha256": sha256_file(tmp / RESIDENT),
    }
    src.write_tokenizer(tmp)
    (tmp / "config.json").write_text(json.dumps(src.config, indent=2))
    manifest = Manifest(
        model_type=args.model_type,
        dtype=dtype,
        layout=layout,
        ffn_files=ffn_files,
        resident=resident_entry,
        source=source_name,
        dip={"input": {"layout": in_layout, "files": dip_files["in"]},
             "down": {"layout": down_layout, "files": dip_files["down"]}} if dip else {},
    )
    manifest_path = tmp / MANIFEST
    with open(manifest_path, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    bar.close()

"""Convert a model into the flash layout, streaming: one tensor or one layer's FFN in memory at a time.

The output is written under a hidden name next to the target (`.NAME.partial`)
and renamed into place only when every file and the manifest are on disk, so a
killed or failed conversion never leaves a half-written model folder. A
conversion that was killed or interrupted resumes: a journal in the partial
folder records each file once it is written and fsynced (its size and sha256),
and the next run of the same conversion (same source, dtype, alignment, --dip)
keeps those files and writes the rest. Another source or dtype starts afresh;
a live process writing the same target is refused.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..layout.format import (DTYPES, FORMAT_NAME, MANIFEST, BundleLayout, Manifest, checksum_name, sha256_file,
                             write_manifest)
from ..layout.safetensors_io import SafetensorsWriter
from ..models import model_args
from .family_view import FamilyView
from .quantize import QuantOptions, column_parts, ffn_spec, read_weight, report, row_parts, target
from .writer import (_nbytes, _progress, _resident_specs, _write_config, _write_resident, bundle_entry,
                     write_packed)
from .sources import open_source

NEURON_CHUNK = 1024  # neurons packed per write: bounds the staging buffer



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


JOURNAL = "journal.json"
OWNER = "owner.pid"


class Journal:
    """The files of a partial conversion already on disk: {relative path: (size, sha256)}."""

    def __init__(self, folder, key):
        self.folder, self.key, self.done = folder, key, {}

    @classmethod
    def claim(cls, folder, key, out):
        """Resume `folder` if it holds the same conversion, else start it afresh; refuse
        while another live process owns it."""
        j = cls(folder, key)
        if folder.exists():
            try:
                pid = int((folder / OWNER).read_text())
                if pid != os.getpid():
                    os.kill(pid, 0)
                    raise FlashError(f"another conversion (pid {pid}) is writing {out}; wait for it, "
                                     f"or remove {folder} if it is gone")
            except (OSError, ValueError):
                pass  # no owner, or a dead one: ours now
            try:
                saved = json.loads((folder / JOURNAL).read_text())
            except (OSError, ValueError):
                saved = {}
            if saved.get("key") == key:
                j.done = {k: tuple(v) for k, v in saved.get("done", {}).items()}
            else:
                shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / OWNER).write_text(str(os.getpid()))
        return j

    def has(self, rel):
        """Written by an earlier run, and still whole."""
        entry = self.done.get(rel)
        return entry is not None and (self.folder / rel).is_file() and \
            os.path.getsize(self.folder / rel) == entry[0]

    def record(self, rel, sha256):
        self.done[rel] = (os.path.getsize(self.folder / rel), sha256)
        tmp = self.folder / (JOURNAL + ".new")
        with open(tmp, "w") as f:
            json.dump({"key": self.key, "done": self.done}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.folder / JOURNAL)

    def finish(self):
        for name in (JOURNAL, OWNER):
            (self.folder / name).unlink(missing_ok=True)


def _flash_manifest(folder):
    """The parsed manifest.json of `folder` where it is an mlx_flash manifest (whole or not), else None."""
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT_NAME else None


def _unfinished_conversion(folder):
    """`folder` holds a conversion's journal (what an interrupted conversion leaves to resume)."""
    try:
        saved = json.loads((folder / JOURNAL).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "key" in saved and "done" in saved


def _replaceable(out, force):
    """Whether `out` exists; a FlashError, before anything is written, where a conversion may not
    write there: a file, or a folder with something in it that is not an mlx_flash model (its
    manifest.json) or an unfinished conversion (its journal). --force replaces only those."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise FlashError(f"--out {out} is a file, not a folder; choose a folder for the converted model")
    if _flash_manifest(out) is not None or not any(out.iterdir()):
        return True
    if _unfinished_conversion(out):
        if force:
            return True
        raise FlashError(f"{out} holds an unfinished conversion ({JOURNAL}); use --force to replace it")
    why = "its manifest.json is not an mlx_flash manifest" if (out / MANIFEST).exists() else \
        f"it has no {MANIFEST}"
    raise FlashError(f"{out} exists and is not an mlx_flash model folder ({why}); "
                     + ("--force replaces only a converted model's folder, and " if force else "")
                     + "nothing in it was changed: choose another --out, or empty the folder first")


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
            dip=False, quant=None):
    """Convert `source` (Hub repo id, HF/mlx-lm folder, or .gguf) into the flash layout at `out`.

    Returns the output folder. If `out` already holds a complete conversion of
    the same source at the same dtype and precision options, it is kept
    (idempotent) unless `force`. `force` replaces only a converted model (a folder
    with an mlx_flash manifest) or an unfinished conversion (its journal); any
    other folder, and a file, is refused before anything is written.
    dip: also write the input orientation Dynamic Input Pruning reads (gate/up
    columns per input dimension, down rows alone): 5/3 of the FFN bytes more.
    quant: QuantOptions (convert/quantize.py): quantized sources keep their bits by
    default; --quantize, --q-bits, --q-group-size, --q-keep, --dequantize.
    """
    quant = quant or QuantOptions()
    if dtype not in DTYPES:
        raise FlashError(f"unsupported dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    out = Path(out).expanduser().resolve()
    if hasattr(source, "read"):  # a source object (the paper benchmark's random checkpoints)
        source_name = source.name
    else:
        local = Path(str(source)).expanduser()
        source_name = str(local.resolve()) if local.exists() else str(source)
    if _replaceable(out, force):
        m = _flash_manifest(out)
        if m is not None and not force:
            options = m.get("options") if isinstance(m.get("options"), dict) else {}
            if (m.get("source") == source_name and m.get("dtype") == dtype and (bool(m.get("dip")) or not dip)
                    and options.get("quant") == quant.key()):
                return out
            raise FlashError(
                f"{out} already holds a converted model (from {m.get('source')}, {m.get('dtype')}); "
                "use --force to replace it"
            )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlashError(f"--out {out}: cannot make its folder {out.parent} ({e.strerror})")
    for stale in _stale_temp_dirs(out):
        shutil.rmtree(stale, ignore_errors=True)

    src = source if hasattr(source, "read") else open_source(source, revision=revision)
    tmp = out.parent / f".{out.name}.partial"
    journal = None
    try:
        journal = Journal.claim(tmp, {"source": source_name, "dtype": dtype, "align": align,
                                      "dip": bool(dip), "quant": quant.key()}, out)
        _write_folder(src, tmp, source_name, dtype, align, progress, dip, journal, quant)
        journal.finish()
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        _fsync_dir(out.parent)
    except FlashError:
        # the source itself is wrong: nothing to resume (unless the folder is another's)
        if journal is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        # interrupted, killed, out of disk space: the partial folder stays, and the next
        # run of this conversion resumes from its journal
        if journal is not None and tmp.exists():
            (tmp / OWNER).unlink(missing_ok=True)
        raise
    finally:
        src.close()
    return out


def _write_bundles(tmp, rel, layout, rows, bar, journal):
    """Pack {kind: [n, row]} into tmp/rel in chunks, and the CRC32C of every bundle part
    into its checksum file; both recorded in the journal -> the manifest entry."""
    n = next(iter(rows.values())).shape[0]
    chunks = (layout.pack({k: v[start : start + NEURON_CHUNK] for k, v in rows.items()})
              for start in range(0, n, NEURON_CHUNK))
    return write_packed(tmp, rel, chunks, layout.parts(), bar, journal)




_STORAGE_NAME = {"<f2": "float16", "<f4": "float32", "<u2": "bfloat16"}


def _write_tables(path, tables):
    """{name: (scales, biases)} in their storage form -> a safetensors file; -> its sha256."""
    specs, arrays = [], []
    for name, (scales, biases) in tables.items():
        for part, a in (("scales", scales), ("biases", biases)):
            specs.append((f"{name}.{part}", a.shape, _STORAGE_NAME[a.dtype.str]))
            arrays.append(a)
    writer = SafetensorsWriter(path, specs, {"format": "mlx_flash scales"})
    for (name, _, _), a in zip(specs, arrays):
        writer.write(name, a, raw=True)
    writer.close()
    return sha256_file(path)



def _ffn_tensor_names(src, family, args, n_layers):
    """-> ({FFN tensor's name: (layer, kind, transposed)}, {every tensor's canonical name: the
    source's}); FlashError for an FFN tensor the source lacks."""
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
    return ffn_names, original


def _precisions(src, original, ffn_names, options, dtype, source_name):
    """Every tensor's precision (quantize.target) -> ({name: decision}, the FFN's QuantSpec or
    None, the notes to report)."""
    notes = set()
    decisions = {name: target(src, original[name], src.shape(original[name]), options, dtype, notes)
                 for name in original}
    if (options.bits or options.group_size) and not options.quantize and \
            all(kind == "float" for kind, _ in decisions.values()):
        raise FlashError(f"{source_name} holds no quantized weights: --q-bits / --q-group-size need "
                         "--quantize (-q) to quantize them")
    ffn_decisions = {n: decisions[n] for n in ffn_names}
    quant = ffn_spec(ffn_decisions, source_name, notes, bits=options.ffn_bits)
    decisions.update(ffn_decisions)
    return decisions, quant, notes


def _ffn_layouts(src, family, args, original, kinds, quant, dtype, align, source_name):
    """-> the bundle layouts of the FFN files, DIP's input files and DIP's down files."""
    d_model = args.hidden_size
    first = src.shape(original[family.ffn_tensors(args, 0)[kinds[0]][0]])
    n_neurons = first[0]
    if quant is not None and (d_model % quant.group_size or n_neurons % quant.group_size):
        raise FlashError(f"{source_name}: hidden size {d_model} and FFN size {n_neurons} must be multiples "
                         f"of the quantization group size {quant.group_size}")
    transposed = tuple(k for k, (_, t) in family.ffn_tensors(args, 0).items() if t)
    cols = transposed if quant is not None else ()
    layout = BundleLayout(tuple(kinds), d_model, n_neurons, dtype, align, quant, cols, "ffn" if cols else "")
    in_kinds = tuple(k for k in kinds if k != "down")
    in_cols = in_kinds if quant is not None else ()
    in_layout = BundleLayout(in_kinds, n_neurons, d_model, dtype, align, quant, in_cols, "dip" if in_cols else "")
    down_layout = BundleLayout(("down",), d_model, n_neurons, dtype, align, quant, cols, layout.tables)
    return layout, in_layout, down_layout


def _resident_tensors(src, family, args, original, ffn_names, decisions):
    """(source name, resident name, shape, decision) of every tensor held resident."""
    resident = []
    for name, orig in original.items():
        if name in ffn_names:
            continue
        new = family.resident_name(args, name)
        if new is not None:
            resident.append((orig, new, src.shape(orig), decisions[name]))
    return resident


def _read_layer(src, family, args, layer, original, decisions, layout, in_layout, dip):
    """A layer's FFN weights, read and checked -> (rows {kind: [neurons, row]}, their scale tables,
    DIP's input-orientation columns and their tables: quantized only)."""
    d_model, n_neurons, quant = layout.d_model, layout.n_neurons, layout.quant
    rows, tables, dip_in, dip_tables = {}, {}, {}, {}
    for kind, (name, tr) in family.ffn_tensors(args, layer).items():
        w = read_weight(src, original[name], decisions[name])
        shape = w.shape
        if shape != ((d_model, n_neurons) if tr else (n_neurons, d_model)):
            raise FlashError(f"tensor {name} has shape {tuple(shape)}, expected "
                             f"{'d_model x neurons' if tr else 'neurons x d_model'} ({d_model}, {n_neurons})")
        if quant is None:
            rows[kind] = w.T if tr else w
        elif tr:  # a column per neuron, its scales in the layer's table
            rows[kind], tables[layout.table_name(kind)] = column_parts(w)
        else:
            rows[kind] = row_parts(w)
            if dip:  # the input orientation: a column per input dimension
                dip_in[kind], dip_tables[in_layout.table_name(kind)] = column_parts(w)
    return rows, tables, dip_in, dip_tables


def _write_layer(src, tmp, family, args, layer, original, decisions, layouts, dip, bar, journal):
    """A layer's FFN file, its scales file (quantized) and its two DIP files (dip), or those an
    earlier run wrote -> (the FFN file's manifest entry, the scales file's entries, {"in" / "down":
    its DIP file's entry})."""
    layout, in_layout, down_layout = layouts
    quant = layout.quant
    rel = f"ffn/layer_{layer:03d}.bin"
    scales_rel = [f"ffn/scales_{layer:03d}.safetensors"] if quant is not None else []
    dip_rels = [f"dip/{name}_{layer:03d}.bin" for name in ("in", "down")] if dip else []
    if all(journal.has(r) and journal.has(checksum_name(r)) for r in [rel] + dip_rels) and \
            all(journal.has(r) for r in scales_rel):  # written by an earlier run
        kept = (bundle_entry(tmp, rel, journal), [_entry(tmp, r, journal.done[r][1]) for r in scales_rel],
                {name: bundle_entry(tmp, r, journal) for name, r in zip(("in", "down"), dip_rels)})
        bar.update(sum(journal.done[r][0] for r in [rel] + dip_rels))
        return kept
    rows, tables, dip_in, dip_tables = _read_layer(src, family, args, layer, original, decisions, layout,
                                                   in_layout, dip)
    entry = _write_bundles(tmp, rel, layout, rows, bar, journal)
    scale_files, dip_files = [], {}
    if quant is not None:
        digest = _write_tables(tmp / scales_rel[0], tables | dip_tables)
        scale_files.append(_entry(tmp, scales_rel[0], digest))
        journal.record(scales_rel[0], digest)
    if dip:
        if quant is None:
            dip_in = {k: np.ascontiguousarray(rows[k].T) for k in in_layout.kinds}
        for name, lay, part in (("in", in_layout, dip_in), ("down", down_layout, {"down": rows["down"]})):
            dip_files[name] = _write_bundles(tmp, f"dip/{name}_{layer:03d}.bin", lay, part, bar, journal)
    return entry, scale_files, dip_files


def _write_folder(src, tmp, source_name, dtype, align, progress, dip=False, journal=None, options=None):
    options = options or QuantOptions()
    family, args = model_args(src.config)
    # the source as the family holds it (Phi-3, Persimmon, Falcon: q/k/v stacked in one tensor,
    # split here; Falcon's and Gemma 3 multimodal's names; the latter's text model's config)
    fused = family.fused_tensors(args) if hasattr(family, "fused_tensors") else {}
    rename = (lambda name: family.source_name(args, name)) if hasattr(family, "source_name") else None
    config = family.source_config(src.config) if hasattr(family, "source_config") else None
    if fused or rename or config is not None:
        src = FamilyView(src, fused, rename, config)
    if hasattr(family, "expert_tensors"):  # a mixture of experts: expert bundles (convert/experts.py)
        from .experts import write_moe_folder

        return write_moe_folder(src, tmp, source_name, dtype, align, progress, dip, journal, options, family, args)
    kinds = family.ffn_kinds(args)
    n_layers = args.num_hidden_layers
    options.check_layers(n_layers)
    ffn_names, original = _ffn_tensor_names(src, family, args, n_layers)
    decisions, quant, notes = _precisions(src, original, ffn_names, options, dtype, source_name)
    layout, in_layout, down_layout = _ffn_layouts(src, family, args, original, kinds, quant, dtype, align,
                                                  source_name)

    resident = _resident_tensors(src, family, args, original, ffn_names, decisions)
    resident_specs = [e for _, new, shape, dec in resident for e in _resident_specs(new, shape, dtype, dec)]
    dip_files = {"in": [], "down": []}
    total = sum(_nbytes(shape, dt) for _, shape, dt in resident_specs) + layout.file_size * n_layers
    if dip:
        total += (in_layout.file_size + down_layout.file_size) * n_layers
        (tmp / "dip").mkdir(exist_ok=True)
    journal = journal or Journal(tmp, None)
    if journal.done:
        print(f"[mlx_flash] resuming the conversion in {tmp}: {len(journal.done)} files already written",
              file=sys.stderr)
    report(notes)
    bar = _progress(total, progress, "convert")

    quantized_modules = _write_resident(src, tmp, resident, resident_specs, dtype, bar, journal)

    (tmp / "ffn").mkdir(exist_ok=True)
    ffn_files, scale_files = [], []
    for layer in range(n_layers):
        entry, scales, dips = _write_layer(src, tmp, family, args, layer, original, decisions,
                                           (layout, in_layout, down_layout), dip, bar, journal)
        ffn_files.append(entry)
        scale_files += scales
        for name, e in dips.items():
            dip_files[name].append(e)

    resident_entry = _write_config(src, tmp, journal, quantized_modules)
    manifest = Manifest(
        model_type=args.model_type,
        dtype=dtype,
        layout=layout,
        ffn_files=ffn_files,
        resident=resident_entry,
        source=source_name,
        dip={"input": {"layout": in_layout, "files": dip_files["in"]},
             "down": {"layout": down_layout, "files": dip_files["down"]}} if dip else {},
        scales=scale_files,
        options={"quant": options.key()},
    )
    write_manifest(tmp, manifest)
    bar.close()





def _entry(folder, rel, digest):
    return {"file": rel, "size": os.path.getsize(folder / rel), "sha256": digest}

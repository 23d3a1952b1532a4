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

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..layout.format import (DTYPES, MANIFEST, RESIDENT, BundleLayout, Manifest, is_flash_folder, sha256_file,
                             write_manifest)
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
    tmp = out.parent / f".{out.name}.partial"
    journal = None
    try:
        journal = Journal.claim(tmp, {"source": source_name, "dtype": dtype, "align": align,
                                      "dip": bool(dip)}, out)
        _write_folder(src, tmp, source_name, dtype, align, progress, dip, journal)
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


def _write_folder(src, tmp, source_name, dtype, align, progress, dip=False, journal=None):
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
        (tmp / "dip").mkdir(exist_ok=True)
    journal = journal or Journal(tmp, None)
    if journal.done:
        print(f"[mlx_flash] resuming the conversion in {tmp}: {len(journal.done)} files already written",
              file=sys.stderr)
    bar = _progress(total, progress, "convert")

    if journal.has(RESIDENT):
        bar.update(os.path.getsize(tmp / RESIDENT))
    else:
        writer = SafetensorsWriter(
            tmp / RESIDENT, [(new, shape, dtype) for _, new, shape in resident], {"format": "mlx"}
        )
        for name, new, shape in resident:
            writer.write(new, src.read(name))
            bar.update(int(np.prod(shape)) * DTYPES[dtype])
        writer.close()
        journal.record(RESIDENT, sha256_file(tmp / RESIDENT))

    (tmp / "ffn").mkdir(exist_ok=True)
    ffn_files = []
    for layer in range(n_layers):
        rel = f"ffn/layer_{layer:03d}.bin"
        dip_rels = [f"dip/{name}_{layer:03d}.bin" for name in ("in", "down")] if dip else []
        if all(journal.has(r) for r in [rel] + dip_rels):  # written by an earlier run
            ffn_files.append({"file": rel, "size": layout.file_size, "sha256": journal.done[rel][1]})
            for name, r, lay in zip(("in", "down"), dip_rels, (in_layout, down_layout)):
                dip_files[name].append({"file": r, "size": lay.file_size, "sha256": journal.done[r][1]})
            bar.update(sum(journal.done[r][0] for r in [rel] + dip_rels))
            continue
        rows = {}
        for kind, (name, transposed) in family.ffn_tensors(args, layer).items():
            w = src.read(original[name])
            w = w.T if transposed else w
            if w.shape != (n_neurons, d_model):
                raise FlashError(f"tensor {name} has shape {tuple(w.shape)}, expected neurons x {d_model}")
            rows[kind] = w
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
                journal.record(rel, digest)
        journal.record(f"ffn/layer_{layer:03d}.bin", ffn_files[-1]["sha256"])  # the layer last
        del rows

    resident_entry = {
        "file": RESIDENT,
        "size": os.path.getsize(tmp / RESIDENT),
        "sha256": journal.done.get(RESIDENT, (0, None))[1] or sha256_file(tmp / RESIDENT),
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
    write_manifest(tmp, manifest)
    bar.close()

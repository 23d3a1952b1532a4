"""Check a whole converted folder: the manifest against the model config.json describes (every
layer, every weight kind, the experts), every file's size, the sha256 of the small ones, and
the CRC32C of every bundle part of every file of bundles (mlx_flash.verify)."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..io.checksum import parts_crc
from .format import MANIFEST, check_file, read_checksums, read_manifest
from .schema import missing_parts

CHUNK = 16 << 20  # bytes of bundles checked at a time


@dataclass
class Damage:
    file: str
    what: str

    def __str__(self):
        return f"{self.file}: {self.what}"


def bundle_files(manifest):
    """[(manifest entry, its BundleLayout)] of every file of bundles."""
    out = [(e, manifest.layout) for e in manifest.ffn_files]
    for part in manifest.dip.values():
        out += [(e, part["layout"]) for e in part["files"]]
    if manifest.experts:
        from .experts import all_groups

        out += [(g.entry, g.layout) for g in all_groups(manifest.experts)]
    return out


def verify_folder(folder, progress=False):
    """-> [Damage] (empty: the folder is whole). Version 1 folders have no bundle
    checksums: their bundle files are checked against the manifest's sha256."""
    from tqdm import tqdm

    folder = Path(folder)
    manifest = read_manifest(folder)
    damage = incomplete(folder, manifest)
    predictors = manifest.calibration.get("predictors")
    small = [manifest.resident] + list(manifest.scales) + ([predictors] if predictors else [])
    files = bundle_files(manifest)
    total = sum(e["size"] for e in small) + sum(e["size"] for e, _ in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress, leave=False)
    for entry in small:
        try:
            check_file(folder, entry)
        except FlashError as e:
            damage.append(Damage(entry["file"], str(e).split(": ", 1)[-1]))
        bar.update(entry["size"])
    for entry, layout in files:
        try:
            try:
                crcs = read_checksums(folder, entry, layout)
            except FlashError as e:  # the checksum file itself: report it, check the bundles whole
                damage.append(Damage(entry["crc32c"]["file"], str(e).split(": ", 1)[-1]))
                crcs = None
            if crcs is None:
                check_file(folder, entry)
            else:
                check_file(folder, entry, checksum=False)
                damage += _check_bundles(folder / entry["file"], layout, crcs, bar)
                continue
        except FlashError as e:
            damage.append(Damage(entry["file"], str(e).split(": ", 1)[-1]))
        bar.update(entry["size"])
    bar.close()
    return damage


def incomplete(folder, manifest):
    """[Damage] of what config.json describes that the manifest does not list (or of config.json
    itself, unreadable)."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return [Damage("config.json", "missing (the model folder is incomplete; convert again)")]
    except (OSError, ValueError) as e:
        return [Damage("config.json", f"unreadable ({e}); convert again")]
    if not isinstance(config, dict):
        return [Damage("config.json", "not a JSON object; convert again")]
    try:
        missing = missing_parts(manifest, config)
    except FlashError as e:
        return [Damage("config.json", str(e))]
    return [Damage(MANIFEST, f"{m} (the folder is incomplete; convert the model again)") for m in missing]


def _check_bundles(path, layout, crcs, bar):
    try:
        with open(path, "rb", buffering=0) as f:
            return _check_open_bundles(f, path, layout, crcs, bar)
    except OSError as e:
        return [Damage(str(path), f"cannot be read ({e.strerror})")]


def _check_open_bundles(f, path, layout, crcs, bar):
    damage = []
    per = max(1, CHUNK // layout.stride)
    parts = layout.parts()
    for first in range(0, layout.n_neurons, per):
        n = min(per, layout.n_neurons - first)
        buf = bytearray(n * layout.stride)
        got = f.readinto(memoryview(buf))
        if got != len(buf):
            damage.append(Damage(str(path), f"short read at offset {first * layout.stride}"))
            return damage
        rows = np.frombuffer(buf, dtype=np.uint8).reshape(n, layout.stride)
        bad = np.argwhere(parts_crc(rows, parts) != crcs[first : first + n])
        for i, j in bad:
            b = first + int(i)
            damage.append(Damage(str(path), f"bundle {b} ({layout.kinds[j]}, bytes at offset "
                                 f"{b * layout.stride + parts[j][0]}) does not match its checksum"))
        bar.update(len(buf))
    return damage

"""Check a whole converted folder: every file's size, the sha256 of the small ones, and
the CRC32C of every bundle part of every file of bundles (mlx_flash.verify)."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..io.checksum import parts_crc
from .format import check_file, read_checksums, read_manifest

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
    damage = []
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


def _check_bundles(path, layout, crcs, bar):
    damage = []
    per = max(1, CHUNK // layout.stride)
    parts = layout.parts()
    with open(path, "rb", buffering=0) as f:
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

"""What every conversion writes the same way: files of bundles with their checksum files
(recorded in the journal), the resident safetensors file, config.json and the tokenizer."""

import hashlib
import json
import os
from collections import Counter

import numpy as np

from ..io.checksum import parts_crc
from ..layout.format import DTYPES, RESIDENT, checksum_name, sha256_file
from ..layout.safetensors_io import SafetensorsWriter
from .quantize import read_weight

def _progress(total, enabled, desc):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, leave=False)



def write_packed(tmp, rel, chunks, parts, bar, journal):
    """Bundles (uint8 [n, stride] chunks, in file order) into tmp/rel, and the CRC32C of each
    bundle's `parts` into its checksum file; both recorded in the journal -> the manifest entry."""
    h = hashlib.sha256()
    crcs = []
    with open(tmp / rel, "wb") as f:
        for packed in chunks:
            crcs.append(parts_crc(packed, parts))
            data = memoryview(packed).cast("B")
            f.write(data)
            h.update(data)
            bar.update(len(data))
        f.flush()
        os.fsync(f.fileno())
    crc_rel = checksum_name(rel)
    with open(tmp / crc_rel, "wb") as f:
        f.write(np.concatenate(crcs).astype("<u4").tobytes())
        f.flush()
        os.fsync(f.fileno())
    journal.record(crc_rel, sha256_file(tmp / crc_rel))
    journal.record(rel, h.hexdigest())
    return bundle_entry(tmp, rel, journal)



def bundle_entry(tmp, rel, journal):
    crc_rel = checksum_name(rel)
    return {"file": rel, "size": journal.done[rel][0], "sha256": journal.done[rel][1],
            "crc32c": {"file": crc_rel, "size": journal.done[crc_rel][0], "sha256": journal.done[crc_rel][1]}}



def _resident_specs(new, shape, dtype, decision):
    """(name, shape, dtype) of the safetensors entries one resident weight becomes."""
    kind, spec = decision
    if kind == "float":
        return [(new, shape, dtype)]
    stem = new[: -len(".weight")]
    out, n_in = shape
    sd = "bfloat16" if spec.scale_dtype == "bfloat16" else spec.scale_dtype
    return [(new, (out, n_in * spec.bits // 32), "uint32"), (stem + ".scales", (out, n_in // spec.group_size), sd),
            (stem + ".biases", (out, n_in // spec.group_size), sd)]



def _write_resident(src, tmp, resident, resident_specs, dtype, bar, journal):
    """resident.safetensors (unless the journal has it) -> {module: its quantization} of the
    quantized modules (config.json's mlx-lm form)."""
    quantized_modules = {}
    for orig, new, shape, (kind, spec) in resident:
        if kind != "float":
            quantized_modules[new[: -len(".weight")]] = {"group_size": spec.group_size, "bits": spec.bits}
    if journal.has(RESIDENT):
        bar.update(os.path.getsize(tmp / RESIDENT))
        return quantized_modules
    writer = SafetensorsWriter(tmp / RESIDENT, resident_specs, {"format": "mlx"})
    for name, new, shape, decision in resident:
        w = read_weight(src, name, decision)
        if decision[0] == "float":
            writer.write(new, w)
        else:
            stem = new[: -len(".weight")]
            writer.write(new, w.packed, raw=True)
            writer.write(stem + ".scales", w.scales, raw=True)
            writer.write(stem + ".biases", w.biases, raw=True)
        bar.update(sum(_nbytes(s, dt) for _, s, dt in _resident_specs(new, shape, dtype, decision)))
    writer.close()
    journal.record(RESIDENT, sha256_file(tmp / RESIDENT))
    return quantized_modules




def _write_config(src, tmp, journal, quantized_modules):
    """The tokenizer files and config.json (mlx-lm's `quantization` naming each quantized
    module) -> the resident file's manifest entry."""
    src.write_tokenizer(tmp)
    config = dict(src.config)
    if quantized_modules:  # mlx-lm's form: a default and one entry per quantized module
        common = Counter(tuple(v.items()) for v in quantized_modules.values()).most_common(1)[0][0]
        config["quantization"] = dict(common) | quantized_modules
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return {"file": RESIDENT, "size": os.path.getsize(tmp / RESIDENT),
            "sha256": journal.done.get(RESIDENT, (0, None))[1] or sha256_file(tmp / RESIDENT)}





def _nbytes(shape, dtype):
    return int(np.prod(shape)) * (DTYPES.get(dtype) or np.dtype(dtype).itemsize)


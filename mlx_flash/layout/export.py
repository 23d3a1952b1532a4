"""Export a flash folder back to a plain Hugging Face / mlx-lm folder.

The inverse of the converter, tensor by tensor: used to run mlx_lm (or any
other tool) on exactly the weights mlx_flash runs, for parity and speed
comparisons. A quantized folder is exported dequantized (scale * q + bias in
float32, then `dtype`): the values its quantized weights stand for.
"""

import json
import shutil
from pathlib import Path

import numpy as np

from ..models import model_args
from .format import read_manifest, read_tables
from .quant import QuantSpec, QuantTensor, value_shapes
from .safetensors_io import ST_TO_NUMPY, SafetensorsFile, SafetensorsWriter


def export_hf(folder, out, dtype="float32"):
    folder, out = Path(folder), Path(out)
    manifest = read_manifest(folder)
    config = json.loads((folder / "config.json").read_text())
    family, args = model_args(config)
    lay = manifest.layout
    res = SafetensorsFile(folder / manifest.resident["file"])
    to_hf = getattr(family, "hf_name", lambda args, name: name)

    quantization = config.pop("quantization", None) or {}
    names = set(res.names())
    specs, plan = [], []
    for name, shape in value_shapes(res, quantization).items():  # quantized weights: dequantized
        specs.append((to_hf(args, name), shape, dtype))
        plan.append(("resident", name))
    for layer in range(len(manifest.ffn_files)):
        for kind, (name, transposed) in family.ffn_tensors(args, layer).items():
            shape = (lay.d_model, lay.n_neurons) if transposed else (lay.n_neurons, lay.d_model)
            specs.append((name, shape, dtype))
            plan.append(("ffn", (layer, kind, transposed)))
    out.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(out / "model.safetensors", specs, {"format": "pt"})
    cached = {}
    tables = read_tables(folder, manifest, lay)
    for (hf, _, _), (where, what) in zip(specs, plan):
        if where == "resident":
            stem = what.rsplit(".", 1)[0]
            if f"{stem}.scales" in names:
                q = quantization[stem]
                (scales, st), biases = res.read_raw(stem + ".scales"), res.read_raw(stem + ".biases")[0]
                sd = ST_TO_NUMPY[st]
                w = QuantTensor(res.read_raw(what)[0], scales, biases, QuantSpec(q["bits"], q["group_size"], sd))
                writer.write(hf, w.dequantized())
            else:
                writer.write(hf, res.read(what))
            continue
        layer, kind, transposed = what
        if layer not in cached:
            cached.clear()
            entry = manifest.ffn_files[layer]
            cached[layer] = lay.split((folder / entry["file"]).read_bytes(), tables[layer] if tables else None)
        rows = cached[layer][kind]
        writer.write(hf, np.ascontiguousarray(rows.T if transposed else rows))
    writer.close()
    for f in folder.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".model", ".txt") and f.name != "manifest.json":
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # without "quantization"
    return out

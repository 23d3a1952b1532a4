"""Export a flash folder back to a plain Hugging Face / mlx-lm folder.

The inverse of the converter, tensor by tensor: used to run mlx_lm (or any
other tool) on exactly the weights mlx_flash runs, for parity and speed
comparisons.
"""

import json
import shutil
from pathlib import Path

import numpy as np

from ..models import model_args
from .format import read_manifest
from .safetensors_io import SafetensorsFile, SafetensorsWriter


def export_hf(folder, out, dtype="float32"):
    folder, out = Path(folder), Path(out)
    manifest = read_manifest(folder)
    config = json.loads((folder / "config.json").read_text())
    family, args = model_args(config)
    lay = manifest.layout
    res = SafetensorsFile(folder / manifest.resident["file"])
    to_hf = getattr(family, "hf_name", lambda args, name: name)

    specs, plan = [], []
    for name in res.names():
        specs.append((to_hf(args, name), res.shape(name), dtype))
        plan.append(("resident", name))
    for layer in range(len(manifest.ffn_files)):
        for kind, (name, transposed) in family.ffn_tensors(args, layer).items():
            shape = (lay.d_model, lay.n_neurons) if transposed else (lay.n_neurons, lay.d_model)
            specs.append((name, shape, dtype))
            plan.append(("ffn", (layer, kind, transposed)))
    out.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(out / "model.safetensors", specs, {"format": "pt"})
    cached = {}
    for (hf, _, _), (where, what) in zip(specs, plan):
        if where == "resident":
            writer.write(hf, res.read(what))
            continue
        layer, kind, transposed = what
        if layer not in cached:
            cached.clear()
            entry = manifest.ffn_files[layer]
            cached[layer] = lay.split((folder / entry["file"]).read_bytes())
        rows = cached[layer][kind]
        writer.write(hf, np.ascontiguousarray(rows.T if transposed else rows))
    writer.close()
    for f in folder.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".model", ".txt") and f.name != "manifest.json":
            shutil.copy2(f, out / f.name)
    return out

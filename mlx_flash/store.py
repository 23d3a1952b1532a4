"""Row stores: where a FlashFFN gets its neuron rows from.

`DenseStore` reads every bundle of every layer into DRAM at load time, once,
and hands out all rows: with it the model is exact (parity with mlx_lm).
The sparse, flash-backed stores of later stages keep the same `rows()` call.
"""

import hashlib

import mlx.core as mx

from .errors import FlashError
from .layout.format import check_file
from .models.ffn import FFNRows


def read_layer_file(folder, entry, layout, verify=True):
    """One layer's FFN file -> {kind: float32 numpy [n_neurons, d_model]}."""
    check_file(folder, entry, checksum=False)
    path = folder / entry["file"]
    buf = bytearray(entry["size"])
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(memoryview(buf))
    if got != len(buf):
        raise FlashError(f"{path}: short read ({got} of {len(buf)} bytes)")
    if verify and hashlib.sha256(buf).hexdigest() != entry["sha256"]:
        raise FlashError(f"{path}: sha256 differs from the manifest (file changed since conversion)")
    return layout.split(buf)


class DenseStore:
    """Every FFN row of every layer in DRAM, as contiguous [n, d] matrices per kind."""

    def __init__(self, folder, manifest, dtype, verify=True, progress=None):
        self.layers = []
        layout = manifest.layout
        for entry in manifest.ffn_files:
            rows = read_layer_file(folder, entry, layout, verify)
            arrays = {k: mx.array(v).astype(dtype) for k, v in rows.items()}
            mx.eval(list(arrays.values()))
            self.layers.append(FFNRows(**arrays))
            if progress is not None:
                progress.update(1)
        self.weights_bytes = sum(
            a.nbytes for r in self.layers for a in (r.up, r.down, r.gate) if a is not None
        )

    def rows(self, layer, x):
        return self.layers[layer]

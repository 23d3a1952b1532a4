"""Row stores: where a FlashFFN gets its neuron rows from.

`DenseStore` reads every bundle of every layer into DRAM at load time, once,
and hands out all rows: with it the model is exact (parity with mlx_lm).
The sparse, flash-backed stores of later stages keep the same `rows()` call.
"""

import hashlib

import numpy as np

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
    """Every FFN row of every layer in DRAM, as contiguous [n, d] matrices per kind.

    held=True: every row at float16 (as on flash), one layer at a time converted to float32
    through an arena just before use (models/half.py): exact, half the DRAM."""

    def __init__(self, folder, manifest, dtype, verify=True, progress=None, held=False):
        self.layers = []
        self.arena = None
        layout = manifest.layout
        if held:
            from .models.half import Arena

            self.arena = Arena(layout.n_neurons * layout.d_model * len(layout.kinds))
        for entry in manifest.ffn_files:
            rows = read_layer_file(folder, entry, layout, verify)
            if held:  # numpy float16 rows: what the arena converts from
                self.layers.append({k: v.astype(np.float16) for k, v in rows.items()})
            else:
                arrays = {k: mx.array(v).astype(dtype) for k, v in rows.items()}
                mx.eval(list(arrays.values()))
                self.layers.append(FFNRows(**arrays))
            if progress is not None:
                progress.update(1)
        self.weights_bytes = (sum(a.nbytes for r in self.layers for a in r.values()) + self.arena.nbytes
                              if held else sum(a.nbytes for r in self.layers
                                               for a in (r.up, r.down, r.gate) if a is not None))

    def rows(self, layer, x):
        if self.arena is None:
            return self.layers[layer]
        mx.eval(x)  # every earlier reader of the arena is an ancestor of x
        return FFNRows(**self.arena.fill_rows(self.layers[layer]))

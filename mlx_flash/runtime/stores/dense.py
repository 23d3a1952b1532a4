"""dense: every FFN row of every layer in DRAM, read once at load; with it the model is
exact (parity with mlx_lm)."""

import numpy as np

import mlx.core as mx

from ...models.ffn import FFNRows
from .base import Store, read_layer_file


class DenseStore(Store):
    """Every FFN row of every layer in DRAM, as contiguous [n, d] matrices per kind.

    held=True: every row at float16 (as on flash), one layer at a time converted to float32
    through an arena just before use (models/half.py): exact, half the DRAM."""

    def __init__(self, folder, manifest, dtype, verify=True, progress=None, held=False, tables=None):
        self.layers = []
        self.arena = None
        layout = manifest.layout
        if held:
            from ...models.half import Arena

            self.arena = Arena(layout.n_neurons * layout.d_model * len(layout.kinds))
        for layer, entry in enumerate(manifest.ffn_files):
            rows = read_layer_file(folder, entry, layout, verify, tables[layer] if tables else None)
            if held:  # numpy float16 rows: what the arena converts from
                self.layers.append({k: v.astype(np.float16) for k, v in rows.items()})
            else:
                arrays = {k: mx.array(v).astype(dtype) for k, v in rows.items()}
                mx.eval(list(arrays.values()))
                self.layers.append(FFNRows(**arrays))
            if progress is not None:
                progress.update(1)
        self._bytes = (sum(a.nbytes for r in self.layers for a in r.values()) + self.arena.nbytes
                       if held else sum(a.nbytes for r in self.layers
                                        for a in (r.up, r.down, r.gate) if a is not None))

    @property
    def weights_bytes(self):
        return self._bytes

    def rows(self, layer, x):
        if self.arena is None:
            return self.layers[layer]
        mx.eval(x)  # every earlier reader of the arena is an ancestor of x
        return FFNRows(**self.arena.fill_rows(self.layers[layer]))

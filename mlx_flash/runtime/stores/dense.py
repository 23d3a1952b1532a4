"""dense: every FFN row of every layer in DRAM, read once at load; with it the model is
exact (parity with mlx_lm)."""

import numpy as np

import mlx.core as mx

from ...errors import FlashError
from ...kernels import SMALL_PASS, pass_kernels
from ...models.ffn import FFNRows, PackedRows
from ..memory import trim_heap
from .base import Store, cpu_kernels, read_layer_bytes


class DenseStore(Store):
    """Every FFN row of every layer in DRAM, as contiguous [n, d] matrices per kind.

    held=True: every row at float16 (as on flash), half the DRAM, exact: a decode step on the
    CPU multiplies the float16 rows in place (the native kernels' gather_mv / gather_axpy,
    converting each value as it is read; a batch's step their tiles, gather_mm /
    gather_mm_cols); a prompt converts one layer at a time into a float32 arena for BLAS
    (models/half.py).
    packed=True: a quantized layout's rows at their bits, as on flash (packed values, inline
    scales; the down columns' scales in `tables`), computed on in place by the native CPU
    kernels (models/ffn.py FlashFFN._packed): a 4-bit model's FFN takes ~1/7 of its float32
    DRAM."""

    def __init__(self, folder, manifest, dtype, verify=True, progress=None, held=False, tables=None,
                 packed=False):
        self.layers = []
        self.arena = None
        self.layout = layout = manifest.layout
        self.tables = tables
        self.kernels = cpu_kernels() if packed or (held and dtype == mx.float32) else None
        self.packed = {k: layout.kind_bytes(k) for k in layout.kinds} if packed else None
        if packed and (layout.quant is None or "down" not in layout.columns or self.kernels is None or held):
            raise FlashError("packed FFN rows need a quantized layout (down stored as columns), float32 "
                             "compute and the native kernels on the CPU")
        if held:
            from ...models.half import Arena

            self.arena = Arena(layout.n_neurons * layout.d_model * len(layout.kinds))
        for layer, entry in enumerate(manifest.ffn_files):
            raw = read_layer_bytes(folder, entry, verify)
            if packed:  # each kind's bundle part as it is: [n, kind_bytes / 4] float32 containers
                self.layers.append(layout.raw_parts(raw))
            elif held and layout.quant is None and layout.dtype == "float16":  # as stored: what the arena
                self.layers.append(layout.stored(raw))  # converts from (no float32 copy on the way)
            else:
                rows = layout.split(raw, tables[layer] if tables else None)
                if held:  # numpy float16 rows
                    self.layers.append({k: v.astype(np.float16) for k, v in rows.items()})
                else:
                    arrays = {k: mx.array(v).astype(dtype) for k, v in rows.items()}
                    mx.eval(list(arrays.values()))
                    self.layers.append(FFNRows(**arrays))
            del raw
            rows = None
            trim_heap()  # (a layer's bytes and their float32 split, freed: else the C heap keeps them, 52 MB
            # of float16 SmolLM2's 30 layers at the load's peak)
            if progress is not None:
                progress.update(1)
        if packed or held:
            self._bytes = sum(a.nbytes for r in self.layers for a in r.values())
            self._bytes += self.arena.nbytes if held else 0
        else:
            self._bytes = sum(a.nbytes for r in self.layers for a in (r.up, r.down, r.gate) if a is not None)
        n = layout.n_neurons
        self._all = np.arange(n, dtype=np.int64)
        self._all_mx = mx.array(self._all)
        self._table_rows = self._all // layout.quant.group_size if packed else None

    @property
    def weights_bytes(self):
        return self._bytes

    def rows(self, layer, x):
        if self.packed is not None:
            return FFNRows(up=None, down=None, ids=self._all_mx,
                           packed=PackedRows(self.layers[layer], self._all, self._all, self.layout,
                                             self.tables[layer], self.kernels, in_order=self._table_rows))
        if self.arena is None:
            return self.layers[layer]
        if self.kernels is not None and (x.size // x.shape[-1] <= SMALL_PASS or pass_kernels(self.kernels, x)):
            # the rows as held: each position through the one-token kernels (a verify pass's values
            # are a decode step's), or a batch's decode step or a prompt's chunk through the pass
            # kernels' tiles
            return FFNRows(up=None, down=None, ids=self._all_mx, select=(self.layers[layer], self._all, self.kernels))
        mx.eval(x)  # every earlier reader of the arena is an ancestor of x
        return FFNRows(**self.arena.fill_rows(self.layers[layer]))

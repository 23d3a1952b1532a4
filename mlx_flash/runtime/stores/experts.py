"""ExpertStore: a mixture-of-experts model's experts, read from their bundles into the slots of
an expert buffer (cache/expert_cache.py) as the router asks for them (EdgeMoE §3).

The slabs are one MLX matrix per weight kind and array ([slots, out, words] packed values,
[slots, out, groups] scales and biases at the compute dtype; or [slots, out, in] float),
which `mx.gather_qmm` / `mx.gather_mm` index by slot (models/moe.py). The reader writes a
missing expert's bytes straight into its slot through NumPy views of those matrices, each
part checked against its CRC32C. That is safe because the store first reads the router's
choice back to the host: it depends on every earlier layer's output and on the previous
token, so no pending computation still reads a slot (the current layer's experts are never
evicted for its own misses). A prompt whose layer routes to more experts than the buffer
holds is served in groups, each group's output evaluated before the next group's reads.
On a GPU the slabs would want a staged copy (as NeuronCache's); not written: the store is
built on the CPU (and Apple's unified memory) only.
"""

import time

import numpy as np

import mlx.core as mx

from ...cache.expert_cache import ExpertCache
from ...errors import FlashError
from ...io.reader import ChecksumError
from ...layout.experts import KINDS
from ...layout.format import read_checksums
from ...models.moe import ExpertRows

NP = {mx.float32: np.float32, mx.float16: np.float16}


class ExpertStats:
    """Per layer: experts asked for, found in the buffer, read; bytes and seconds of reads."""

    def __init__(self, n_layers):
        self.asked = np.zeros(n_layers, dtype=np.int64)
        self.hits = np.zeros(n_layers, dtype=np.int64)
        self.bytes = 0
        self.io_s = 0.0
        self.trace = []  # [(layer, unique experts)] in order: the offline policies' input (Belady)

    def summary(self):
        asked = int(self.asked.sum())
        per_layer = {i: round(float(h / a), 4) for i, (h, a) in enumerate(zip(self.hits, self.asked)) if a}
        return {"experts_asked": asked, "experts_read": asked - int(self.hits.sum()),
                "hit_rate": float(self.hits.sum() / asked) if asked else None, "hit_rate_per_layer": per_layer,
                "bytes_read": self.bytes, "io_s": self.io_s}


class ExpertStore:
    """A model's experts: `experts(layer, inds)` -> ExpertRows (or a list of parts)."""

    def __init__(self, folder, manifest, slots, dtype, reader, policy="edgemoe", verify=True):
        exp = manifest.experts
        self.layout = lay = exp["layout"]
        self.folder = folder
        self.manifest_files = exp["files"]
        self.layers = [i for i, e in enumerate(exp["files"]) if e is not None]
        n_layers = len(exp["files"])
        total = len(self.layers) * lay.n_experts
        if slots > total:
            slots = total
        self.slots = slots
        self.dtype = dtype
        self.reader = reader
        self.cache = ExpertCache(slots, lay.n_experts, n_layers, policy)
        self.stats = ExpertStats(n_layers)
        self.files, self.crc = {}, {}
        for i in self.layers:
            entry = exp["files"][i]
            self.files[i] = reader.open(folder / entry["file"], expected_size=entry["size"])
            self.crc[i] = read_checksums(folder, entry, lay, verify)
        self.weights, segments = self._slabs()
        self.segments = tuple(segments)
        self.checks_parts = tuple((o, n, j) for j, (o, n) in enumerate(lay.parts()))
        q = lay.quant
        self.bits, self.group_size = (q.bits, q.group_size) if q is not None else (None, None)

    def _slabs(self):
        """The slab matrices {kind: (weight, scales, biases) | weight} and the reader's segments
        placing a bundle's arrays into their slot rows."""
        lay, n = self.layout, self.slots
        weights, segments = {}, []
        for kind in KINDS:
            arrays = []
            for name, shape, storage in lay.arrays(kind):
                off = lay.array_offset(kind, name)
                if storage == "uint32":  # packed values: copied as they are (float32 containers of bits)
                    m = mx.zeros((n,) + tuple(shape), dtype=mx.uint32)
                    mx.eval(m)
                    view = np.array(m, copy=False).reshape(n, -1).view(np.float32)
                    segments.append((off, view.shape[1], "float32", view))
                else:  # floats (weights, scales, biases), converted to the compute dtype as read
                    m = mx.zeros((n,) + tuple(shape), dtype=self.dtype)
                    mx.eval(m)
                    view = np.array(m, copy=False).reshape(n, -1)
                    segments.append((off, view.shape[1], storage, view))
                assert view.flags.writeable
                arrays.append(m)
            weights[kind] = tuple(arrays) if len(arrays) > 1 else arrays[0]
        return weights, segments

    @property
    def slot_bytes(self):
        """DRAM one slot takes (scales at the compute dtype)."""
        return sum(a.nbytes for w in self.weights.values() for a in (w if isinstance(w, tuple) else (w,))) // self.slots

    @property
    def weights_bytes(self):
        return self.slot_bytes * self.slots

    def load_all(self):
        """Every expert of every layer into the buffer (it must hold them all: dense)."""
        for layer in self.layers:
            self._ensure(layer, np.arange(self.layout.n_experts))

    def reset_stats(self):
        self.stats = ExpertStats(len(self.manifest_files))

    def _ensure(self, layer, experts):
        """Unique experts of `layer` into the buffer -> their slots."""
        ids = self.cache.ids(layer, experts)
        slots, missing, into = self.cache.place(ids)
        if missing.size:
            t0 = time.perf_counter()
            try:
                self.reader.read_bundles(self.files[layer], missing - layer * self.layout.n_experts,
                                         self.layout.stride, self.segments, into,
                                         checks=(self.crc[layer], self.checks_parts))
            except ChecksumError as e:
                self.cache.forget(missing)
                raise FlashError(f"layer {layer}, expert {e.bundle} ({KINDS[e.part]}): {e}") from None
            except BaseException:
                self.cache.forget(missing)
                raise
            self.stats.io_s += time.perf_counter() - t0
            self.stats.bytes += missing.size * self.layout.bundle_bytes
        self.stats.asked[layer] += ids.size
        self.stats.hits[layer] += ids.size - missing.size
        return slots

    def experts(self, layer, inds):
        chosen = np.array(inds).astype(np.int64)  # (waits for the router: see the module docstring)
        unique, inverse = np.unique(chosen, return_inverse=True)
        self.stats.trace.append((layer, unique))
        if unique.size <= self.slots:
            slots = self._ensure(layer, unique)
            return self._rows(slots[inverse].reshape(chosen.shape))
        # a prompt's chunk routed to more experts than the buffer holds: in groups of `slots`
        parts = []
        for start in range(0, unique.size, self.slots):
            group = unique[start : start + self.slots]
            parts.append(self._group(layer, chosen, group, start == 0))
        return parts

    def _group(self, layer, chosen, group, now):
        def load():
            slots = self._ensure(layer, group)
            where = np.searchsorted(group, chosen).clip(0, group.size - 1)
            inside = group[where] == chosen
            return self._rows(np.where(inside, slots[where], 0), mask=mx.array(inside))

        return load() if now else load

    def _rows(self, slots, mask=None):
        return ExpertRows(mx.array(slots.astype(np.int32)), self.weights, self.bits, self.group_size, mask)

    def close(self):
        for f in self.files.values():
            self.reader.close_file(f)
        self.files = {}

"""naive and hybrid (the paper's baselines): the same neurons streamed every token.

`naive` caches nothing and reads every neuron of every layer every token; `hybrid`
keeps the first half of each layer's neurons resident (a model held at float16, or
one --mode auto chose hybrid for, keeps as many as the budget allows) and reads the rest.
"""

import time

import numpy as np

from .base import NeuronFileStore, take_pending


class StreamedStore(NeuronFileStore):
    def __init__(self, folder, manifest, plan, reader, dtype, bundled=True, tables=None, crcs=None,
                 packed=False, staged=False):
        super().__init__(folder, manifest, plan, reader, dtype, bundled, tables, crcs, packed, staged)
        self._pending = None  # (layer, buffer index, future) of the work in flight
        if plan.mode == "hybrid":  # the first half of every layer, loaded once
            half = np.arange(plan.capacity, dtype=np.int64)
            for layer, cache in enumerate(self.caches):
                self._read(layer, half, cache, cache.append(half))
            self.reader.stats.reset()

    def _fill(self, layer, stream, j):
        """Read `stream` of `layer` into buffer j, and (held) convert the layer's cache into
        arena j: the worker thread, or inline; NumPy and C only. -> ((bytes, reads), layout)."""
        buf = self.buffers[j]
        buf.delete(buf.cached_ids())
        got = self._read_counted((layer, stream, buf, buf.append(stream)))
        layout = None
        if self.arenas:
            c = self.caches[layer]
            layout = self.arenas[j].put({k: v[: c.num_used] for k, v in c.views.items()})
        return got, layout

    def _streamed(self, layer, stream):
        """(buffer index holding `layer`'s streamed rows, ((bytes, reads), layout)).

        Without prefetch, reads them now. With it, waits for the work in flight (the
        time waited is the token's I/O), then starts the next layer's on the other
        buffer / arena. Safe: the caller evaluated x, so the previous layer's FFN, the
        last reader of those, has finished."""
        if not self.plan.prefetch:
            return 0, self._fill(layer, stream, 0)
        # the first layer read, or an unexpected order (a partial forward): read it now
        j, got = take_pending(self, layer) or (0, self._fill(layer, stream, 0))
        nxt = (layer + 1) % len(self.files)
        self._pending = (nxt, 1 - j, self._submit(self._fill, nxt, stream, 1 - j))
        return j, got

    def rows(self, layer, x):
        self._begin(layer, x)
        t1 = time.perf_counter()
        hybrid, n = self.plan.mode == "hybrid", self.layout.n_neurons
        first = self.plan.capacity if hybrid else 0  # the neurons streamed: first..n-1
        stream = np.arange(first, n, dtype=np.int64)
        hits = self.caches[layer].num_used if hybrid else 0
        t2 = t3 = time.perf_counter()
        j, (got, layout) = self._streamed(layer, stream)
        converted = (self.arenas[j], layout) if layout is not None else None
        parts = ([self._part(layer, self.caches[layer], converted=converted)] if hybrid else []) + [
            self._part(layer, self.buffers[j], all_ids=not hybrid)
        ]
        t4 = time.perf_counter()
        self.stats.add(t2 - t1, t3 - t2, t4 - t3, got[0], got[1], n, hits)
        return parts

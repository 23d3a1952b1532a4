"""naive and hybrid (the paper's baselines): the same neurons streamed every token.

`naive` caches nothing and reads every neuron of every layer every token; `hybrid`
keeps the first half of each layer's neurons resident (a model held at float16, or
one --mode auto chose hybrid for, keeps as many as the budget allows) and reads the rest.
"""

import time

import mlx.core as mx
import numpy as np

from ...kernels import SMALL_PASS, pass_kernels
from ...models.ffn import FFNRows
from .base import NeuronFileStore, take_pending


class StreamedStore(NeuronFileStore):
    def __init__(self, folder, manifest, plan, reader, dtype, bundled=True, tables=None, crcs=None,
                 packed=False, staged=False):
        super().__init__(folder, manifest, plan, reader, dtype, bundled, tables, crcs, packed, staged)
        self._pending = None  # (layer, buffer index, future) of the work in flight
        n, first = self.layout.n_neurons, plan.capacity if plan.mode == "hybrid" else 0
        self._stream = np.arange(first, n, dtype=np.int64)  # the neurons read every token: first..n-1
        # (rows, ids) a decode step of float16-held caches hands the kernels: every held row
        # (neurons 0..first-1), then every streamed one, in dense's order (rows())
        held = np.arange(first, dtype=np.int64)
        self._in_place = [(np.arange(ids.size, dtype=np.int64), mx.array(ids)) for ids in (held, self._stream)]
        if plan.mode == "hybrid":  # the first half of every layer (or as much as --mode auto holds), loaded once
            for layer, cache in enumerate(self.caches):
                self._read(layer, held, cache, cache.append(held))
            self.reader.stats.reset()

    def _fill(self, layer, stream, j, convert=True):
        """Read `stream` of `layer` into buffer j, and (held, `convert`) convert the layer's cache
        into arena j: the worker thread, or inline; NumPy and C only. -> ((bytes, reads), layout)."""
        buf = self.buffers[j]
        buf.delete(buf.cached_ids())
        got = self._read_counted((layer, stream, buf, buf.append(stream)))
        return got, self._convert(layer, j) if convert else None

    def _convert(self, layer, j):
        if not self.arenas:
            return None
        c = self.caches[layer]
        return self.arenas[j].put({k: v[: c.num_used] for k, v in c.views.items()})

    def _streamed(self, layer, stream, convert):
        """(buffer index holding `layer`'s streamed rows, ((bytes, reads), layout)).

        Without prefetch, reads them now. With it, waits for the work in flight (the
        time waited is the token's I/O), then starts the next layer's on the other
        buffer / arena (converting its cache as this pass needs: the next pass is most
        likely alike). Safe: the caller evaluated x, so the previous layer's FFN, the
        last reader of those, has finished."""
        if not self.plan.prefetch:
            return 0, self._fill(layer, stream, 0, convert)
        # the first layer read, or an unexpected order (a partial forward): read it now
        j, got = take_pending(self, layer) or (0, self._fill(layer, stream, 0, convert))
        nxt = (layer + 1) % len(self.files)
        self._pending = (nxt, 1 - j, self._submit(self._fill, nxt, stream, 1 - j, convert))
        return j, got

    def rows(self, layer, x):
        self._begin(layer, x)
        t1 = time.perf_counter()
        hybrid, n = self.plan.mode == "hybrid", self.layout.n_neurons
        hits = self.caches[layer].num_used if hybrid else 0
        # float16-held caches (a hybrid's) and a pass of up to SMALL_PASS positions, or a batch's
        # decode step or a prompt's chunk the pass kernels take: the native kernels read the held
        # rows as they are, and the streamed ones after them (into the same host sums), where a
        # prompt's chunk they do not take (kernels.passes.PROMPT_PASS) converts the cache into an arena for BLAS
        direct = bool(self.arenas) and self.kernels is not None and (
            x.size // x.shape[-1] <= SMALL_PASS or pass_kernels(self.kernels, x))
        t2 = t3 = time.perf_counter()
        j, (got, layout) = self._streamed(layer, self._stream, convert=not direct)
        if direct:
            parts = [FFNRows(up=None, down=None, ids=ids, select=(c.views, rows, self.kernels))
                     for c, (rows, ids) in zip((self.caches[layer], self.buffers[j]), self._in_place)]
        else:
            if layout is None and hybrid:  # (its prefetch was a decode step's, which converts nothing)
                layout = self._convert(layer, j)
            converted = (self.arenas[j], layout) if layout is not None else None
            parts = ([self._part(layer, self.caches[layer], converted=converted)] if hybrid else []) + [
                self._part(layer, self.buffers[j], all_ids=not hybrid)
            ]
        t4 = time.perf_counter()
        self.stats.add(t2 - t1, t3 - t2, t4 - t3, got[0], got[1], n, hits)
        return parts

"""flash: the neurons a token needs, through per-layer windowed neuron caches (paper §3, Figure 6).

Per layer and token:
    x -> sparsity source -> active ids
    window: the neurons active in the last k tokens stay cached; those that left
            the window give their rows to the new ones (or are swap-deleted, with
            overlap); a full cache shrinks its window
    active - cached -> FlashReader (coalesced parallel uncached reads) -> those rows
    FFN on cache rows [:num_used] (+ the overflow streamed through scratch rows)

With overlap, the reads of a layer's missing neurons run in a worker thread
while the FFN computes on the neurons already cached; the FFN takes the rest
when it has evaluated that part (FlashFFN: a callable part).
"""

import time
from collections import deque

import numpy as np

import mlx.core as mx

from .base import NeuronFileStore, TooManyNeurons


REWIND_POSITIONS = 16  # passes up to this many positions keep each one's neurons (speculative verify passes)


class FlashStore(NeuronFileStore):
    FIT_ERROR = "{n} neurons in layer {layer}, more than the {limit} rows the memory budget leaves it"

    def __init__(self, folder, manifest, plan, source, reader, dtype=mx.float32, bundled=True,
                 overlap=False, tables=None, crcs=None, packed=False, staged=False):
        super().__init__(folder, manifest, plan, reader, dtype, bundled, tables, crcs, packed, staged)
        self.source = source
        self.overlap = overlap
        self.window = plan.window
        self.history = [deque() for _ in self.files]  # active ids of the last tokens
        self.counts = [np.zeros(self.layout.n_neurons, dtype=np.int32) for _ in self.files]
        # beside each history entry, (its positions, each one's neurons or None): what rewind needs.
        # The masks of passes up to REWIND_POSITIONS positions only (a verify pass; not a prompt chunk's)
        self.masks = [deque() for _ in self.files]

    def _overlapped(self, layer, cache, keep, new_rows, overflow, over_rows, mask, shape):
        """[the cached rows' part, a callable giving the rest].

        The worker writes rows [n_old:] of the cache and the scratch; the FFN reads
        rows [:n_old] meanwhile (disjoint memory), and calls the rest only once it
        has evaluated that part, which waits for the reads (the token's I/O time)."""
        n_old = int(new_rows[0]) if new_rows.size else cache.num_used
        fut = self._submit(self._read_counted, (layer, keep, cache, new_rows),
                           (layer, overflow, self.scratch, over_rows))
        old = self._part(layer, cache, mask=mask, shape=shape, rows=slice(0, n_old))

        def rest():
            t = time.perf_counter()
            got = fut.result()  # a failed read raises here
            self.stats.add(io_s=time.perf_counter() - t, bytes_read=got[0], reads=got[1])
            return [self._part(layer, cache, mask=mask, shape=shape, rows=slice(n_old, cache.num_used))] + (
                [self._part(layer, self.scratch, mask=mask, shape=shape)] if overflow.size else [])

        rest.overwrites = not self.staged  # host writes go to other rows; staged ones to none MLX reads
        return [old, rest]

    def _passes(self, layer, ids, mask, shape):
        """A callable FFN part: the neurons `ids` of one token that neither its cache nor one
        scratch load held, read into the scratch a load at a time. FlashFFN calls it after it
        has evaluated the parts before, so the scratch's rows are free to overwrite."""

        def more():
            cap = self.scratch.capacity
            chunk, rest = ids[:cap], ids[cap:]
            self.scratch.delete(self.scratch.cached_ids())
            t = time.perf_counter()
            got = self._read_counted((layer, chunk, self.scratch, self.scratch.append(chunk)))
            self.stats.add(io_s=time.perf_counter() - t, bytes_read=got[0], reads=got[1])
            return [self._part(layer, self.scratch, mask=mask, shape=shape)] + (
                [self._passes(layer, rest, mask, shape)] if rest.size else [])

        more.overwrites = not self.staged  # the host path rewrites the scratch rows the last part read
        return more

    def rewind(self, n):
        """The last n positions fed were rejected (speculative decoding): the window forgets
        them, so it keeps the accepted prefix's neurons. A pass of several positions is one
        entry of the window (or several, when it ran in halves); an entry losing some of its
        positions keeps the neurons of the rest. The rows stay cached until a later pass
        reuses them (they are out of the window)."""
        for hist, masks, counts in zip(self.history, self.masks, self.counts):
            left = n
            while left > 0 and hist:
                size, mask = masks[-1]
                counts[hist[-1]] -= 1
                if left >= size or mask is None:  # (a long pass's masks were not kept: all of it goes)
                    hist.pop()
                    masks.pop()
                    left -= size
                    continue
                mask = mask[: size - left]
                kept = np.flatnonzero(mask.any(axis=0)).astype(np.int64)
                counts[kept] += 1
                hist[-1], masks[-1], left = kept, (size - left, mask), 0

    def rows(self, layer, x):
        st = self._begin(layer, x)
        t1 = time.perf_counter()
        mask = self.source.select(layer, x)
        ids = np.flatnonzero(mask.any(axis=0)).astype(np.int64)
        limit = self.caches[layer].capacity + self.scratch.capacity
        if ids.size > limit and int(np.prod(x.shape[:-1])) > 1:
            raise TooManyNeurons()  # a chunk of tokens: FlashFFN runs it in halves
        # one token past cache + scratch: the rest streams through the scratch in passes
        t2 = time.perf_counter()
        got = (0, 0)  # (bytes, reads) of this layer; an overlapped read adds its own later

        cache, counts, hist = self.caches[layer], self.counts[layer], self.history[layer]
        masks = self.masks[layer]
        hist.append(ids)
        positions = mask.shape[0] if mask.ndim == 2 else 1
        masks.append((positions, mask if 1 < positions <= REWIND_POSITIONS else None))
        counts[ids] += 1
        while len(hist) > self.window:
            counts[hist.popleft()] -= 1
            masks.popleft()
        # a full cache shrinks this layer's window (oldest tokens first)
        while len(hist) > 1 and np.count_nonzero(counts) > cache.capacity:
            counts[hist.popleft()] -= 1
            masks.popleft()
        cached = cache.cached_ids()
        gone = cached[counts[cached] == 0]
        missing = ids[~cache.contains(ids)]
        hits = ids.size - missing.size
        room = cache.capacity - cache.num_used + gone.size
        keep, overflow = missing[:room], missing[room:]
        overflow, later = overflow[: self.scratch.capacity], overflow[self.scratch.capacity :]
        if self.overlap:  # new rows after the old ones: the worker fills them while the FFN reads those
            cache.delete(gone)
            new_rows = cache.append(keep)
        else:  # new neurons in the rows of those that left the window: no rows move
            new_rows = cache.replace(gone, keep)
        self.scratch.delete(self.scratch.cached_ids())
        over_rows = self.scratch.append(overflow)
        t3 = time.perf_counter()
        st["windows"].append(len(hist))
        if self.overlap and new_rows.size + overflow.size and new_rows.size < cache.num_used and not later.size:
            parts = self._overlapped(layer, cache, keep, new_rows, overflow, over_rows, mask, x.shape)
        else:
            got = self._read_counted((layer, keep, cache, new_rows),
                                     (layer, overflow, self.scratch, over_rows))
            parts = [self._part(layer, cache, mask=mask, shape=x.shape)] + (
                [self._part(layer, self.scratch, mask=mask, shape=x.shape)] if overflow.size else [])
            if later.size:
                parts.append(self._passes(layer, later, mask, x.shape))
        t4 = time.perf_counter()
        self.stats.add(t2 - t1, t3 - t2, t4 - t3, got[0], got[1], int(ids.size), int(hits))
        return parts

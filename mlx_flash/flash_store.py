"""FlashStore: FFN rows from flash, per token, through per-layer neuron caches.

Per layer and token (paper §3, Figure 6):
    x -> sparsity source -> active ids
    window: the neurons active in the last k tokens stay cached; those that left
            the window are deleted (swap-delete); a full cache shrinks its window
    active - cached -> FlashReader (coalesced parallel uncached reads) -> appended rows
    FFN on cache rows [:num_used] (+ the overflow streamed through scratch rows)

Modes share this path: `naive` caches nothing and streams every neuron every
token (the paper's naive baseline); `hybrid` keeps the first half of each
layer's neurons resident and streams the other half (a model held at float16
keeps as many as the budget allows, at float16); `flash` is the method.

Safety of in-place writes: `rows()` evaluates its input first. That input
depends on every earlier computation, including the previous token's use of
this layer's cache and the previous layer's use of the scratch rows, so no
pending MLX computation reads the rows we overwrite.
"""

import time
from collections import deque

import numpy as np

import mlx.core as mx

from .cache import NeuronCache
from .errors import FlashError
from .models.ffn import FFNRows


def read_into(reader, file, layout, ids, cache, rows, bundled=True):
    """Read the bundles `ids` of `file` into rows `rows` of `cache`, one segment per weight kind.

    bundled=False: one read per neuron and weight kind, never merged across
    kinds (the paper's layout before row-column bundling, §3.2), for measuring
    what bundling buys."""
    if not ids.size:
        return
    if bundled:
        segs = [(j * layout.row_bytes, layout.d_model, layout.dtype, cache.views[k])
                for j, k in enumerate(layout.kinds)]
        reader.read_bundles(file, ids, layout.stride, segs, rows)
        return
    for j, k in enumerate(layout.kinds):
        reader.read_bundles(file, ids, layout.stride, [(0, layout.d_model, layout.dtype, cache.views[k])],
                            rows, base=j * layout.row_bytes, gap=0)


class TooManyNeurons(Exception):
    """A chunk of tokens needs more neurons than cache + scratch hold: split it."""


class TokenStats:
    KEYS = ("io_ms", "mem_ms", "predict_ms", "compute_ms", "total_ms", "bytes_read", "reads",
            "active", "hits", "hit_rate", "window", "tokens")

    def __init__(self):
        self.rows = []
        self.cur = None
        self.t_start = None

    def begin(self, n_tokens):
        now = time.perf_counter()
        if self.cur is not None:
            self.end(now)
        self.cur = dict.fromkeys(self.KEYS, 0)
        self.cur["tokens"] = n_tokens
        self.cur["windows"] = []
        self.t_start = now

    def end(self, now=None):
        if self.cur is None:
            return
        c = self.cur
        c["total_ms"] = 1e3 * ((now or time.perf_counter()) - self.t_start)
        c["compute_ms"] = c["total_ms"] - c["io_ms"] - c["mem_ms"] - c["predict_ms"]
        c["hit_rate"] = c["hits"] / c["active"] if c["active"] else 1.0
        w = c.pop("windows")
        c["window"] = float(np.mean(w)) if w else 0.0
        self.rows.append(c)
        self.cur = None

    def summary(self, decode_only=True):
        rows = [r for r in self.rows if r["tokens"] == 1] if decode_only else self.rows
        if not rows:
            return {}
        return {f"mean_{k}": float(np.mean([r[k] for r in rows])) for k in self.KEYS if k != "tokens"} | {
            "n_tokens": len(rows)
        }


class FlashStore:
    def __init__(self, folder, manifest, plan, source, reader, dtype=mx.float32, bundled=True,
                 overlap=False):
        # overlap (flash mode): the reads of a layer's missing neurons run in a worker
        # thread while the FFN computes on the neurons already cached; the FFN takes
        # the rest when it has evaluated that part (FlashFFN: a callable part)
        self.overlap = overlap and plan.mode == "flash"
        self.plan = plan
        self.bundled = bundled
        self.source = source
        self.reader = reader
        self.layout = lay = manifest.layout
        self.kinds = lay.kinds
        self.files = [reader.open(folder / e["file"], expected_size=e["size"]) for e in manifest.ffn_files]
        n, d = lay.n_neurons, lay.d_model
        # prefetch: two streaming buffers; layer i+1's rows are read into one while layer i
        # computes on the other (naive / hybrid stream the same neurons every token); a
        # held (float16) hybrid also has two arenas, layer i+1's cache converted meanwhile
        bufs = 2 if plan.prefetch else 1
        self.arenas = []
        if plan.held_neuron_bytes:  # float16 caches, converted into an arena before use
            from .models.half import Arena

            self.arenas = [Arena(max(plan.arena_rows // bufs, 1) * d * len(self.kinds)) for _ in range(bufs)]
        self.caches = [NeuronCache(max(plan.layer_capacity(i), 1), n, d, self.kinds, dtype,
                                   self.arenas[0] if self.arenas else None)
                       for i in range(len(self.files))]
        self.buffers = [NeuronCache(max(plan.scratch_rows // bufs, 1), n, d, self.kinds, dtype)
                        for _ in range(bufs)]
        self.scratch = self.buffers[0]
        self._pending = None  # (layer, buffer index, future) of the work in flight
        self._worker = None
        self.window = plan.window
        self.history = [deque() for _ in self.files]  # active ids of the last tokens
        self.counts = [np.zeros(n, dtype=np.int32) for _ in self.files]
        self.stats = TokenStats()
        if plan.mode == "hybrid":  # the first half of every layer, loaded once
            half = np.arange(plan.capacity, dtype=np.int64)
            for layer, cache in enumerate(self.caches):
                self._read(layer, half, cache, cache.append(half))
            self.reader.stats.reset()

    @property
    def weights_bytes(self):
        arena = sum(a.nbytes for a in self.arenas)
        return (sum(c.weights_bytes for c in self.caches) + sum(b.weights_bytes for b in self.buffers)
                + arena)

    def _read(self, layer, ids, cache, rows):
        read_into(self.reader, self.files[layer], self.layout, ids, cache, rows, self.bundled)

    def _part(self, cache, all_ids=False, mask=None, shape=None, converted=None, rows=None):
        """Rows of a cache as an FFN part; `mask` [tokens, n_neurons] keeps each token to its own
        neurons; `rows` (a slice) takes part of the cached rows."""
        m, ids = cache.rows(converted)
        cached = cache.cached_ids()
        if rows is not None:
            m, ids, cached = {k: v[rows] for k, v in m.items()}, ids[rows], cached[rows]
        keep = None
        if mask is not None and not mask[:, cached].all():
            keep = mx.array(mask[:, cached]).reshape(*shape[:-1], -1)
        return FFNRows(up=m["up"], down=m["down"], gate=m.get("gate"), ids=None if all_ids else ids,
                       mask=keep)

    def _read_counted(self, *jobs):
        """Run reads (layer, ids, cache, rows); -> (bytes, reads) they took. The reader has
        one user at a time (the main thread, or the worker while the main thread waits)."""
        s = self.reader.stats
        b0, r0 = s.bytes_read, s.reads_issued
        for job in jobs:
            self._read(*job)
        return s.bytes_read - b0, s.reads_issued - r0

    def _submit(self, fn, *args):
        from concurrent.futures import ThreadPoolExecutor

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="mlx_flash-prefetch")
        return self._worker.submit(fn, *args)

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
        """Naive / hybrid: (buffer index holding `layer`'s streamed rows, ((bytes, reads), layout)).

        Without prefetch, reads them now. With it, waits for the work in flight (the
        time waited is the token's I/O), then starts the next layer's on the other
        buffer / arena. Safe: the caller evaluated x, so the previous layer's FFN, the
        last reader of those, has finished."""
        if not self.plan.prefetch:
            return 0, self._fill(layer, stream, 0)
        got = None
        if self._pending is not None:
            p_layer, p_j, fut = self._pending
            self._pending = None
            res = fut.result()  # a failed read raises here, in the layer that needs it
            if p_layer == layer:
                j, got = p_j, res
        if got is None:  # the first layer read, or an unexpected order (a partial forward)
            j, got = 0, self._fill(layer, stream, 0)
        nxt = (layer + 1) % len(self.files)
        self._pending = (nxt, 1 - j, self._submit(self._fill, nxt, stream, 1 - j))
        return j, got

    def _overlapped(self, layer, cache, keep, new_rows, overflow, over_rows, mask, shape, st):
        """Flash mode with overlap: [the cached rows' part, a callable giving the rest].

        The worker writes rows [n_old:] of the cache and the scratch; the FFN reads
        rows [:n_old] meanwhile (disjoint memory), and calls the rest only once it
        has evaluated that part, which waits for the reads (the token's I/O time)."""
        n_old = int(new_rows[0]) if new_rows.size else cache.num_used
        fut = self._submit(self._read_counted, (layer, keep, cache, new_rows),
                           (layer, overflow, self.scratch, over_rows))
        old = self._part(cache, mask=mask, shape=shape, rows=slice(0, n_old))

        def rest():
            t = time.perf_counter()
            got = fut.result()  # a failed read raises here
            st["io_ms"] += 1e3 * (time.perf_counter() - t)
            st["bytes_read"] += got[0]
            st["reads"] += got[1]
            return [self._part(cache, mask=mask, shape=shape, rows=slice(n_old, cache.num_used))] + (
                [self._part(self.scratch, mask=mask, shape=shape)] if overflow.size else [])

        return [old, rest]

    def rows(self, layer, x):
        t0 = time.perf_counter()
        if layer == 0:
            self.stats.begin(int(np.prod(x.shape[:-1])))
        mx.eval(x)
        st = self.stats.cur
        t1 = time.perf_counter()
        mode, n = self.plan.mode, self.layout.n_neurons
        if mode in ("naive", "hybrid"):
            ids = np.arange(self.plan.capacity if mode == "hybrid" else 0, n, dtype=np.int64)
            hits = self.caches[layer].num_used if mode == "hybrid" else 0
        else:
            mask = self.source.select(layer, x)
            ids = np.flatnonzero(mask.any(axis=0)).astype(np.int64)
            limit = self.caches[layer].capacity + self.scratch.capacity
            if ids.size > limit:
                tokens = int(np.prod(x.shape[:-1]))
                if tokens > 1:
                    raise TooManyNeurons()
                raise FlashError(
                    f"one token needs {ids.size} neurons in layer {layer}, more than the "
                    f"{limit} rows the memory budget leaves it; raise --memory-budget or lower --density"
                )
        t2 = time.perf_counter()
        got = (0, 0)  # (bytes, reads) of this layer; an overlapped read adds its own later

        if mode == "flash":
            cache, counts, hist = self.caches[layer], self.counts[layer], self.history[layer]
            hist.append(ids)
            counts[ids] += 1
            while len(hist) > self.window:
                counts[hist.popleft()] -= 1
            # a full cache shrinks this layer's window (oldest tokens first)
            while len(hist) > 1 and np.count_nonzero(counts) > cache.capacity:
                counts[hist.popleft()] -= 1
            cached = cache.cached_ids()
            cache.delete(cached[counts[cached] == 0])
            missing = ids[~cache.contains(ids)]
            hits = ids.size - missing.size
            room = cache.capacity - cache.num_used
            keep, overflow = missing[:room], missing[room:]
            new_rows = cache.append(keep)
            self.scratch.delete(self.scratch.cached_ids())
            over_rows = self.scratch.append(overflow)
            t3 = time.perf_counter()
            st["windows"].append(len(hist))
            if self.overlap and new_rows.size + overflow.size and new_rows.size < cache.num_used:
                parts = self._overlapped(layer, cache, keep, new_rows, overflow, over_rows, mask,
                                         x.shape, st)
            else:
                got = self._read_counted((layer, keep, cache, new_rows),
                                         (layer, overflow, self.scratch, over_rows))
                parts = [self._part(cache, mask=mask, shape=x.shape)] + (
                    [self._part(self.scratch, mask=mask, shape=x.shape)] if overflow.size else [])
        else:
            stream = ids[ids >= (self.plan.capacity if mode == "hybrid" else 0)]
            t3 = time.perf_counter()
            j, (got, layout) = self._streamed(layer, stream)
            converted = (self.arenas[j], layout) if layout is not None else None
            parts = ([self._part(self.caches[layer], converted=converted)] if mode == "hybrid" else []) + [
                self._part(self.buffers[j], all_ids=mode == "naive")
            ]
        t4 = time.perf_counter()
        st["predict_ms"] += 1e3 * (t2 - t1)
        st["mem_ms"] += 1e3 * (t3 - t2)
        st["io_ms"] += 1e3 * (t4 - t3)
        st["bytes_read"] += got[0]
        st["reads"] += got[1]
        st["active"] += int(ids.size) if mode == "flash" else n
        st["hits"] += int(hits)
        return parts

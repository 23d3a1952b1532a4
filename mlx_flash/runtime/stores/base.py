"""What every store shares: the FFN files' rows read into caches, counted; the
per-token statistics; the fit check of a token's rows against the plan; a worker
thread for reads that overlap compute; and the neuron caches + streaming buffers
(+ float16 arenas) that the naive, hybrid and flash stores size from the plan.

A store's one call is `rows(layer, x)` -> FFNRows or a list of them (models/ffn.py).

Safety of in-place writes: a streaming store's `rows()` evaluates its input first.
That input depends on every earlier computation, including the previous token's
use of this layer's cache and the previous layer's use of the scratch rows, so no
pending MLX computation reads the rows it overwrites.
"""

import hashlib

import numpy as np

import mlx.core as mx

from ...cache import NeuronCache
from ...errors import FlashError, ModelFileError
from ...io.files import ChecksumError
from ...layout.format import check_file
from ...models.ffn import FFNRows, PackedRows
from ..stats import TokenStats


class TooManyNeurons(Exception):
    """A chunk of tokens needs more neurons than cache + scratch hold: split it (FlashFFN does)."""


def cpu_kernels():
    """The native kernels when MLX computes on the CPU (else None: MLX's own ops)."""
    if mx.default_device() != mx.cpu:
        return None
    from ...kernels import kernels_module

    return kernels_module()[0]


def read_layer_bytes(folder, entry, verify=True):
    """One layer's FFN file, read whole (its sha256 checked unless verify=False) -> bytearray."""
    check_file(folder, entry, checksum=False)
    path = folder / entry["file"]
    buf = bytearray(entry["size"])
    try:
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(memoryview(buf))
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
    if got != len(buf):
        raise ModelFileError(f"{path}: short read ({got} of {len(buf)} bytes)")
    if verify and hashlib.sha256(buf).hexdigest() != entry["sha256"]:
        raise ModelFileError(f"{path}: sha256 differs from the manifest (file changed since conversion)")
    return buf


def read_layer_file(folder, entry, layout, verify=True, tables=None):
    """One layer's FFN file, read whole -> {kind: float32 numpy [n_neurons, d_model]}
    (tables: the layer's scale tables, for a quantized layout's column kinds)."""
    return layout.split(read_layer_bytes(folder, entry, verify), tables)


def read_into(reader, file, layout, ids, cache, rows, bundled=True, tables=None, crc=None, where="",
              memo=None):
    """Read the bundles `ids` of `file` into rows `rows` of `cache`, one segment per weight kind
    (a quantized layout's values dequantized on the way, with the layer's `tables`), each
    part checked against its CRC32C when `crc` (the file's [n_bundles, kinds]) is given.

    bundled=False: one read per neuron and weight kind, never merged across
    kinds (the paper's layout before row-column bundling, §3.2), for measuring
    what bundling buys. where: "layer N" for a damaged part's error. memo: a store's
    dict, which keeps the reads' segments and checks from token to token (the reader
    then validates them once)."""
    if not ids.size:
        return
    try:
        for base, segs, checks in _reads(memo, layout, cache, tables, crc, bundled):
            reader.read_bundles(file, ids, layout.stride, segs, rows, base=base, gap=None if bundled else 0,
                                checks=checks)
    except ChecksumError as e:
        raise ModelFileError(f"{where + ', ' if where else ''}neuron {e.bundle} ({layout.kinds[e.part]}): "
                             f"{e}") from None


def _reads(memo, layout, cache, tables, crc, bundled):
    """[(base, segments, checks)] of read_into's read_bundles calls, as tuples (kept in memo)."""
    key = (id(cache), id(tables), id(crc), bundled)
    hit = memo.get(key) if memo is not None else None
    if hit is not None and hit[0] is cache:
        return hit[1]
    def segments(kinds=None):  # a packed cache takes the bytes as they are
        return (layout.raw_segments(cache.views, kinds) if cache.packed else
                layout.segments(cache.views, tables, kinds))

    if bundled:
        parts = tuple((o, n, j) for j, (o, n) in enumerate(layout.parts()))
        reads = [(0, tuple(segments()), None if crc is None else (crc, parts))]
    else:
        reads = []
        for j, k in enumerate(layout.kinds):
            (off, n, src, dst), = segments([k])
            reads.append((off, ((0, n, src, dst),), None if crc is None else (crc, ((0, layout.kind_bytes(k), j),))))
    if memo is not None:
        memo[key] = (cache, reads)  # the cache pins the key's identity; tables and crc are the store's
    return reads


def take_pending(store, layer):
    """A double-buffered store's read in flight (`store._pending`: (layer, buffer, future) or
    None), waited for and cleared: a failed read raises here, in the layer that needs it.
    -> (buffer, the read's result) when it was `layer`'s, else None (read it now)."""
    if store._pending is None:
        return None
    p_layer, j, fut = store._pending
    store._pending = None
    res = fut.result()
    return (j, res) if p_layer == layer else None


class Store:
    """The base of every store. `stats` is None for a store that streams nothing (dense)."""

    stats = None
    reader = None
    _worker = None
    _pending = None  # a double-buffered store's read in flight: (key, buffer, future) (take_pending)

    def rows(self, layer, x):
        raise NotImplementedError

    @property
    def weights_bytes(self):
        raise NotImplementedError

    staged = False  # caches written through host staging (no in-place host writes)
    timed = False  # --stats / the benchmarks: phases timed truthfully, at a synchronisation per layer

    def _begin(self, layer, x):
        """The start of rows(): a new pass at layer 0, then x evaluated (see the module
        docstring), unless the caches are staged: no host write then touches memory MLX
        reads, and x is evaluated by whatever first reads it back (the sparsity decision),
        one host synchronisation fewer per layer; `timed` evaluates it anyway, so that the
        work before this layer is not counted as its prediction. -> the current pass's stats row."""
        if layer == 0:
            self.stats.begin(int(np.prod(x.shape[:-1])))
        if not self.staged or self.timed:
            mx.eval(x)
        return self.stats.cur

    def _counts(self):
        s = self.reader.stats
        return s.bytes_read, s.reads_issued

    FIT_ERROR = "{n} rows in layer {layer}, more than the {limit} the memory budget leaves it"

    def _check_fits(self, n, limit, x, layer):
        """The `n` rows x needs must fit `limit`; a chunk of several tokens is split instead
        (the message is only formatted when it does not fit: this runs every layer)."""
        if n <= limit:
            return
        if int(np.prod(x.shape[:-1])) > 1:
            raise TooManyNeurons()
        raise FlashError("one token needs " + self.FIT_ERROR.format(n=n, layer=layer, limit=limit)
                         + "; raise --memory-budget or lower --density")

    def _submit(self, fn, *args):
        from concurrent.futures import ThreadPoolExecutor

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="mlx_flash-prefetch")
        return self._worker.submit(fn, *args)

    def close(self):
        """The read in flight finished (its error no longer anyone's), then the worker and the
        reader stopped (the store is unusable afterwards)."""
        if self._pending is not None:
            try:
                self._pending[2].result()
            except Exception:
                pass
            self._pending = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self.reader is not None:
            self.reader.close()


class NeuronFileStore(Store):
    """Rows of the FFN files (one per layer, a bundle per neuron) through per-layer neuron
    caches sized by the plan, and streaming buffers for what a cache does not hold.

    With plan.prefetch: two streaming buffers (layer i+1's rows are read into one while
    layer i computes on the other); a held (float16) hybrid also has two arenas, layer
    i+1's cache converted meanwhile."""

    def __init__(self, folder, manifest, plan, reader, dtype=mx.float32, bundled=True, tables=None,
                 crcs=None, packed=False, staged=False):
        """packed: a quantized layout's rows stay at their bits in the caches (the CPU's native
        kernels compute on them); else they are dequantized as they are read. staged: the
        caches' new rows go through a host staging copy (cache/neuron_cache.py)."""
        self.staged = staged
        self.plan = plan
        self.tables = tables or [None] * len(manifest.ffn_files)  # per layer (quantized layouts)
        self.crcs = crcs or [None] * len(manifest.ffn_files)  # per layer: checksums, unless --no-verify
        self._reads = {}  # read_into's memo
        self.bundled = bundled
        self.reader = reader
        self.layout = lay = manifest.layout
        self.kinds = lay.kinds
        self.files = [reader.open(folder / e["file"], expected_size=e["size"]) for e in manifest.ffn_files]
        n, d = lay.n_neurons, lay.d_model
        bufs = 2 if plan.prefetch else 1
        self.arenas = []
        if plan.held_neuron_bytes:  # float16 caches, converted into an arena before use
            from ...models.half import Arena

            self.arenas = [Arena(max(plan.arena_rows // bufs, 1) * d * len(self.kinds)) for _ in range(bufs)]
        self.kernels = cpu_kernels()
        self.packed = {k: lay.kind_bytes(k) for k in self.kinds} if packed else None
        if packed and (lay.quant is None or "down" not in lay.columns or self.kernels is None or self.arenas):
            raise FlashError("packed FFN rows need a quantized layout (down stored as columns), float32 "
                             "compute and the native kernels on the CPU")
        self.caches = [NeuronCache(max(plan.layer_capacity(i), 1), n, d, self.kinds, dtype,
                                   self.arenas[0] if self.arenas else None, self.packed, staged)
                       for i in range(len(self.files))]
        self.buffers = [NeuronCache(max(plan.scratch_rows // bufs, 1), n, d, self.kinds, dtype,
                                    packed=self.packed, staged=staged) for _ in range(bufs)]
        self.scratch = self.buffers[0]
        self.stats = TokenStats()

    @property
    def weights_bytes(self):
        arena = sum(a.nbytes for a in self.arenas)
        return (sum(c.weights_bytes for c in self.caches) + sum(b.weights_bytes for b in self.buffers)
                + arena)

    @property
    def held_rows(self):
        """FFN rows holding weights right now (caches + scratch in use)."""
        return sum(c.num_used for c in self.caches) + self.scratch.num_used

    def _read(self, layer, ids, cache, rows):
        read_into(self.reader, self.files[layer], self.layout, ids, cache, rows, self.bundled,
                  self.tables[layer], self.crcs[layer], f"layer {layer}", self._reads)

    def _read_counted(self, *jobs):
        """Run reads (layer, ids, cache, rows); -> (bytes, reads) they took. The reader has
        one user at a time (the main thread, or the worker while the main thread waits)."""
        b0, r0 = self._counts()
        try:
            for job in jobs:
                self._read(*job)
        except BaseException:
            # the rows appended for these reads hold nothing valid: forget their ids, so that a
            # caller that catches the error and goes on never computes with them
            for _, ids, cache, _ in jobs:
                cache.delete(ids[cache.contains(ids)])
            raise
        b1, r1 = self._counts()
        return b1 - b0, r1 - r0

    def _part(self, layer, cache, all_ids=False, mask=None, shape=None, converted=None, rows=None):
        """Rows of a cache, holding `layer`'s neurons, as an FFN part; `mask` [tokens, n_neurons]
        keeps each token to its own neurons; `rows` (a slice) takes part of the cached rows.

        One token on the CPU over float32 rows: the part names the active rows of the cache
        (FFNRows.select) and the FFN computes on those alone (kernels' gather_mv / _axpy),
        not on the whole window masked (~5x the bytes with the paper's trace)."""
        cached = cache.cached_ids()
        lo = 0 if rows is None else rows.start
        span = cached if rows is None else cached[rows]
        if cache.packed:  # every row, or each token's (the union when several: their mask then)
            on = None if mask is None else mask[:, span]
            sel = lo + (np.arange(span.size) if on is None else np.flatnonzero(on.any(axis=0)))
            keep = None
            if on is not None and on.shape[0] > 1 and not on[:, sel - lo].all():
                keep = mx.array(on[:, sel - lo]).reshape(*shape[:-1], -1)
            return FFNRows(up=None, down=None, ids=mx.array(cache.row_to_id[sel]), mask=keep,
                           packed=PackedRows(cache.views, sel.astype(np.int64), cache.row_to_id[sel],
                                             self.layout, self.tables[layer], self.kernels))
        if (mask is not None and mask.shape[0] == 1 and converted is None and cache.arena is None
                and self.kernels is not None and cache.host_readable):
            sel = (lo + np.flatnonzero(mask[0, span])).astype(np.int64)
            return FFNRows(up=None, down=None, ids=mx.array(cache.row_to_id[sel]),
                           select=(cache.views, sel, self.kernels))
        m, ids = cache.rows(converted, upto=None if rows is None else rows.stop)
        if rows is not None:
            m, ids, cached = {k: v[rows] for k, v in m.items()}, ids[rows], cached[rows]
        keep = None
        if mask is not None and not mask[:, cached].all():
            keep = mx.array(mask[:, cached]).reshape(*shape[:-1], -1)
        return FFNRows(up=m["up"], down=m["down"], gate=m.get("gate"), ids=None if all_ids else ids,
                       mask=keep)

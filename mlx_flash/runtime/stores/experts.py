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

Overlap (one position on the CPU, `overlap`): the layer's missing experts are read on the
worker while the native kernels compute the ones already in the buffer; the FFN then waits
(ExpertRows.late) and computes the rest. The same sums, in the same slots: only the time moves.
The worker's read never touches the cache's books (the main thread forgets a failed read's
experts when it waits), so the look-ahead may reserve slots meanwhile; the current layer's slots,
the ones being read included, are `busy` and never given to it.

On a GPU the slabs would want a staged copy (as NeuronCache's); not written: the store is
built on the CPU (and Apple's unified memory) only.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait as futures_wait

import numpy as np

import mlx.core as mx

from ...cache.expert_cache import ExpertCache
from ...errors import ModelFileError
from ...io.files import ChecksumError
from ...kernels import QuantMatrix
from ...layout.experts import KINDS, layer_groups
from ...layout.format import read_checksums
from ...layout.quant import widen
from ...models.moe import ExpertRows
from ..stats import hidden_share
from .base import cpu_kernels

NARROW_STAGING = 64 << 20  # bytes of narrower experts staged at a time before widening
# experts the look-ahead reads at a time: between batches it stops when their layer comes, so a late
# or wrong guess costs at most one batch's wait (4 Qwen3-30B-A3B experts: ~11 MB, ~5 ms here)
READ_AHEAD_BATCH = 4


class ExpertStats:
    """Per layer: experts asked for, found in the buffer (read ahead or kept), read when asked;
    bytes and seconds of those reads; the look-ahead's predictions, how many came true, what
    its reads cost and how long a layer still waited for them."""

    def __init__(self, n_layers):
        self.asked = np.zeros(n_layers, dtype=np.int64)
        self.hits = np.zeros(n_layers, dtype=np.int64)
        self.bytes = 0
        self.io_s = 0.0  # what the layers waited for their own missing experts
        self.read_s = 0.0  # how long those reads took (more than io_s where compute overlapped them)
        self.predicted = 0  # experts the look-ahead read for a layer (named, not in the buffer, read in time)
        self.predicted_used = 0  # of those, asked for by that layer
        self.prefetched_bytes = 0
        self.cancelled = 0  # named experts whose read had not begun when their layer came (not read)
        self.prefetch_s = 0.0  # the worker's reading time
        self.wait_s = 0.0  # of it, what a layer waited for (the rest was hidden by compute)
        # [(layer, unique experts)] in order, when a benchmark sets it to a list: the offline policies'
        # input (Belady). None by default: a long chat would grow it by a layer's experts a layer
        self.trace = None

    def summary(self):
        asked = int(self.asked.sum())
        per_layer = {i: round(float(h / a), 4) for i, (h, a) in enumerate(zip(self.hits, self.asked)) if a}
        out = {"experts_asked": asked, "experts_read": asked - int(self.hits.sum()),
               "hit_rate": float(self.hits.sum() / asked) if asked else None, "hit_rate_per_layer": per_layer,
               "bytes_read": self.bytes, "io_s": self.io_s, "read_s": self.read_s,
               "hidden_share": self.hidden_share()}
        if self.predicted or self.cancelled:
            out["prefetch"] = {"predicted": self.predicted, "predicted_used": self.predicted_used,
                               "precision": self.predicted_used / self.predicted if self.predicted else None,
                               "cancelled": self.cancelled,
                               "bytes": self.prefetched_bytes, "read_s": self.prefetch_s, "waited_s": self.wait_s}
        return out

    def hidden_share(self):
        """Of all expert reading (the layers' own and the look-ahead's), the share no layer waited
        for: compute ran meanwhile. None when nothing was read."""
        return hidden_share(self.io_s, self.read_s, self.wait_s, self.prefetch_s)


class ExpertStore:
    """A model's experts: `experts(layer, inds)` -> ExpertRows (or a list of parts)."""

    def __init__(self, folder, manifest, slots, dtype, reader, policy="edgemoe", verify=True, prefetch=True,
                 overlap=None):
        """prefetch: the look-ahead reads the next layer's guessed experts during this one; overlap
        (None: as prefetch): one position's missing experts read while its cached ones compute."""
        exp = manifest.experts
        self.layout = lay = exp["layout"]
        self.folder = folder
        self.layers = [i for i, e in enumerate(exp["files"]) if e is not None]
        self.n_layers = n_layers = len(exp["files"])
        total = len(self.layers) * lay.n_experts
        self.slots = slots  # (at most `total`: runtime/moe.py sizes it)
        self.dtype = dtype
        self.reader = reader
        self.cache = ExpertCache(slots, lay.n_experts, n_layers, policy)
        self.stats = ExpertStats(n_layers)
        # layer -> [_GroupFile]: one file, or one per bit width (--expert-bits)
        self.groups = {i: [_GroupFile(g, reader.open(folder / g.entry["file"], expected_size=g.entry["size"]),
                                      read_checksums(folder, g.entry, g.layout, verify), lay.n_experts)
                           for g in layer_groups(exp, i)] for i in self.layers}
        self.weights, segments = self._slabs()
        self.segments = tuple(segments)
        self.segment_names = tuple((kind, name) for kind in KINDS for name, _, _ in lay.arrays(kind))
        q = lay.quant
        self.bits, self.group_size = (q.bits, q.group_size) if q is not None else (None, None)
        self.host = self._host_matrices()
        self.prefetch = prefetch and slots < total  # (dense: nothing to read ahead)
        self.overlap = (prefetch if overlap is None else overlap) and slots < total and self.host is not None
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="mlx_flash-experts")
                        if self.prefetch or self.overlap else None)
        self._pending = None  # (layer, ids being read, their slots, the slots' previous ids, future, stop Event)
        self._late = None  # (missing ids, future): this layer's own read in flight (overlap)
        self.busy = np.zeros(0, dtype=np.int64)  # the global ids the current layer computes on
        self._predicted = {}  # {layer: global ids the look-ahead read for it}

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

    def _host_matrices(self):
        """{kind: [QuantMatrix of slot i]} over the slabs' memory, for the native kernels (the CPU, a
        quantized layout, scales at float32), or None."""
        kernels = cpu_kernels()
        if kernels is None or self.bits is None or self.dtype != mx.float32:
            return None
        out = {}
        for kind in KINDS:
            w, s, b = (np.array(a, copy=False) for a in self.weights[kind])
            out[kind] = [QuantMatrix.of_host(kernels, w[i], s[i], b[i], self.bits, self.group_size)
                         for i in range(self.slots)]
        return out

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
        self.stats = ExpertStats(self.n_layers)

    def read_bytes(self, layer, missing):
        """Bytes on flash of experts (global ids) of `layer`."""
        local = missing - layer * self.layout.n_experts
        return sum(int((gf.position[local] >= 0).sum()) * gf.group.layout.bundle_bytes for gf in self.groups[layer])

    def _read(self, layer, missing, into):
        """Read experts (global ids) of `layer` into their slots; a failure leaves them out of the buffer."""
        try:
            self._read_into(layer, missing, into)
        except BaseException:
            self.cache.forget(missing)
            raise

    def _read_into(self, layer, missing, into):
        """_read without the cache's books (a failure raises, naming the layer and expert of a damaged
        part): the worker's read of a layer's own experts, which the main thread forgets on failure."""
        local = missing - layer * self.layout.n_experts
        for gf in self.groups[layer]:
            pos = gf.position[local]
            sel = pos >= 0
            if not sel.any():
                continue
            try:
                if gf.group.bits == self.bits:
                    self.reader.read_bundles(gf.file, pos[sel], gf.group.layout.stride, self.segments, into[sel],
                                             checks=gf.checks)
                else:  # narrower values: read, then widened into their slots
                    self._read_narrow(gf, pos[sel], into[sel])
            except ChecksumError as e:
                raise ModelFileError(f"layer {layer}, expert {gf.group.experts[e.bundle]} ({KINDS[e.part]}): {e}") \
                    from None

    def _read_narrow(self, gf, pos, slots):
        """Experts stored at fewer bits than the buffer's: their bundles into a staging buffer (a few at
        a time), then the packed values widened (exact: layout/quant.widen), scales and biases copied."""
        lay, bits = gf.group.layout, gf.group.bits
        per = max(1, NARROW_STAGING // lay.bundle_bytes)
        for start in range(0, pos.size, per):
            p, into = pos[start : start + per], slots[start : start + per]
            staging = []
            for (_, n, storage, view), (kind, name) in zip(self.segments, self.segment_names):
                if name == "weight":  # packed words, fewer than the buffer's
                    n = lay.array_bytes(kind, name) // 4
                staging.append((lay.array_offset(kind, name), n, storage, np.empty((p.size, n), dtype=view.dtype)))
            self.reader.read_bundles(gf.file, p, lay.stride, tuple(staging), np.arange(p.size), checks=gf.checks)
            for (_, _, _, buf), (_, _, _, view), (_, name) in zip(staging, self.segments, self.segment_names):
                if name == "weight":
                    view.view(np.uint32)[into] = widen(buf.view(np.uint32), bits, self.bits)
                else:
                    view[into] = buf

    def _drain(self):
        """End the reads in flight: the layer's own (waited for), then the look-ahead's (_drain_ahead),
        even when the first failed."""
        try:
            self._wait_late()
        finally:
            self._drain_ahead()

    def _drain_ahead(self):
        """End the look-ahead's read in flight: batches not begun are cancelled (their slots get back
        the experts they held, whose bytes are untouched), the one being read is waited for (its
        failure raises here, its experts and those after it out of the buffer)."""
        if self._pending is None:
            return
        layer, missing, into, previous, fut, stop = self._pending
        self._pending = None
        stop.set()
        t0 = time.perf_counter()
        (seconds, done, error), interrupted = _result(fut)
        self.stats.wait_s += time.perf_counter() - t0
        self.stats.prefetch_s += seconds
        if error is not None:  # the batch that failed and the ones after it never came
            self.cache.forget(missing[done:])
            raise error
        if done < missing.size:
            self.cache.give_back(missing[done:], into[done:], previous[done:])
            self.stats.cancelled += missing.size - done
        read = missing[:done]
        self._predicted[layer] = read
        self.stats.predicted += read.size
        self.stats.prefetched_bytes += self.read_bytes(layer, read)
        if interrupted is not None:
            raise interrupted

    def _read_ahead_batches(self, layer, missing, into, stop):
        """(the worker) The look-ahead's read, READ_AHEAD_BATCH experts at a time, most likely first,
        until `stop` -> (seconds, experts read, the error that ended it or None). The cache's books
        are the main thread's (_drain)."""
        t0, done = time.perf_counter(), 0
        try:
            while done < missing.size and not stop.is_set():
                end = min(missing.size, done + READ_AHEAD_BATCH)
                self._read_into(layer, missing[done:end], into[done:end])
                done = end
        except BaseException as e:
            return time.perf_counter() - t0, done, e
        return time.perf_counter() - t0, done, None

    def read_ahead(self, layer, inds):
        """The look-ahead's guess of `layer`'s experts (router indices, most likely first): read the
        ones not in the buffer in the background, into slots the current layer's experts (`busy`) do
        not hold, until that layer asks for its experts (the rest is then cancelled, not waited for).
        A wrong guess costs reads, never correctness."""
        if not self.prefetch or layer not in self.groups:
            return
        self._drain_ahead()  # (not the layer's own read: it runs on while this layer computes)
        guess = np.asarray(inds).astype(np.int64).reshape(-1)
        guess = guess[np.sort(np.unique(guess, return_index=True)[1])]  # unique, in the guess's order
        ids = self.cache.ids(layer, guess)
        ids = ids[self.cache.slot_of[ids] < 0][: max(0, self.slots - self.busy.size)]
        if not ids.size:
            return
        missing, into, previous = self.cache.reserve(ids, protect=self.busy)
        stop = threading.Event()
        self._pending = (layer, missing, into, previous,
                         self._worker.submit(self._read_ahead_batches, layer, missing, into, stop), stop)

    def _place(self, layer, experts):
        """Unique experts of `layer` given slots (the look-ahead's read ended first) -> (their
        slots, the missing global ids, the slots to read those into), counted."""
        self._drain()
        ids = self.cache.ids(layer, experts)
        guessed = self._predicted.pop(layer, None)
        if guessed is not None:
            self.stats.predicted_used += int(np.isin(guessed, ids).sum())
        slots, missing, into = self.cache.place(ids)
        try:
            self.stats.asked[layer] += ids.size
            self.stats.hits[layer] += ids.size - missing.size
            if missing.size:
                self.stats.bytes += self.read_bytes(layer, missing)
        except BaseException:  # (interrupted before the read: the slots hold nothing of these experts)
            self.cache.forget(missing)
            raise
        return slots, missing, into

    def _ensure(self, layer, experts):
        """Unique experts of `layer` into the buffer -> their slots."""
        slots, missing, into = self._place(layer, experts)
        if missing.size:
            t0 = time.perf_counter()
            self._read(layer, missing, into)
            dt = time.perf_counter() - t0
            self.stats.io_s += dt
            self.stats.read_s += dt
        return slots

    def _timed_read(self, layer, missing, into):
        """(the worker) -> (seconds the read took, the error that ended it or None): the cache's
        books are the main thread's (_wait_late)."""
        t0 = time.perf_counter()
        try:
            self._read_into(layer, missing, into)
        except BaseException as e:
            return time.perf_counter() - t0, e
        return time.perf_counter() - t0, None

    def _overlapped(self, layer, unique, inverse, shape):
        """One position's experts, the missing ones read on the worker meanwhile -> ExpertRows whose
        `late` names the choices still being read and how to wait for them."""
        slots, missing, into = self._place(layer, unique)
        if missing.size:
            try:
                fut = self._worker.submit(self._timed_read, layer, missing, into)
            except BaseException:  # (not submitted: the slots hold nothing of these experts)
                self.cache.forget(missing)
                raise
            self._late = (missing, fut)
        rows = self._rows(slots[inverse].reshape(shape))
        if missing.size:
            rows.late = (np.isin(slots[inverse], into).reshape(shape), self._wait_late)
        return rows

    def _wait_late(self):
        """Wait for the layer's own read in flight, if any, to its end (whatever this thread is
        interrupted by: the worker writes into the slots); a failed read forgets its experts and
        raises."""
        if self._late is None:
            return
        missing, fut = self._late
        self._late = None
        t0 = time.perf_counter()
        (seconds, error), interrupted = _result(fut)
        self.stats.io_s += time.perf_counter() - t0
        self.stats.read_s += seconds
        if error is not None:
            self.cache.forget(missing)
            raise error
        if interrupted is not None:
            raise interrupted

    def experts(self, layer, inds):
        chosen = np.array(inds).astype(np.int64)  # (waits for the router: see the module docstring)
        unique, inverse = np.unique(chosen, return_inverse=True)
        if self.stats.trace is not None:
            self.stats.trace.append((layer, unique))
        self.busy = self.cache.ids(layer, unique)
        if unique.size <= self.slots and self.overlap and chosen.size == chosen.shape[-1]:  # one position
            return self._overlapped(layer, unique, inverse, chosen.shape)
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
        host = (slots, self.host) if self.host is not None and mask is None else None
        return ExpertRows(mx.array(slots.astype(np.int32)), self.weights, self.bits, self.group_size, mask, host)

    def close(self):
        try:
            self._drain()
        except Exception:  # (closing: a failed read ahead has nobody left to tell)
            pass
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        for groups in self.groups.values():
            for gf in groups:
                self.reader.close_file(gf.file)
        self.groups = {}


def _result(fut):
    """A worker's future waited for to its end, whatever interrupts this thread meanwhile (the
    worker writes into the slots until it returns) -> (its result, the interruption or None).
    The worker's reads return their errors; one it raises is a bug, raised here."""
    interrupted = None
    while not fut.done():
        try:
            futures_wait([fut])
        except BaseException as e:  # this thread's (a signal handler's, Ctrl-C): after the wait
            interrupted = interrupted or e
    return fut.result(), interrupted


class _GroupFile:
    """An open file of one layer's experts at one width (layout/experts.ExpertGroup): its checksums
    as the reader checks them, and each expert's bundle in it (-1: in another file of the layer)."""

    def __init__(self, group, file, crc, n_experts):
        self.group, self.file = group, file
        self.checks = (crc, tuple((o, n, j) for j, (o, n) in enumerate(group.layout.parts())))
        self.position = np.full(n_experts, -1, dtype=np.int64)
        self.position[group.experts] = np.arange(group.experts.size)

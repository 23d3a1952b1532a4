"""The DIP store: Dynamic Input Pruning on flash (DIP, Federici et al. §4–5), with cache-aware masking (DIP-CA).

Per layer and token:
    s_in  = |x|                      (DIP-CA: |x| (c + γ (1 - c)) / max|x|, c = cached input dims)
    dims  = topK(s_in, k_in)         -> gate/up columns of those input dims: in-cache, read if missing
    h~    = act(x_dims G_dims) * (x_dims U_dims)        (every neuron, from the pruned input)
    s_out = |h~|                     (DIP-CA: re-weighted by the down cache's presence mask)
    ids   = topK(s_out, k_out)       -> down rows of those neurons: down-cache, read if missing
    y     = h~[ids] D[ids]
With calibrated thresholds (the `calibrated` sources), topK(s, k) becomes s >= t[layer]
per side (at least one entry); with DIP-CA, each token keeps as many entries as the
threshold gives it, chosen by the re-weighted scores.
Both caches are full-size-less: when full, an eviction policy (LRU / LFU /
Belady) picks the victims among ids the token does not need. k_in and k_out
are the same fraction (`density`) of d_model and of n_ff, so `density` is the
fraction of FFN weights a token uses.

The store computes h~ itself (it needs it to choose the neurons) and hands the
FFN the selected activations with the down rows; prompt chunks use per-token
masks over the union of their selections.
"""

import time

import numpy as np

import mlx.core as mx

from ...cache import NeuronCache
from ...cache.eviction import POLICIES
from ...errors import FlashError
from ...models.ffn import FFNRows
from ...sparsity import top_k_mask
from ..config import DEFAULTS
from ..stats import TokenStats
from .base import Store, cpu_kernels, read_into


BLOCK = 128  # a prompt chunk's packed rows dequantized at a time (gate and up: 2 x 128 x d_ff floats)


class _Side:
    """One cache (input columns or down rows) of one layer, with its policy and file."""

    def __init__(self, reader, entry_path, size, layout, capacity, policy, dtype, tables=None, crc=None,
                 where="", packed=None, staged=False):
        self.file = reader.open(entry_path, expected_size=size)
        self.layout = layout
        self.tables, self.crc, self.where = tables, crc, where
        self._reads = {}  # read_into's memo
        self.cache = NeuronCache(capacity, layout.n_neurons, layout.d_model, layout.kinds, dtype, packed=packed,
                                 staged=staged)
        self.policy = policy

    def ensure(self, reader, need, step, scratch):
        """Bring every id of `need` into the cache, or, past its capacity, into `scratch`.

        Returns (hits, t_mem, t_io, streamed?) — streamed ids are read again next time.
        """
        t0 = time.perf_counter()
        c = self.cache
        present = c.contains(need)
        missing = need[~present]
        n_keep = min(missing.size, c.capacity - int(present.sum()))
        keep, stream = missing[:n_keep], missing[n_keep:]
        over = c.num_used + keep.size - c.capacity
        gone = self.policy.victims(c.cached_ids(), over, need, step) if over > 0 else keep[:0]
        rows = c.replace(gone, keep)  # the new entries take the victims' rows
        self.policy.touch(need, step)
        scratch.delete(scratch.cached_ids())
        srows = scratch.append(stream)
        t1 = time.perf_counter()
        self._read(reader, keep, c, rows)
        self._read(reader, stream, scratch, srows)
        return int(present.sum()), t1 - t0, time.perf_counter() - t1, stream.size > 0

    def _read(self, reader, ids, cache, rows):
        read_into(reader, self.file, self.layout, ids, cache, rows, tables=self.tables, crc=self.crc,
                  where=self.where, memo=self._reads)


class DIPStore(Store):
    FIT_ERROR = "{n} rows in layer {layer}'s DIP cache of {limit}"

    def __init__(self, folder, manifest, plan, reader, act, density, cache_aware=False,
                 gamma=DEFAULTS.gamma, eviction=DEFAULTS.eviction, traces=None, dtype=mx.float32,
                 record_trace=False, tables=None, crcs=None, thresholds=None, packed=False, adapters=None,
                 score_norms=None,
                 staged=False):
        if not manifest.dip:
            raise FlashError(
                f"{folder}: no DIP orientation on flash; convert again with `mlx_flash.convert --dip`"
            )
        if eviction not in POLICIES:
            raise FlashError(f"unknown eviction policy '{eviction}' (choose from {', '.join(POLICIES)})")
        self.reader, self.act, self.plan = reader, act, plan
        self.density, self.cache_aware, self.gamma = density, cache_aware, gamma
        self.thresholds = thresholds  # per layer (t_in, t_out), or None: top-k at density
        self.score_norms = score_norms  # per layer (input dims', neurons') weight norms: the wina score
        self.adapters = adapters  # per layer (A^T, B^T): a resident part B (A x) (sparsity/recovery.py)
        inp, down = manifest.dip["input"], manifest.dip["down"]
        self.d_model, self.n_ff = inp["layout"].n_neurons, inp["layout"].d_model
        self.k_in = max(1, int(round(density * self.d_model)))
        self.k_out = max(1, int(round(density * self.n_ff)))
        cap_in, cap_down = plan.dip_capacity

        def policy(n, layer, side):
            if eviction == "belady":
                if traces is None:
                    raise FlashError("--eviction belady needs the access trace of an earlier run")
                return POLICIES["belady"](n, traces[layer][side])
            return POLICIES[eviction](n)

        # packed: both sides' rows at their bits in the caches, as read (the CPU's kernels
        # compute on them: qaxpy_cols, both DIP files being column kinds with scale tables)
        self.staged = staged  # caches written through host staging: the one-token kernels cannot read them
        self.kernels = cpu_kernels() if dtype == mx.float32 and not staged else None
        if packed and (self.kernels is None or inp["layout"].quant is None
                       or set(inp["layout"].columns) != set(inp["layout"].kinds) or down["layout"].quant is None):
            raise FlashError("packed DIP rows need a quantized model converted with --dip, float32 compute "
                             "and the native kernels on the CPU")
        self.packed_in = {k: inp["layout"].kind_bytes(k) for k in inp["layout"].kinds} if packed else None
        self.packed_down = {"down": down["layout"].kind_bytes("down")} if packed else None
        self.sides = []
        tables = tables or [None] * len(inp["files"])  # per layer: the input and down columns' scales
        crcs = crcs or [(None, None)] * len(inp["files"])  # per layer: (input, down) checksums
        for layer, (fi, fd) in enumerate(zip(inp["files"], down["files"])):
            self.sides.append((
                _Side(reader, folder / fi["file"], fi["size"], inp["layout"], cap_in,
                      policy(self.d_model, layer, "in"), dtype, tables[layer], crcs[layer][0],
                      f"layer {layer} (DIP input columns)", self.packed_in, staged),
                _Side(reader, folder / fd["file"], fd["size"], down["layout"], cap_down,
                      policy(self.n_ff, layer, "down"), dtype, tables[layer], crcs[layer][1],
                      f"layer {layer} (DIP down rows)", self.packed_down, staged),
            ))
        sc_in, sc_down = plan.dip_scratch
        self.scratch_in = NeuronCache(max(sc_in, 1), self.d_model, self.n_ff, inp["layout"].kinds, dtype,
                                      packed=self.packed_in, staged=staged)
        self.scratch_down = NeuronCache(max(sc_down, 1), self.n_ff, self.d_model, ("down",), dtype,
                                        packed=self.packed_down, staged=staged)
        self.stats = TokenStats()
        self._blocks = {}  # (kind, width) -> a prompt's dequantization buffer (_block)
        self.step = 0
        # every token's needed ids, for replaying Belady on them; off by default: it grows
        # by ~8 KB per layer and token (32 MB over 128 tokens of SmolLM2)
        self.trace = [{"in": [], "down": []} for _ in self.sides] if record_trace else None

    @property
    def weights_bytes(self):
        caches = sum(s.cache.weights_bytes for pair in self.sides for s in pair)
        return caches + self.scratch_in.weights_bytes + self.scratch_down.weights_bytes

    def _select(self, values, cache, layer, side, k):
        """Each token's entries (bool [tokens, n]): its top-k |values|, or, calibrated, those
        at or over the layer's threshold (at least its best one). DIP-CA (Eq. 10): the same
        number per token, chosen on scores whose uncached entries are scaled by γ."""
        s = np.abs(values)
        if self.score_norms is not None:
            s = s * self.score_norms[layer][side]
        if self.thresholds is not None:
            keep = s >= self.thresholds[layer][side]
            if not self.cache_aware:  # (and each token's best entry: argmax, not a top-k's int64 temporaries)
                keep[np.arange(s.shape[0]), s.argmax(axis=-1)] = True
                return keep
            k = np.maximum(keep.sum(axis=-1), 1)
        elif not self.cache_aware:
            return top_k_mask(s, k)
        c = (cache.id_to_row >= 0).astype(s.dtype)
        s = s * (c + self.gamma * (1 - c))
        if np.ndim(k) == 0:
            return top_k_mask(s, k)
        kth = -np.sort(-s, axis=-1)[np.arange(s.shape[0]), k - 1]  # each token's k-th score
        return s >= kth[:, None]

    def _matrices(self, cache, side, need):
        """A prompt chunk's rows of a cache: yields (float32 MLX matrices {kind: [rows, K]}, their
        ids (NumPy), the same ids as an MLX array). Packed rows: those of `need` (sorted ids) the
        cache holds, dequantized in C BLOCK ids at a time (a block's matrices are freed before the
        next is made: a prompt's temporaries stay a few MB where a whole layer's float32 rows
        would be hundreds); unpacked: the whole cache, once, as it is held."""
        if not cache.packed:
            mats, ids = cache.rows()
            yield mats, cache.cached_ids(), ids
            return
        from ...kernels import dequantize_cols

        held = need[cache.id_to_row[need] >= 0]
        spec = side.layout.quant
        for start in range(0, held.size, BLOCK):
            ids = held[start:start + BLOCK]
            rows, trow = cache.id_to_row[ids], ids // spec.group_size
            yield ({k: mx.array(dequantize_cols(self.kernels, cache.views[k].view(np.uint8), rows, trow,
                                                side.tables[k], spec, out=self._block(k, ids.size, side)))
                    for k in side.layout.kinds}, ids, mx.array(ids))

    def _block(self, kind, n, side):
        """A reused float32 buffer [n, d] for a block of `kind`'s dequantized rows (MLX copies it:
        no new NumPy pages a block, which the C heap would keep after the prompt)."""
        width = side.layout.d_model
        buf = self._blocks.get((kind, width))
        if buf is None:
            buf = self._blocks[(kind, width)] = np.empty((BLOCK, width), np.float32)
        return buf[:n]

    def _axpy(self, side, scratch, streamed, weights, ids, kinds):
        """One token on the CPU: per kind, sum over `ids` of weights[i] * the row of id i, from
        the side's cache and (streamed: it holds exactly this call's streamed ids) the scratch,
        read in place by the kernels (gather_axpy; qaxpy_cols on packed rows)."""
        from ...kernels import gather_axpy, qaxpy_cols

        out = [np.zeros(side.layout.d_model, np.float32) for _ in kinds]
        for cache in (side.cache, scratch) if streamed else (side.cache,):
            rows = cache.id_to_row[ids]
            here = rows >= 0
            if not here.any():
                continue
            w, rows = np.ascontiguousarray(weights[here], dtype=np.float32), np.ascontiguousarray(rows[here])
            if cache.packed:
                spec = side.layout.quant
                trow = ids[here] // spec.group_size  # ids ascending: trow ascending, as the kernel wants
            for y, k in zip(out, kinds):
                y += (qaxpy_cols(self.kernels, w, cache.views[k].view(np.uint8), rows, trow, side.tables[k], spec)
                      if cache.packed else gather_axpy(self.kernels, w, cache.views[k], rows))
        return out

    def rows(self, layer, x):
        """The FFN parts of `layer` for x. One token on the CPU (kernels): g, u and y summed over
        the chosen rows alone, not over every cached row masked; the part returned is then the
        finished output (FFNRows.y)."""
        if layer == 0:
            self.step += 1
        st = self._begin(layer, x)
        bytes0, reads0 = self._counts()
        t1 = time.perf_counter()
        side_in, side_down = self.sides[layer]
        x2 = x.reshape(-1, x.shape[-1])
        x_np = np.array(x2, dtype=np.float32)
        mask_in = self._select(x_np, side_in.cache, layer, 0, self.k_in)
        need_in = np.flatnonzero(mask_in.any(axis=0)).astype(np.int64)
        self._check_fits(need_in.size, side_in.cache.capacity + self.scratch_in.capacity, x2, layer)
        t2 = time.perf_counter()
        hits_in, m_in, io_in, streamed = side_in.ensure(self.reader, need_in, self.step, self.scratch_in)
        if self.trace is not None:
            self.trace[layer]["in"].append(need_in)

        one = self.kernels is not None and x2.shape[0] == 1
        if one:
            g, u = self._axpy(side_in, self.scratch_in, streamed, x_np[0, need_in], need_in, ("gate", "up"))
            h = self.act(mx.array(g)[None]) * mx.array(u)[None]
        else:
            g = u = None
            for cache in [side_in.cache] + ([self.scratch_in] if streamed else []):
                for mats, ids, dims in self._matrices(cache, side_in, need_in):
                    m_rows = mx.array(mask_in[:, ids])
                    xs = x2[:, dims] * m_rows.astype(x2.dtype)
                    g = xs @ mats["gate"] if g is None else g + xs @ mats["gate"]
                    u = xs @ mats["up"] if u is None else u + xs @ mats["up"]
                    mx.eval(g, u)  # (the block's matrices go before the next block's are made)
            h = self.act(g) * u
        h_np = np.array(h.astype(mx.float32))  # evaluates h~: compute
        t3 = time.perf_counter()
        mask_out = self._select(h_np, side_down.cache, layer, 1, self.k_out)
        need_out = np.flatnonzero(mask_out.any(axis=0)).astype(np.int64)
        self._check_fits(need_out.size, side_down.cache.capacity + self.scratch_down.capacity, x2, layer)
        t4 = time.perf_counter()
        hits_out, m_out, io_out, streamed = side_down.ensure(self.reader, need_out, self.step,
                                                             self.scratch_down)
        if self.trace is not None:
            self.trace[layer]["down"].append(need_out)
        if one:
            y, = self._axpy(side_down, self.scratch_down, streamed, h_np[0, need_out], need_out, ("down",))
            parts = [FFNRows(up=None, down=None, y=mx.array(y).reshape(*x.shape[:-1], -1).astype(x.dtype))]
        else:
            y = None
            for cache in [side_down.cache] + ([self.scratch_down] if streamed else []):
                for dmats, ids, ids_mx in self._matrices(cache, side_down, need_out):
                    m_rows = mx.array(mask_out[:, ids])
                    part = (h[:, ids_mx] * m_rows.astype(h.dtype)) @ dmats["down"]
                    y = part if y is None else y + part
                    mx.eval(y)
            parts = [FFNRows(up=None, down=None, y=y.reshape(*x.shape[:-1], -1).astype(x.dtype))]

        if self.adapters is not None:  # resident: y += B (A x)
            a_t, b_t = self.adapters[layer]
            parts.append(FFNRows(up=None, down=b_t, h=x @ a_t))
        bytes1, reads1 = self._counts()
        # choosing inputs and neurons is the prediction
        share = (2 * need_in.size / self.d_model + need_out.size / self.n_ff) / 3 / len(self.sides)
        self.stats.add((t2 - t1) + (t4 - t3), m_in + m_out, io_in + io_out, bytes1 - bytes0,
                       reads1 - reads0, int(need_in.size + need_out.size), hits_in + hits_out, share)
        st["windows"].append(0)
        return parts

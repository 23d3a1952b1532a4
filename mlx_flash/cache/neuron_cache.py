"""The per-layer neuron cache of paper §3.3 (Figure 6): preallocated, no reallocation per token.

One matrix per weight kind (gate, up, down), `capacity` rows each, whose rows
move together: row r of every matrix holds the weights of neuron
`row_to_id[r]`. Rows `[:num_used]` are the cached neurons, in no particular
order (the FFN's result does not depend on it). Deleting neurons moves the
last used rows into the holes; inserting appends after `num_used`; replacing
(a token's window: some neurons leave, others arrive) puts the new neurons in
the rows of the old ones and moves nothing, deleting or appending only the
difference (on OPT-6.7B at 4-bit the moves were 56 of 742 ms per token). The
paper keeps one [up | down] matrix; in MLX a column slice of such a matrix is
copied slowly (a float32 product on 4,000 rows of 4,096: 91 ms on a column slice
of [up | down], 2.8 ms on a row slice), so each kind has its own matrix and the
FFN sees contiguous row slices.

Two ways new rows enter (runtime/config.py `cache_writes` chooses, per backend):
- host (the CPU): the matrices are MLX arrays written in place through NumPy
  views of their buffers. That is only safe once MLX has finished every
  computation that reads them: the sparse FFN evaluates its input before it asks
  the cache for rows, which forces the previous token's use of these rows to
  complete.
- staged (a GPU): the host never writes memory the device computes on. `views`
  are a host staging copy the reader writes into; the rows it filled enter the
  device matrices in one scatter per kind (`commit`, when the rows are next
  handed out), and deletion's moves are a gather / scatter on the device. The
  staging rows cost host memory as large as the cache (counted in weights_bytes).
"""

import numpy as np

import mlx.core as mx

from ..io.native import move_rows


class NeuronCache:
    """arena: hold the rows at float16 and hand them out converted to float32 through
    this Arena (models/half.py), which must hold capacity * len(kinds) * d_model values.
    packed: {kind: bytes}: hold each kind's part of a quantized bundle as it is on flash
    (packed values, inline scales), that many bytes a row (a multiple of 4; the matrices
    are float32 containers of raw bytes, never computed on by MLX: the native kernels
    read them, models/ffn.py)."""

    def __init__(self, capacity, n_neurons, d_model, kinds, dtype=mx.float32, arena=None, packed=None,
                 staged=False):
        self.capacity = capacity
        self.n_neurons = n_neurons
        self.kinds = tuple(kinds)
        self.arena = arena
        self.packed = packed
        if arena is not None:
            assert arena.values >= capacity * len(self.kinds) * d_model, "arena too small for the cache"
            dtype = mx.float16
        widths = {k: packed[k] // 4 for k in kinds} if packed else dict.fromkeys(kinds, d_model)
        self.staged = staged
        if staged and (arena is not None or packed):
            raise ValueError("staged caches hold rows at the compute dtype (no float16 arena, no packed rows)")
        self.matrices = {k: mx.zeros((capacity, widths[k]), dtype=mx.float32 if packed else dtype) for k in kinds}
        mx.eval(list(self.matrices.values()))
        if staged:  # the reader writes host rows; commit() scatters them into the matrices
            np_dtype = {mx.float32: np.float32, mx.float16: np.float16}.get(dtype)
            if np_dtype is None:
                raise ValueError(f"staged caches of {dtype}: NumPy has no such dtype")
            self.views = {k: np.zeros((capacity, widths[k]), dtype=np_dtype) for k in kinds}
            self._pending = np.zeros(capacity, dtype=bool)  # rows filled on the host, not yet on the device
        else:
            # Writable views of the MLX buffers: the reader and delete() write here.
            self.views = {k: np.array(m, copy=False) for k, m in self.matrices.items()}
            for k, v in self.views.items():
                assert v.flags.writeable and v.ctypes.data == np.array(self.matrices[k], copy=False).ctypes.data
        self.row_to_id = np.full(capacity, -1, dtype=np.int64)  # the paper's "pointer"
        self.id_to_row = np.full(n_neurons, -1, dtype=np.int64)  # inverse map
        self.num_used = 0
        self._ids = None  # MLX copy of row_to_id[:num_used], rebuilt when it changes

    @property
    def weights_bytes(self):
        staging = sum(v.nbytes for v in self.views.values()) if self.staged else 0
        return sum(m.nbytes for m in self.matrices.values()) + staging

    @property
    def host_readable(self):
        """May the host (the native kernels) read the rows in `views`? Not when staged."""
        return not self.staged

    def commit(self, upto=None):
        """Staged: the rows the reader filled since the last commit (those below `upto`, when
        given: rows above it may still be being read) enter the device matrices, one
        scatter per kind. Nothing to do for a host cache."""
        if not self.staged:
            return
        pending = self._pending if upto is None else self._pending[:upto]
        rows = np.flatnonzero(pending)
        if rows.size == 0:
            return
        idx = mx.array(rows)
        for k, m in self.matrices.items():
            m[idx] = mx.array(self.views[k][rows])
        pending[rows] = False

    def contains(self, ids):
        return self.id_to_row[ids] >= 0

    def cached_ids(self):
        return self.row_to_id[: self.num_used]

    def delete(self, ids):
        """Drop neurons `ids` (all cached): the last used rows move into the holes."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return 0
        rows = self.id_to_row[ids]
        assert (rows >= 0).all(), "deleting neurons that are not cached"
        n_after = self.num_used - ids.size
        gone = np.zeros(self.num_used, dtype=bool)
        gone[rows] = True
        holes = np.flatnonzero(gone[:n_after])  # deleted rows that stay inside [:n_after]
        movers = n_after + np.flatnonzero(~gone[n_after:])  # kept rows beyond it
        if holes.size and self.staged:  # on the device: the movers' committed rows
            self._pending[rows] = False  # a deleted row's staged values are dropped
            moving = self._pending[movers]
            for v in self.views.values():  # rows still staged move with their ids
                v[holes[moving]] = v[movers[moving]]
            self._pending[holes] = False
            self._pending[holes[moving]] = True
            self._pending[movers] = False
            settled = ~moving
            if settled.any():
                src, dst = mx.array(movers[settled]), mx.array(holes[settled])
                for m in self.matrices.values():
                    m[dst] = m[src]
        elif holes.size:
            for v in self.views.values():
                move_rows(v, holes, movers)
        if holes.size:
            moved_ids = self.row_to_id[movers]
            self.row_to_id[holes] = moved_ids
            self.id_to_row[moved_ids] = holes
        self.id_to_row[ids] = -1
        self.row_to_id[n_after : self.num_used] = -1
        if self.staged:
            self._pending[n_after : self.num_used] = False
        self.num_used = n_after
        self._ids = None
        return int(holes.size)

    def append(self, ids):
        """Reserve rows for new neurons `ids` (none cached); returns their row indices.

        The caller fills those rows of `views` (the reader writes there) before
        the next computation on the cache.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if self.num_used + ids.size > self.capacity:
            raise ValueError(f"cache full: {self.num_used} + {ids.size} > {self.capacity}")
        assert not self.contains(ids).any(), "appending neurons that are already cached"
        rows = np.arange(self.num_used, self.num_used + ids.size, dtype=np.int64)
        if self.staged:
            self._pending[rows] = True
        self.row_to_id[rows] = ids
        self.id_to_row[ids] = rows
        self.num_used += ids.size
        self._ids = None
        return rows

    def replace(self, gone, ids):
        """Drop neurons `gone` (all cached) and reserve rows for `ids` (none cached, distinct
        from `gone`): the new neurons take the rows of the old ones, nothing moves unless
        their counts differ. Returns the rows of `ids`, to fill as after append()."""
        gone = np.asarray(gone, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        if self.num_used - gone.size + ids.size > self.capacity:
            raise ValueError(f"cache full: {self.num_used} - {gone.size} + {ids.size} > {self.capacity}")
        assert not self.contains(ids).any(), "replacing with neurons that are already cached"
        assert (self.id_to_row[gone] >= 0).all(), "replacing neurons that are not cached"
        n = min(gone.size, ids.size)
        gone = gone[np.argsort(self.id_to_row[gone], kind="stable")]
        self.delete(gone[n:])  # the surplus first (the highest rows: the fewest moves)
        rows = self.id_to_row[gone[:n]]  # where delete() left the rest
        if self.staged:
            self._pending[rows] = True
        self.id_to_row[gone[:n]] = -1
        self.row_to_id[rows] = ids[:n]
        self.id_to_row[ids[:n]] = rows
        self._ids = None
        return np.concatenate([rows, self.append(ids[n:])])

    def rows(self, converted=None, upto=None):
        """The cached rows as contiguous MLX row slices, and their neuron ids.

        converted: (arena, layout) where a worker already put this cache's float16
        rows (Arena.put), to hand out instead of converting them here. upto (staged): commit
        only the rows below it (the rest may still be being read)."""
        self.commit(upto)
        n = self.num_used
        if self._ids is None:
            self._ids = mx.array(self.row_to_id[:n])
        if converted is not None:
            return converted[0].views(converted[1]), self._ids
        if self.arena is not None:  # float16 rows, converted for this use (see models/half.py)
            return self.arena.fill_rows({k: v[:n] for k, v in self.views.items()}), self._ids
        return {k: m[:n] for k, m in self.matrices.items()}, self._ids

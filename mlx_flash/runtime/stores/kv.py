"""The KV cache on flash: every layer's keys and values written to a file as they are made
and read back, in chunks, by each token's attention.

A long context's KV cache can outgrow the memory limit (a 7B model's float32 keys and
values take 1 MB a token: 2 GB at 2048 tokens). Kept in DRAM it would leave the weights
nothing; on flash, DRAM holds two chunk buffers and a few positions per layer, and each
token reads its layers' keys and values back (FlexGen §4 places the KV cache on disk the
same way). Byte for byte a KV read costs what a weight read does, so the planner moves the
cache here only when the limit requires it (runtime/memory.py).

Layout: one unlinked file in the mlx_flash home (the disk the models are on, never a
tmpfs), a region per layer, position p of layer l at `l * region + p * row`, a row being
the position's keys then values for every KV head at the compute dtype. Positions are
written by whole blocks (the fewest positions whose bytes are a multiple of 4096), uncached
(O_DIRECT / F_NOCACHE), from an aligned staging buffer; the positions of a partial block
stay in DRAM (the tail) until the block fills. Each block's CRC32C is taken when it is
written and checked by the reader when it is read back.

Reads go through a FlashReader into one of two buffers of `chunk_bytes`; while a chunk is
being attended to, the next one (of this layer, or the next layer's first) is read. The
store knows layers, positions and bytes; models/attention.py does the arithmetic.
"""

import errno
import math
import os
import sys
import time

import mlx.core as mx
import numpy as np

from ...errors import FlashError, ModelFileError
from ...io.files import ChecksumError, log_once
from .base import Store, take_pending

CHUNK_BYTES = 4 << 20  # one read of a layer's keys and values (two buffers, plus one copy in MLX)
STAGE_BYTES = 1 << 20  # the aligned staging of uncached writes (whole blocks)
ALIGN = 4096
# the NumPy dtype holding each compute dtype's bytes (bfloat16's: as float16 bit patterns, which
# the reader copies as they are), and the reader's name for it
_NP = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.float16}
_SRC = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "float16"}


def block_positions(row_bytes):
    """Positions in one written block: the fewest whose bytes are a multiple of ALIGN."""
    return ALIGN // math.gcd(row_bytes, ALIGN)


def flash_kv_dram(n_layers, row_bytes, chunk_bytes=CHUNK_BYTES):
    """Bytes of DRAM the KV cache on flash holds: two read buffers and MLX's copy of a chunk,
    each layer's tail (a partial block) and the staging of uncached writes. (A prompt chunk's new
    positions are written from its own keys and values: activations.)"""
    block = block_positions(row_bytes) * row_bytes
    chunk = _chunk_blocks(row_bytes, chunk_bytes) * block
    return 3 * chunk + n_layers * block + max(block, STAGE_BYTES // block * block)


def _chunk_blocks(row_bytes, chunk_bytes):
    return max(1, chunk_bytes // (block_positions(row_bytes) * row_bytes))


def chunk_positions(row_bytes, chunk_bytes=CHUNK_BYTES):
    """Positions one read brings back (the width of a chunk's attention scores)."""
    return _chunk_blocks(row_bytes, chunk_bytes) * block_positions(row_bytes)


class FlashKV(Store):
    """Every layer's keys and values for `context` positions of one sequence, on flash.
    `layer_cache(l)` is what a model's attention is handed (FlashKVCache)."""

    def __init__(self, directory, n_layers, n_kv_heads, k_dim, v_dim, context, dtype, reader,
                 chunk_bytes=CHUNK_BYTES, verify=True, stats=None, prefetch=True):
        if dtype not in _NP:
            raise FlashError(f"the KV cache on flash holds float32, float16 or bfloat16, not {dtype}")
        self.n_layers, self.heads, self.k_dim, self.v_dim = n_layers, n_kv_heads, k_dim, v_dim
        self.context, self.dtype, self.np_dtype = context, dtype, _NP[dtype]
        self.width = n_kv_heads * (k_dim + v_dim)  # values in one position's row
        self.row = self.width * np.dtype(self.np_dtype).itemsize
        self.block = block_positions(self.row)
        self.block_bytes = self.block * self.row
        self.blocks = -(-context // self.block)  # per layer
        self.region = self.blocks * self.block_bytes
        self.chunk_blocks = min(_chunk_blocks(self.row, chunk_bytes), self.blocks)
        self.reader, self.stats, self.prefetch = reader, stats, prefetch
        self.path, self._wfd, direct = _create(directory, n_layers * self.region)
        try:
            self.file = reader.open(self.path)
        finally:
            os.unlink(self.path)  # (gone with the process; the descriptors keep it until then)
        if not direct or not self.file.direct:
            log_once(("kv-cached", str(directory)), "mlx_flash: %s refuses uncached I/O: the KV cache on "
                     "flash goes through the page cache (which a memory limit counts)", directory)
        self.tails = np.zeros((n_layers, self.block, self.width), dtype=self.np_dtype)
        self.flushed = [0] * n_layers  # positions on flash (whole blocks)
        self.length = [0] * n_layers
        self.crc = np.zeros((n_layers, self.blocks, 1), dtype=np.uint32) if verify else None
        self._parts = ((0, self.block_bytes, 0),)
        self.buffers = [np.zeros((self.chunk_blocks, self.block * self.width), dtype=self.np_dtype)
                        for _ in range(2 if prefetch else 1)]
        self._stage = _aligned(min(self.blocks, max(1, STAGE_BYTES // self.block_bytes)) * self.block_bytes)
        self._pending = None  # ((layer, first block, blocks), buffer, future)
        self._j = 0
        self._decode = [0, 0, 0]  # one-position passes over a layer: count, bytes read back, reads

    @property
    def weights_bytes(self):
        return sum(b.nbytes for b in self.buffers) + self.tails.nbytes + self._stage.nbytes

    @property
    def offset(self):
        return self.length[0]

    def decode_read(self):
        """(bytes, bytes per read) a decode token read back, on average so far ((0, 0): none)."""
        passes, nbytes, reads = self._decode
        if not passes or not reads:
            return 0, 0
        return int(nbytes * self.n_layers / passes), int(nbytes / reads)

    def layer_cache(self, layer):
        return FlashKVCache(self, layer)

    # ---- writing -------------------------------------------------------------------------

    def _rows(self, k, v):
        """(1, H, T, D) keys and values -> [T, width] rows in the file's order."""
        t = k.shape[2]
        kv = mx.concatenate([k[0].transpose(1, 0, 2).reshape(t, -1), v[0].transpose(1, 0, 2).reshape(t, -1)], axis=1)
        kv = kv.astype(self.dtype)
        return np.array(kv.view(mx.uint16)).view(self.np_dtype) if self.dtype == mx.bfloat16 else np.array(kv)

    def append(self, layer, rows):
        """Add [T, width] rows after the layer's positions: whole blocks to the file, the rest
        to the tail."""
        t = rows.shape[0]
        n, f = self.length[layer], self.flushed[layer]
        if n + t > self.context:
            raise FlashError(f"the KV cache on flash holds {self.context} positions (--ctx-size): position "
                             f"{n + t} does not fit")
        held = n - f
        full = (held + t) // self.block  # blocks to write
        if full:
            data = np.concatenate([self.tails[layer, :held], rows]) if held else rows
            self._write(layer, f // self.block, data[: full * self.block].reshape(full, -1))
            rest = data[full * self.block:]
            self.tails[layer, : len(rest)] = rest
            self.flushed[layer] = f + full * self.block
        else:
            self.tails[layer, held: held + t] = rows
        self.length[layer] = n + t

    def _write(self, layer, block, data):
        """Whole blocks [block, block + len(data)) of `layer`, through the aligned staging."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(len(data), self.block_bytes)
        if self.crc is not None:
            from ...io.checksum import parts_crc

            self.crc[layer, block: block + len(raw)] = parts_crc(raw, [(0, self.block_bytes)])
        at = layer * self.region + block * self.block_bytes
        per = self._stage.nbytes // self.block_bytes
        for i in range(0, len(raw), per):  # (the staging holds `per` blocks)
            part = raw[i: i + per].reshape(-1)
            self._stage[: part.nbytes] = part
            _pwrite_all(self._wfd, self._stage[: part.nbytes], at + i * self.block_bytes, self.path)

    # ---- reading -------------------------------------------------------------------------

    def _read(self, layer, first, count, j):
        """Blocks [first, first + count) of `layer` into buffer j, checked -> (bytes, reads)."""
        s = self.reader.stats
        b0, r0 = s.bytes_read, s.reads_issued
        ids = np.arange(first, first + count, dtype=np.int64)
        dst = self.buffers[j]
        checks = None if self.crc is None else (self.crc[layer], self._parts)
        try:
            self.reader.read_bundles(self.file, ids, self.block_bytes,
                                     ((0, self.block * self.width, _SRC[self.dtype], dst),),
                                     np.arange(count, dtype=np.int64), base=layer * self.region, checks=checks)
        except ChecksumError as e:
            raise ModelFileError(f"the KV cache on flash: layer {layer}'s keys and values at byte {e.offset} do not "
                                 "match the checksum taken when they were written, read twice: the disk returned "
                                 "other bytes than it was given") from None
        return s.bytes_read - b0, s.reads_issued - r0

    def _chunks_of(self, layer):
        """[(first block, blocks)] of the layer's positions on flash, in reading order."""
        n = self.flushed[layer] // self.block
        return [(a, min(self.chunk_blocks, n - a)) for a in range(0, n, self.chunk_blocks)]

    def _take(self, layer, first, count):
        """Buffer index holding blocks [first, first+count) of layer: the read in flight, or now."""
        t0 = time.perf_counter()
        taken = take_pending(self, (layer, first, count))
        if taken is None:
            j = self._j if len(self.buffers) == 1 else 1 - self._j
            taken = j, self._read(layer, first, count, j)
        j, got = taken
        self._j = j
        if self.stats is not None and self.stats.cur is not None:
            self.stats.add(io_s=time.perf_counter() - t0, bytes_read=got[0], reads=got[1])
        return j

    def _prefetch_after(self, layer, chunks, index):
        """Start the read after chunk `index` of `layer`'s `chunks`: its next chunk, else the
        first of the next layer with any positions on flash (the layers of one token in turn)."""
        if not self.prefetch or len(self.buffers) < 2:
            return
        if index + 1 < len(chunks):
            nxt = (layer, *chunks[index + 1])
        else:
            nxt = None
            for d in range(1, self.n_layers + 1):
                other = (layer + d) % self.n_layers
                c = self._chunks_of(other)
                if c:
                    nxt = (other, *c[0])
                    break
        if nxt is not None:
            self._pending = (nxt, 1 - self._j, self._submit(self._read, *nxt, 1 - self._j))

    def _as_kv(self, rows):
        """[T, width] rows (NumPy) -> keys (1, H, T, Dk), values (1, H, T, Dv) (MLX copies)."""
        t = rows.shape[0]
        a = mx.array(rows.view(np.uint16)).view(mx.bfloat16) if self.dtype == mx.bfloat16 else mx.array(rows)
        hk = self.heads * self.k_dim
        k = a[:, :hk].reshape(t, self.heads, self.k_dim).transpose(1, 0, 2)[None]
        v = a[:, hk:].reshape(t, self.heads, self.v_dim).transpose(1, 0, 2)[None]
        return k, v

    def parts(self, layer, k, v):
        """What `layer`'s attention attends to, with new keys and values k, v (1, H, T, D)
        appended: yields (keys, values, first position) chunk by chunk, every position up to
        the new ones, in order (the new ones last, in the same chunk as the tail)."""
        if k.shape[0] != 1:
            raise FlashError("the KV cache on flash holds one sequence: a batch keeps its KV cache in DRAM")
        f, n = self.flushed[layer], self.length[layer]
        chunks = self._chunks_of(layer)
        if k.shape[2] == 1:
            self._decode[0] += 1
            self._decode[1] += f * self.row
            self._decode[2] += len(chunks)
        kn, vn = k.astype(self.dtype), v.astype(self.dtype)
        if n > f:  # positions [f, n + T): the tail (copied out before append refills it), then the new ones
            kt, vt = self._as_kv(self.tails[layer, : n - f])
            kn, vn = mx.concatenate([kt, kn], axis=2), mx.concatenate([vt, vn], axis=2)
        self.append(layer, self._rows(k, v))  # (writes blocks past f: the reads below are of blocks before it)
        for i, (first, count) in enumerate(chunks):
            j = self._take(layer, first, count)
            rows = self.buffers[j][:count].reshape(count * self.block, self.width)
            kc, vc = self._as_kv(rows)  # (copies: the buffer may take the next read)
            self._prefetch_after(layer, chunks, i)
            yield kc, vc, first * self.block
        if not chunks:
            self._prefetch_after(layer, chunks, -1)
        yield kn, vn, f

    def close(self):
        super().close()
        if self._wfd >= 0:
            os.close(self._wfd)
            self._wfd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class FlashKVCache:
    """One layer's view of a FlashKV, in the shape of mlx_lm's caches where a model looks
    (`offset`; `parts` instead of update_and_fetch: models/attention.py)."""

    def __init__(self, kv, layer):
        self.kv, self.layer = kv, layer

    @property
    def offset(self):
        return self.kv.length[self.layer]

    def parts(self, k, v):
        return self.kv.parts(self.layer, k, v)

    def update_and_fetch(self, keys, values):
        raise FlashError("the KV cache on flash is read in chunks by models/attention.py's attend(); "
                         "this model's attention does not use it")

    def make_mask(self, n, **kwargs):
        return None  # (attend() masks by positions)

    def is_trimmable(self):
        return False

    def empty(self):
        return self.offset == 0

    @property
    def nbytes(self):
        return 0  # (on flash)

    @property
    def state(self):
        return ()  # (mlx_lm evaluates every cache's state after a prompt chunk: nothing here is lazy)

    @state.setter
    def state(self, v):
        raise FlashError("a KV cache on flash cannot be loaded from a prompt cache")


def _aligned(n):
    """A uint8 array of n bytes whose address is a multiple of ALIGN (O_DIRECT's buffers)."""
    raw = np.zeros(n + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off: off + n]


def _create(directory, size):
    """A new file of `size` bytes in `directory`, opened for uncached writes -> (path, fd,
    uncached?). (The caller unlinks it once its reader has it open.)"""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"kv-{os.getpid()}-{id(object()):x}.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    direct = False
    try:
        if sys.platform.startswith("linux"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fd = os.open(path, flags, 0o600)
        else:
            fd = os.open(path, flags, 0o600)
            if sys.platform == "darwin":
                import fcntl

                try:
                    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
                    direct = True
                except OSError:
                    pass
        os.ftruncate(fd, size)
    except OSError as e:
        raise FlashError(f"the KV cache on flash: cannot create {size / 1e6:.0f} MB in {directory} "
                         f"({e.strerror}); set MLX_FLASH_HOME to a folder on a disk with room") from None
    return path, fd, direct


def _pwrite_all(fd, buf, offset, path):
    view = memoryview(buf)
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise FlashError(f"the KV cache on flash: writing {path} at byte {offset + done} failed "
                             f"({e.strerror})") from None
        if n <= 0:
            raise FlashError(f"the KV cache on flash: writing {path} at byte {offset + done} wrote nothing")
        done += n

"""The output head read from flash: its rows stay in the resident file and each pass multiplies
by all of them, a chunk at a time, the next chunk read while the kernels multiply this one.

A small model with a large vocabulary holds its largest weight in the output head
(Qwen2.5-1.5B: 151,936 x 1,536 at 8 bits, 263 MB, a quarter of its resident file). Where even
every layer's attention on flash leaves the FFN too little of a memory limit, the runtime may
leave an untied, quantized head (the native kernels multiply it) in the resident file:
models/quantized.py's StreamedHead asks `products(v)`, which reads CHUNK_ROWS rows at a time
into one of two buffers and multiplies them with the same kernels as the held head (a decode
step: the same sums, to the bit). A token then reads the whole head: the DRAM it frees costs
its bytes in reads every token, as a streamed layer's attention does. The first chunk of the
next pass is read as soon as this pass's last one is in hand.

The store knows byte ranges and dtypes, not models (a TableSpan, as the streamed input
embedding's). Every read is checked: each row of each tensor has a CRC32C computed when the
store opens (from the resident file the loader checked against its sha256), verified by the
reader, read once more, then a clear error naming the row and the tensor.
"""

import time

import numpy as np

from ...errors import FlashError, ModelFileError
from ...io.files import ChecksumError
from .base import Store
from .embedding import _NP, row_checksums, table_span

CHUNK_ROWS = 2048  # rows of one buffer (8-bit, 1,536 values: 3.5 MB); two buffers


def output_head(st, quantization):
    """The TableSpan of an output head the store can stream (an untied, quantized "lm_head"
    without a bias), or None."""
    names = st.tensors
    if "lm_head.weight" not in names or "lm_head.bias" in names or not isinstance(
            (quantization or {}).get("lm_head"), dict):
        return None
    return table_span(st, quantization, "lm_head")


def head_dram_bytes(span, checked):
    """What the store holds instead of the head: two buffers of CHUNK_ROWS rows, and (checked) a
    CRC32C per row of each tensor."""
    return 2 * min(CHUNK_ROWS, span.n_rows) * span.row_bytes + (4 * span.n_rows * len(span.parts) if checked else 0)


class HeadStore(Store):
    """The output head's rows read from the resident file, chunk by chunk; `products(v)`. (A Store
    for its reader, worker and close(); the FFNs never ask it for rows.)"""

    def __init__(self, path, span, reader, kernels, verify=True, stats=None):
        from ...kernels import QuantMatrix

        if span.bits is None:
            raise FlashError(f"{path}: the output head is read from flash only where it is quantized")
        self._of_host = QuantMatrix.of_host
        self.path, self.span, self.reader, self.kernels = path, span, reader, kernels
        self.stats = stats  # the FFN store's TokenStats: the waits and bytes join its rows
        self.file = reader.open(path)
        last = max(off + span.n_rows * row for _, off, row, _ in span.parts)
        if last > self.file.size:
            raise ModelFileError(f"{path}: the output head ends beyond the end of the file ({last} > "
                                 f"{self.file.size} bytes)")
        self.per = min(CHUNK_ROWS, span.n_rows)
        self.starts = list(range(0, span.n_rows, self.per))
        # as float16: the reader copies a row's bytes as they are (same-dtype copy)
        self.buffers = [[np.zeros((self.per, row // 2), dtype=np.float16) for _, _, row, _ in span.parts]
                        for _ in range(2)]
        self.crcs = row_checksums(reader, self.file, span) if verify else None
        self._checks = [None] * len(span.parts) if self.crcs is None else [
            (c, ((0, row, 0),)) for c, (_, _, row, _) in zip(self.crcs, span.parts)]
        self._pending = None  # (chunk, buffer, future): the read in flight

    @property
    def weights_bytes(self):
        return sum(b.nbytes for bs in self.buffers for b in bs) + (
            sum(c.nbytes for c in self.crcs) if self.crcs else 0)

    @property
    def streamed_bytes(self):
        """The head's bytes (what the model does not hold, and a pass reads)."""
        return self.span.nbytes

    def products(self, v):
        """v: float32 [positions, dims] (C-contiguous) -> [positions, rows]: v @ W.T over every row,
        read chunk by chunk (one position: the native matvec, as the held head's; more: each chunk
        dequantized to float32 and multiplied by BLAS)."""
        n = self.span.n_rows
        out = np.empty((v.shape[0], n), np.float32)
        w = None if v.shape[0] == 1 else np.empty((self.per, self.span.dims), np.float32)  # (a chunk dequantized)
        io_s, got = 0.0, [0, 0]
        for i, a in enumerate(self.starts):
            t0 = time.perf_counter()
            j, res = self._take(i)
            io_s += time.perf_counter() - t0
            got = [got[0] + res[0], got[1] + res[1]]
            nxt = (i + 1) % len(self.starts)  # (after the last chunk: the next pass's first)
            self._pending = (nxt, 1 - j, self._submit(self._fill, nxt, 1 - j))
            b = min(a + self.per, n)
            q = self._matrix(j, b - a)
            if v.shape[0] == 1:
                q.matvec(v[0], out[0, a:b])
            else:
                q.dequantize(0, b - a, w[: b - a])
                np.matmul(v, w[: b - a].T, out=out[:, a:b])
        if self.stats is not None and self.stats.cur is not None:
            self.stats.add(io_s=io_s, bytes_read=got[0], reads=got[1])
        return out

    def _take(self, i):
        """Chunk i in a buffer: the read in flight if it is chunk i's (waited for), else read now.
        -> (buffer, (bytes, reads))."""
        if self._pending is not None:
            chunk, j, fut = self._pending
            self._pending = None
            res = fut.result()
            if chunk == i:
                return j, res
        return 0, self._fill(i, 0)

    def _fill(self, i, j):
        """Read chunk i's rows of every tensor into buffer j, every row checked. -> (bytes, reads)."""
        a = self.starts[i]
        ids = np.arange(a, min(a + self.per, self.span.n_rows), dtype=np.int64)
        s = self.reader.stats
        b0, r0 = s.bytes_read, s.reads_issued
        for k, (name, off, row, _) in enumerate(self.span.parts):
            segs = ((0, row // 2, "float16", self.buffers[j][k]),)
            try:
                self.reader.read_bundles(self.file, ids, row, segs, ids - a, base=off, checks=self._checks[k])
            except ChecksumError as e:
                raise ModelFileError(f"{self.path}: the output head's row {e.bundle} ({name}, bytes "
                                     f"{off + e.bundle * row}..{off + (e.bundle + 1) * row - 1}) does not match its "
                                     "checksum, read twice: the file changed or was damaged since the model loaded "
                                     "(mlx_flash.verify checks a whole folder)") from None
        return s.bytes_read - b0, s.reads_issued - r0

    def _matrix(self, j, rows):
        """Buffer j's first `rows` rows as a QuantMatrix (views, no copies)."""
        w, sc, bi = (buf[:rows].view(_NP[dtype]) for buf, (_, _, _, dtype) in zip(self.buffers[j], self.span.parts))
        return self._of_host(self.kernels, w, sc, bi, self.span.bits, self.span.group_size)

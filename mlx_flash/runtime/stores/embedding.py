"""The input embedding read from flash: the table stays in the resident file and each pass
reads the rows of its tokens.

A token needs one row of the table (Qwen2.5-1.5B: 1,536 values of 151,936 rows, 146 MB at
4 bits held for ~1 KB a token). Where the table is not the output head too (an untied
model), the runtime may leave it in the resident file: models/quantized.py's
StreamedEmbedding asks `rows(ids)` for a pass's distinct token ids and gathers them in
their order. A tied table stays whole in DRAM: the head multiplies by every row.

The store knows byte ranges and dtypes, not models. A row lies in each of the table's
tensors at row * row bytes (a quantized table: its packed words, scales and biases; a float
table: its values), so a pass reads, per tensor, one small read a distinct token (the
reader coalesces neighbours), into buffers of ROWS rows, then makes the rows the held
embedding would have: the same bytes through the same dequantization at the compute dtype.
Every read is checked: each row of each tensor has a CRC32C computed when the store opens
(from the resident file the loader checked against its sha256), verified by the reader,
read once more, then a clear error naming the row and the tensor.
"""

import time
from dataclasses import dataclass

import numpy as np

import mlx.core as mx

from ...errors import FlashError, ModelFileError
from ...io.files import ChecksumError, log_once
from .base import Store

ROWS = 64  # rows one read of each tensor holds (a longer prompt chunk reads in pieces of this many)
CRC_PIECE = 4 << 20  # bytes of the table read at once while its rows' checksums are computed
_NP = {"U32": np.uint32, "F16": np.float16, "BF16": np.uint16, "F32": np.float32}
_FLOAT = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class TableSpan:
    """An embedding table in the resident file: the module's path ("model.embed_tokens"), its
    rows and values a row, and per tensor (the weight; a quantized table's scales and biases
    after it) its name, the file offset of row 0, the bytes of a row and its safetensors dtype."""

    module: str
    n_rows: int
    dims: int
    parts: tuple  # ((tensor name, offset of row 0, row bytes, dtype), ...)
    bits: int | None = None
    group_size: int | None = None

    @property
    def nbytes(self):
        """The table's bytes in the file (what holding it costs)."""
        return self.n_rows * self.row_bytes

    @property
    def row_bytes(self):
        """What one token reads: a row of every tensor."""
        return sum(p[2] for p in self.parts)

    @property
    def names(self):
        return {p[0] for p in self.parts}

    def dram_bytes(self, checked):
        """What the store holds instead of the table: its read buffers, and (checked) a CRC32C
        per row of each tensor."""
        return self.buffer_rows * self.row_bytes + (4 * self.n_rows * len(self.parts) if checked else 0)

    @property
    def buffer_rows(self):
        return min(ROWS, self.n_rows)


def input_embedding(st, quantization):
    """(TableSpan of the resident SafetensorsFile's input embedding table, or None where it
    cannot be read by rows: no "...embed_tokens.weight", or a dtype the store does not know;
    whether the table is tied to the output head: the file holds no "lm_head.weight").
    quantization: config.json's (mlx-lm's form: one entry per quantized module)."""
    names = [n for n in st.names() if n.endswith("embed_tokens.weight")]
    tied = "lm_head.weight" not in st.tensors
    if len(names) != 1:
        return None, tied
    return table_span(st, quantization, names[0][: -len(".weight")]), tied


def table_span(st, quantization, module):
    """TableSpan of the module's table in the resident SafetensorsFile (its weight; a quantized
    one's scales and biases: rows of each at row * row bytes), or None where it cannot be read
    by rows (a tensor missing, or of a dtype or shape the stores do not read)."""
    q = (quantization or {}).get(module)
    kinds = ("weight", "scales", "biases") if isinstance(q, dict) else ("weight",)
    parts = []
    for kind in kinds:
        info = st.tensors.get(f"{module}.{kind}")
        known = ("U32",) if kind == "weight" and isinstance(q, dict) else _FLOAT  # (packed words, else values)
        if info is None or len(info["shape"]) != 2 or info["dtype"] not in known:
            return None
        rows, cols = info["shape"]
        a, b = info["data_offsets"]
        row = cols * np.dtype(_NP[info["dtype"]]).itemsize
        if b - a != rows * row or row % 2:
            return None
        parts.append((f"{module}.{kind}", st.data_start + a, row, info["dtype"]))
    n_rows, cols = st.tensors[f"{module}.weight"]["shape"]
    if any(st.tensors[p[0]]["shape"][0] != n_rows for p in parts):
        return None
    if isinstance(q, dict):
        return TableSpan(module, n_rows, cols * 32 // q["bits"], tuple(parts), q["bits"], q["group_size"])
    return TableSpan(module, n_rows, cols, tuple(parts))


def row_checksums(reader, file, span):
    """[uint32 [rows, 1] per tensor of the table]: each row's CRC32C, from a first read in pieces of
    CRC_PIECE bytes (None without the native extension: NumPy's CRC would take minutes)."""
    from ...io import native_available
    from ...io.checksum import parts_crc

    if not native_available():
        log_once("table-crc", "FlashReader: checking reads needs the native extension (not built); "
                 "reads of tables left on flash are not checked")
        return None
    out = []
    for _, off, row, _ in span.parts:
        per = min(span.n_rows, max(ROWS, CRC_PIECE // row))
        piece = np.zeros((per, row // 2), dtype=np.float16)
        crc = np.empty((span.n_rows, 1), dtype=np.uint32)
        segs = ((0, row // 2, "float16", piece),)
        for a in range(0, span.n_rows, per):
            ids = np.arange(a, min(a + per, span.n_rows), dtype=np.int64)
            reader.read_bundles(file, ids, row, segs, ids - a, base=off)
            crc[a: a + len(ids)] = parts_crc(piece[: len(ids)].view(np.uint8), [(0, row)])
        out.append(crc)
    reader.stats.reset()
    return out


class EmbeddingStore(Store):
    """The rows of an embedding table read from the resident file; `rows(ids)`. (A Store for
    its reader and close(); the FFNs never ask it for rows.)

    dtype: the compute dtype the rows are returned at; scale_dtype: what a quantized table's
    scales and biases are widened to before the dequantization (float32 where the held table
    would be the native kernels' NativeQuantizedEmbedding, else the compute dtype, as MLX's
    QuantizedEmbedding and a dequantized table compute): the held embedding's values, to the bit."""

    def __init__(self, path, span, reader, dtype, scale_dtype=mx.float32, verify=True, stats=None):
        self.path, self.span, self.reader = path, span, reader
        self.dtype, self.scale_dtype = dtype, scale_dtype
        self.stats = stats  # the FFN store's TokenStats: the reads join the next pass's row
        self.file = reader.open(path)
        last = max(off + span.n_rows * row for _, off, row, _ in span.parts)
        if last > self.file.size:
            raise ModelFileError(f"{path}: the embedding table ends beyond the end of the file "
                                 f"({last} > {self.file.size} bytes)")
        # as float16: the reader copies a row's bytes as they are (same-dtype copy)
        self.buffers = [np.zeros((span.buffer_rows, row // 2), dtype=np.float16) for _, _, row, _ in span.parts]
        self._segs = [((0, row // 2, "float16", buf),) for (_, _, row, _), buf in zip(span.parts, self.buffers)]
        self.crcs = row_checksums(reader, self.file, span) if verify else None
        self._checks = [None] * len(span.parts) if self.crcs is None else [
            (c, ((0, row, 0),)) for c, (_, _, row, _) in zip(self.crcs, span.parts)]

    @property
    def weights_bytes(self):
        return sum(b.nbytes for b in self.buffers) + (sum(c.nbytes for c in self.crcs) if self.crcs else 0)

    @property
    def streamed_bytes(self):
        """The table's bytes (what the model does not hold)."""
        return self.span.nbytes

    def rows(self, ids):
        """ids: distinct token ids (int64, each below the table's rows) -> mx.array [len(ids),
        dims] at the compute dtype: the rows the held table would give."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not ids.size:
            return mx.zeros((0, self.span.dims), dtype=self.dtype)
        t0 = time.perf_counter()
        s = self.reader.stats
        b0, r0 = s.bytes_read, s.reads_issued
        per = self.span.buffer_rows
        out = [self._values([self._read(j, ids[a: a + per]) for j in range(len(self.span.parts))])
               for a in range(0, len(ids), per)]
        if self.stats is not None:
            self.stats.early(io_s=time.perf_counter() - t0, bytes_read=s.bytes_read - b0, reads=s.reads_issued - r0)
        return out[0] if len(out) == 1 else mx.concatenate(out)

    def _read(self, j, ids):
        """Tensor j's rows `ids` -> mx.array of them as stored (bfloat16 as bfloat16)."""
        name, off, row, dtype = self.span.parts[j]
        try:
            self.reader.read_bundles(self.file, ids, row, self._segs[j], np.arange(len(ids), dtype=np.int64),
                                     base=off, checks=self._checks[j])
        except ChecksumError as e:
            raise ModelFileError(f"{self.path}: the input embedding's row {e.bundle} ({name}, bytes "
                                 f"{off + e.bundle * row}..{off + (e.bundle + 1) * row - 1}) does not match its "
                                 "checksum, read twice: the file changed or was damaged since the model loaded "
                                 "(mlx_flash.verify checks a whole folder)") from None
        a = mx.array(self.buffers[j][: len(ids)].view(_NP[dtype]))  # (a copy: the buffer is free again)
        return a.view(mx.bfloat16) if dtype == "BF16" else a

    def _values(self, arrays):
        """The rows at the compute dtype, computed as the held embedding computes them:
        models/quantized.py NativeQuantizedEmbedding (scales and biases widened to float32),
        MLX's QuantizedEmbedding (at the compute dtype), or a float table's values converted."""
        if self.span.bits is None:
            return arrays[0].astype(self.dtype)
        w, s, b = arrays
        sd = self.scale_dtype
        return mx.dequantize(w, s.astype(sd), b.astype(sd), group_size=self.span.group_size,
                             bits=self.span.bits).astype(self.dtype)


def check_streamable(span, tied, folder):
    """Refuse to stream a table that cannot be (the message says why)."""
    if tied:
        raise FlashError(f"--stream-embeddings on: {folder}'s input embeddings are tied to its output head, "
                         "which multiplies by every row each token: the table stays whole in DRAM")
    if span is None:
        raise FlashError(f"--stream-embeddings on: {folder}'s input embedding table cannot be read by rows "
                         "(no model.embed_tokens, or a dtype the store does not read)")

"""Attention read from flash: the quantized projections of some transformer blocks stay in
the resident file and are read, every token, into one of two buffers.

Under a tight memory limit a 4-bit 7B model's attention (42 MB a layer, 1.3 GB in all) leaves
no room for the FFN's streaming buffers. Streaming K layers' attention frees K - 2 layers'
worth (two buffers: layer s+1's projections are read while the layers before it compute),
and reads them as they lie: one layer's q/k/v/o words, scales and biases are contiguous in
the resident file (the converter writes a block's tensors together), a few large reads.

The store knows byte ranges and tensor names, not models: models/quantized.py's
StreamedQuantizedLinear asks `matrix(layer, name)` and multiplies on the view it gets
(eagerly, through the native kernels), so a buffer is free once the next streamed layer
asks. Every read is checked: each 256 KiB chunk has a CRC32C computed when the store opens
(from the resident file the loader checked against its sha256), verified by the reader,
read once more, then a clear error naming the layer and the tensor.
"""

import re
import time
from dataclasses import dataclass

import numpy as np

from ...errors import FlashError, ModelFileError
from ...io.files import ChecksumError, log_once
from .base import Store, take_pending

CHUNK = 256 * 1024  # bytes of one checked read (the reader's largest single read)
_NP = {"U32": np.uint32, "F16": np.float16, "BF16": np.uint16, "F32": np.float32}


@dataclass(frozen=True)
class LayerSpan:
    """One block's quantized projections in the resident file: bytes [start, end) and, per
    module (its path in the block, "self_attn.q_proj"), its words, scales and biases as
    (offset from start, shape, safetensors dtype); their bits and group size."""

    layer: int
    prefix: str  # the block's tensor prefix ("model.layers.3.")
    start: int
    end: int
    matrices: dict  # {name: ((offset, shape, dtype) of weight, scales, biases)}
    bits: int
    group_size: int

    @property
    def nbytes(self):
        return self.end - self.start

    @property
    def names(self):
        """The tensors' names in the file."""
        return {f"{self.prefix}{m}.{p}" for m in self.matrices for p in ("weight", "scales", "biases")}


def layer_spans(st, quantization):
    """{layer: LayerSpan} of every block's quantized modules in a resident SafetensorsFile
    (config.json's `quantization`, mlx-lm's form, names them: "model.layers.3.self_attn.q_proj").
    A block whose tensors cannot be streamed as they lie is left out."""
    blocks = {}
    for path, q in quantization.items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.(.+)$", path)
        if isinstance(q, dict) and m and f"{path}.scales" in st.tensors:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = (path[: m.start(2)], q)
    out = {}
    for layer, named in sorted(blocks.items()):
        entries = {}
        for name, (prefix, q) in named.items():
            parts = []
            for part in ("weight", "scales", "biases"):
                info = st.tensors.get(f"{prefix}{name}.{part}")
                if info is None or info["dtype"] not in _NP:
                    break
                a, b = info["data_offsets"]
                parts.append((st.data_start + a, st.data_start + b, tuple(info["shape"]), info["dtype"]))
            if len(parts) == 3:
                entries[name] = (parts, q["bits"], q["group_size"])
        kinds = {(b, g) for _, b, g in entries.values()}
        if len(entries) != len(named) or len(kinds) != 1:
            continue  # (projections of different bits, or a dtype the kernels do not read)
        (bits, group), = kinds
        start = min(p[0] for ps, _, _ in entries.values() for p in ps)
        end = max(p[1] for ps, _, _ in entries.values() for p in ps)
        if end - start > 1.1 * sum(p[1] - p[0] for ps, _, _ in entries.values() for p in ps):
            continue  # (scattered over the file: one read would carry much else)
        out[layer] = LayerSpan(layer, named[next(iter(named))][0], start, end,
                               {n: tuple((p[0] - start, p[2], p[3]) for p in ps) for n, (ps, _, _) in entries.items()},
                               bits, group)
    return out


def buffer_shape(longest):
    """(chunks, chunk bytes) of a buffer for spans of at most `longest` bytes (each read from an
    8-byte-aligned start: at most 7 bytes more)."""
    chunk = min(CHUNK, -(-(longest + 8) // 8) * 8)
    return -(-(longest + 8) // chunk), chunk


def layers_to_stream(span_bytes, deficit, prefetch=True):
    """The fewest layers whose streaming frees `deficit` bytes (two buffers of the largest
    span stay: one without prefetch), spread evenly over the model (each read then has several
    layers' compute to hide behind). span_bytes: {layer: bytes}. -> [layers] ([]: no deficit),
    or None where streaming every layer does not free enough."""
    if deficit <= 0:
        return []
    layers = sorted(span_bytes)
    bufs = 2 if prefetch else 1
    for k in range(bufs + 1, len(layers) + 1):
        pick = [layers[round(i * len(layers) / k)] for i in range(k)]
        n, chunk = buffer_shape(max(span_bytes[i] for i in pick))
        freed = sum(span_bytes[i] for i in pick) - bufs * n * chunk
        if freed >= deficit:
            return pick
    return None


class AttentionStore(Store):
    """Two buffers (one without prefetch) holding a streamed layer's projections; `matrix()`.
    (A Store for its worker and close(); the FFNs never ask it for rows.)"""

    def __init__(self, path, spans, reader, kernels, verify=True, prefetch=True, stats=None):
        from ...kernels import QuantMatrix

        self._of_host = QuantMatrix.of_host
        self.reader, self.kernels, self.prefetch = reader, kernels, prefetch
        self.spans = dict(sorted(spans.items()))
        self.order = list(self.spans)
        self._next = dict(zip(self.order, self.order[1:] + self.order[:1]))  # the read after each layer's
        self.stats = stats  # the FFN store's TokenStats: the waits and bytes join its rows
        self.file = reader.open(path)
        self.path = path
        n_chunks, self.chunk = buffer_shape(max(s.nbytes for s in self.spans.values()))
        # as float16: the reader copies a chunk's bytes as they are (same-dtype copy)
        self.buffers = [np.zeros((n_chunks, self.chunk // 2), dtype=np.float16) for _ in range(2 if prefetch else 1)]
        self._reads = {}  # per layer: (base, ids, segments per buffer)
        for layer, s in self.spans.items():
            base = s.start - s.start % 8
            n = -(-(s.end - base) // self.chunk)
            if base + n * self.chunk > self.file.size:  # the last span of the file: chunks end at its end
                base = (self.file.size - n * self.chunk) // 8 * 8
            if base < 0 or base > s.start or base + n * self.chunk < s.end:
                raise FlashError(f"{path}: layer {layer}'s attention cannot be read in chunks of {self.chunk} "
                                 "(it ends too near the end of the file)")
            self._reads[layer] = (base, np.arange(n, dtype=np.int64),
                                  [((0, self.chunk // 2, "float16", buf),) for buf in self.buffers])
        self.crcs = self._checksums() if verify else None
        self._checks = {layer: (c, ((0, self.chunk, 0),)) for layer, c in (self.crcs or {}).items()}
        self._views = {}  # (buffer, layer) -> {name: QuantMatrix}
        self._layer = self._j = None
        self._pending = None  # (layer, buffer, future)

    @property
    def weights_bytes(self):
        crcs = sum(c.nbytes for c in self.crcs.values()) if self.crcs else 0
        return sum(b.nbytes for b in self.buffers) + crcs

    @property
    def streamed_bytes(self):
        """The streamed tensors' bytes (what the model does not hold)."""
        return sum(s.nbytes for s in self.spans.values())

    def _checksums(self):
        """{layer: uint32 [chunks, 1]}: each chunk's CRC32C, from a first read (None without the
        native extension: NumPy's CRC would take seconds a layer)."""
        from ...io import native_available
        from ...io.checksum import parts_crc

        if not native_available():
            log_once("attn-crc", "FlashReader: checking reads needs the native extension (not built); "
                     "streamed attention reads are not checked")
            return None
        out = {}
        for layer in self.order:
            base, ids, segs = self._reads[layer]
            self.reader.read_bundles(self.file, ids, self.chunk, segs[0], ids, base=base)
            rows = self.buffers[0][: len(ids)].view(np.uint8)
            out[layer] = np.ascontiguousarray(parts_crc(rows, [(0, self.chunk)]))
        self.reader.stats.reset()
        return out

    def _fill(self, layer, j):
        """Read `layer`'s span into buffer j, every chunk checked. -> (bytes, reads)."""
        base, ids, segs = self._reads[layer]
        s0 = self.reader.stats
        b0, r0 = s0.bytes_read, s0.reads_issued
        try:
            self.reader.read_bundles(self.file, ids, self.chunk, segs[j], ids, base=base,
                                     checks=self._checks.get(layer))
        except ChecksumError as e:
            a = e.offset
            raise ModelFileError(f"{self.path}: layer {layer}'s attention, bytes {a}..{a + self.chunk - 1} "
                                 f"({self._tensors(layer, a, a + self.chunk)}), does not match its checksum, read "
                                 "twice: the file changed or was damaged since the model loaded (mlx_flash.verify "
                                 "checks a whole folder)") from None
        return s0.bytes_read - b0, s0.reads_issued - r0

    def _tensors(self, layer, a, b):
        """The tensors of layer's span that bytes [a, b) of the file overlap."""
        s = self.spans[layer]
        hit = []
        for name, parts in s.matrices.items():
            for part, (off, shape, dtype) in zip(("weight", "scales", "biases"), parts):
                lo = s.start + off
                hi = lo + int(np.prod(shape)) * np.dtype(_NP[dtype]).itemsize
                if lo < b and a < hi:
                    hit.append(f"{name}.{part}")
        return ", ".join(hit) if len(hit) <= 3 else f"{hit[0]} .. {hit[-1]}"

    def matrix(self, layer, name):
        """`layer`'s projection `name` as a QuantMatrix over the buffer holding it."""
        if layer != self._layer:
            self._switch(layer)
        views = self._views.get((self._j, layer))
        if views is None:
            views = self._views[(self._j, layer)] = self._matrices(layer, self._j)
        return views[name]

    def _switch(self, layer):
        """Make `layer`'s buffer current: the read in flight (the time waited is I/O), or a
        read now; then start the next streamed layer's read into the other buffer. Safe: the
        projections are computed eagerly, so the layer last served no longer reads its buffer."""
        if layer not in self.spans:
            raise KeyError(f"layer {layer}'s attention is not streamed")
        t0 = time.perf_counter()
        taken = take_pending(self, layer)
        if taken is None:
            j = 0 if self._j is None or len(self.buffers) == 1 else 1 - self._j
            taken = j, self._fill(layer, j)
        j, got = taken
        self._layer, self._j = layer, j
        if self.stats is not None and self.stats.cur is not None:
            self.stats.add(io_s=time.perf_counter() - t0, bytes_read=got[0], reads=got[1])
        if self.prefetch:
            nxt = self._next[layer]
            if nxt != layer:
                self._pending = (nxt, 1 - j, self._submit(self._fill, nxt, 1 - j))

    def _matrices(self, layer, j):
        base = self._reads[layer][0]
        raw = self.buffers[j].reshape(-1).view(np.uint8)
        s = self.spans[layer]
        out = {}
        for name, parts in s.matrices.items():
            arrays = []
            for off, shape, dtype in parts:
                at = s.start - base + off
                dt = np.dtype(_NP[dtype])
                if at % dt.itemsize:
                    raise FlashError(f"{self.path}: layer {layer} {name} is not aligned to its dtype")
                arrays.append(raw[at: at + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape))
            out[name] = self._of_host(self.kernels, *arrays, s.bits, s.group_size)
        return out

"""FlashReader: batches of uncached positioned reads from a persistent thread pool.

One call reads one batch (a layer's wanted bundles for a token) and returns
when every destination row is in place:

    reader = FlashReader(threads=32)
    f = reader.open("ffn/layer_000.bin", expected_size=...)
    reader.read_bundles(f, neuron_ids, stride,
                        [(0, d, "float16", up), (2 * d, d, "float16", down)], dst_rows)

A segment's source is float32/float16/bfloat16, or Quantized (MLX's group-wise
affine quantization, dequantized on copy; see Quantized).

One file past 500 lines: the batch plan (its runs, rows and segments) is built, validated and
run here, by the native pool or the pure-Python one, and both must read the same plan.

How, and why (measured figures: `mlx_flash.benchmark storage`):

- Uncached: O_DIRECT on Linux, fcntl F_NOCACHE (+ F_RDAHEAD off) on macOS, as
  the paper does (App. C); the page cache would hold weights outside the
  engine's memory budget. Where the file system refuses (tmpfs, some network
  file systems) the file is read through the page cache, with a warning logged
  once.
- O_DIRECT wants the file offset, the length and the buffer address aligned to
  the device's logical block size (queried from sysfs; 4096 when unknown).
  Destinations (NumPy views of MLX arrays) are not aligned, so each pool
  thread reads into its own page-aligned slot and copies/converts the rows of
  that read into their destinations at once; a failed read leaves its rows
  untouched. (A small slot reused read after read is also measurably faster
  here than one batch-sized staging buffer: 128 KiB x 32 threads went from
  0.75x fio to parity.) read() stages the whole batch instead, because it
  hands the bytes back.
- Coalescing: wanted bundles are sorted by offset and neighbours are merged
  into one read when the gap between them costs less to read than issuing
  another read (paper §2.2, "read more than needed and discard"); see
  DEFAULT_COALESCE_GAP for the model and the constant.
- The pool is native (pthreads, _native.c) when the extension is built: one
  call per batch, GIL released, conversion in C. The pure-Python pool is the
  fallback (logged once). Measured on 2 cores (`mlx_flash.benchmark storage`,
  12,000 x 16 KiB float16 bundles -> float32 rows, 32 threads): page-cached,
  the native pool costs ~7-8 us CPU per bundle, the Python one 29-94 us (GIL
  hand-offs; worst when both cores are free); uncached, the batch takes
  0.23-0.25 s native (at fio's 16 KiB speed), 0.86-0.98 s in Python.
"""

import errno
import hashlib
import itertools
import logging
import mmap
import os
import stat
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import FlashError, ModelFileError
from .native import native_module as _native_module

log = logging.getLogger("mlx_flash.io")

# Merge two neighbouring reads when the gap between them is at most this many
# bytes. Model: with t threads busy, a batch of N reads of c bytes takes about
# N * l + N * c / B (l: per-read cost that parallelism does not hide, B: the
# device's streaming rate), i.e. 1 / throughput = l / c + 1 / B. Reading a
# gap g instead of issuing a second read pays g / B and saves l, so merging
# wins while g < l * B. `mlx_flash.benchmark storage` fits l and B to the
# measured curve (4 KiB - 1 MiB) and prints l * B. Measured here (13 GB
# file, O_DIRECT): at 32 threads l ~ 11 us, B ~ 1.2-1.4 GB/s, so
# l * B ~ 13-16 KB (FlashReader's and fio's curves; 16-22 KB at 16 threads);
# a 2 GiB file's curve gives l ~ 5 us, B ~ 4 GB/s, l * B ~ 20 KB.
# Hence 16 KiB: a 16 KiB bundle nobody wants between two wanted ones is read
# and discarded rather than skipped (at the break-even point the two cost
# the same; anything larger is skipped). read_bundles bridges the same gap
# whatever the bundle's size, rather than at most one bundle (fewer bytes): on a 4-bit
# SmolLM2's DIP rows (288 B down rows, 1.5 KiB input columns) at a 22 % budget,
# bridging one bundle issues ~9,100 reads a token in 168 ms of I/O; bridging
# 16 KiB, ~370 in 60 ms (2.8x less I/O time for 2.6x the bytes); OPT-6.7B's
# 4.6 KiB 4-bit bundles read 15 % more bytes (0.068 against 0.059 GB a token)
# in the same I/O time (233/221 against 234/237 ms over two rounds, 302 against
# 287 in a third). Bundles of 16 KiB and more (float16 / float32 7B rows)
# bridge one bundle at most.
READ_THREADS = 32  # the paper's 32 parallel reads (every default thread count is this one)
DEFAULT_COALESCE_GAP = 16 * 1024
# A merged read never spans more than this: the measured throughput is flat
# beyond 256 KiB (`mlx_flash.benchmark storage`), and smaller pieces keep more threads busy.
DEFAULT_MAX_READ = 256 * 1024

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
DST_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}
QUANT_CODE = 3  # a Quantized segment's src code in the seg table
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)
# the seg table's columns (int64), as _native.c's seg_t
SEG_FIELDS = ("off", "n", "src", "dst", "dst_addr", "dst_stride",
              "bits", "group", "scale", "scales_addr", "biases_addr", "table_stride")

_F_NOCACHE = 48  # <sys/fcntl.h> on macOS, when Python's fcntl module lacks them
_F_RDAHEAD = 45

_logged = set()


def log_once(key, msg, *args):
    if key not in _logged:
        _logged.add(key)
        log.warning(msg, *args)


class ReadError(ModelFileError):
    """A read that did not deliver: names the file, the offset and why."""

    def __init__(self, file, offset, reason):
        self.file, self.offset, self.reason = str(file), offset, reason
        where = f" at offset {offset}" if offset is not None else ""
        super().__init__(f"{file}: read failed{where}: {reason}")


class ChecksumError(ReadError):
    """A bundle part whose bytes do not match its checksum, read twice."""

    def __init__(self, file, bundle, part, offset):
        self.bundle, self.part = bundle, part
        super().__init__(file, offset, f"bundle {bundle} (part {part}) does not match its checksum, "
                         "read twice: the file is damaged (mlx_flash.verify checks a whole folder; "
                         "convert the model again)")




def native_available():
    return _native_module()[0] is not None


def move_rows(v, dst, src):
    """v[dst] = v[src] for a C-contiguous 2-D array and disjoint int64 row sets (C when built)."""
    mod = _native_module()[0]
    if mod is not None and v.flags.c_contiguous and hasattr(mod, "move_rows"):
        mod.move_rows(v, v.strides[0], np.ascontiguousarray(dst, dtype=np.int64),
                      np.ascontiguousarray(src, dtype=np.int64))
    else:
        v[dst] = v[src]


def native_convert():
    """convert(src, src_code, dst, dst_code, n): 16-bit rows -> float32 (codes 1 float16,
    2 bfloat16; 0 float32), F16C in C when the extension is built, NumPy otherwise."""
    mod = _native_module()[0]
    if mod is not None:
        return mod.convert

    def convert(src, src_code, dst, dst_code, n):
        stage = np.asarray(src).reshape(-1).view(np.uint8)
        _convert_py(stage, 0, n, "bfloat16" if src_code == 2 else "float16", dst.reshape(-1)[:n])

    return convert


@dataclass(frozen=True, eq=False)
class Quantized:
    """Group-wise affine quantized values (MLX's mx.quantize layout), dequantized on copy.

    A read_bundles segment (off, n, Quantized(...), dst): the bundle holds n values
    of `bits` bits at byte `off`, packed as one little-endian bit stream (value j in
    bits j*bits .. j*bits+bits-1: MLX's uint32 words viewed as bytes; n*bits a
    multiple of 8), and each arrives as w_j = scale * q_j + bias, computed in float32
    (a multiply, then an add: bit for bit MLX's CPU dequantize with float32 scales)
    and stored as float32 or rounded to float16.

    table None, the row form: the n / group_size scales, then the n / group_size
    biases (scale_dtype) follow the packed bytes; value j is in group j // group_size.
    table (scales, biases), the column form: C-contiguous 2-D arrays [T, >= n] of
    scale_dtype (bfloat16 as uint16), kept in memory; value j of bundle id i (the
    neuron id as passed to read_bundles, without `base`) uses scales[i // group_size, j]
    and biases[i // group_size, j].
    """

    bits: int  # 2, 3, 4, 5, 6 or 8
    group_size: int  # 32, 64 or 128
    scale_dtype: str  # 'float32' | 'float16' | 'bfloat16': dtype of scales and biases
    table: tuple | None = None  # None, or (scales, biases): C-contiguous 2-D numpy arrays [T, n]

    def packed_bytes(self, n):
        return n * self.bits // 8

    def __repr__(self):  # the tables by shape, not by value (error messages show segments)
        t = "" if self.table is None else ", table=" + "/".join(
            f"{getattr(a, 'shape', '?')}" for a in self.table)
        return f"Quantized({self.bits}, {self.group_size}, {self.scale_dtype!r}{t})"

    def nbytes(self, n):
        """Bytes of a segment of n values in the bundle (packed values, inline scales)."""
        inline = 0 if self.table is not None else 2 * (n // self.group_size) * ITEMSIZE[self.scale_dtype]
        return self.packed_bytes(n) + inline


_TABLE_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                 "bfloat16": np.dtype(np.uint16)}


def _scales_f32(raw, scale_dtype):
    """Scale/bias values as stored (uint8 bytes or a table's row) -> float32, exactly."""
    if scale_dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(_TABLE_DTYPES[scale_dtype]).astype(np.float32)


def _unpack_py(packed, bits, n):
    """uint8 bytes of a little-endian bit stream -> its n values (uint8)."""
    if bits == 8:
        return packed[:n]
    if bits == 4:
        q = np.empty(2 * len(packed), dtype=np.uint8)
        q[0::2] = packed & 15
        q[1::2] = packed >> 4
        return q[:n]
    b = np.unpackbits(packed, bitorder="little")[: n * bits].reshape(n, bits)
    return (b << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)


def _dequant_py(stage, a, n, q, neuron, out):
    """stage[a:] holds a Quantized segment of n values (bundle id `neuron`) -> out."""
    pb = q.packed_bytes(n)
    vals = _unpack_py(stage[a : a + pb], q.bits, n).astype(np.float32)
    if q.table is None:
        g, ssz = n // q.group_size, ITEMSIZE[q.scale_dtype]
        sb = _scales_f32(stage[a + pb : a + pb + 2 * g * ssz], q.scale_dtype)
        scales = np.repeat(sb[:g], q.group_size)
        biases = np.repeat(sb[g:], q.group_size)
    else:
        t = neuron // q.group_size
        scales = _scales_f32(q.table[0][t, :n], q.scale_dtype)
        biases = _scales_f32(q.table[1][t, :n], q.scale_dtype)
    w = vals * scales  # float32, rounded; then the add, rounded: as the C code
    w += biases
    out[:] = w


@dataclass
class ReaderStats:
    """Counters of a FlashReader since it was made or last reset()."""

    bytes_requested: int = 0  # bytes the caller asked for
    bytes_read: int = 0  # bytes read from the file (with alignment and gaps)
    reads_requested: int = 0  # bundles / ranges asked for
    reads_issued: int = 0  # reads after coalescing
    batches: int = 0
    last_batch_s: float = 0.0
    total_batch_s: float = 0.0

    def reset(self):
        self.__init__()

    def as_dict(self):
        return asdict(self)


class FlashFile:
    """An open file of a FlashReader (from reader.open)."""

    __slots__ = ("path", "fd", "size", "direct", "align")

    def __init__(self, path, fd, size, direct, align):
        self.path, self.fd, self.size, self.direct, self.align = path, fd, size, direct, align

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self):
        mode = f"uncached, align {self.align}" if self.direct else "buffered"
        return f"FlashFile({self.path!r}, {self.size} bytes, {mode})"


def logical_block_size(fd):
    """The alignment uncached reads of this file need (4096 when unknown)."""
    if sys.platform.startswith("linux"):
        st = os.fstat(fd)
        dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        # a whole disk has queue/, a partition's parent has it
        for q in (f"{dev}/queue/logical_block_size", f"{dev}/../queue/logical_block_size"):
            try:
                with open(q) as fh:
                    v = int(fh.read())
                if v > 0 and v & (v - 1) == 0:
                    return v
            except (OSError, ValueError):
                pass
    return 4096


def _open_uncached(path, direct):
    """-> (fd, uncached?) ; raises OSError for a missing or unreadable file."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if direct and sys.platform.startswith("linux"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log_once(("odirect", os.path.dirname(path)),
                     "FlashReader: the file system of %s refuses O_DIRECT; reading through "
                     "the page cache instead (figures will not be the device's)", path)
    fd = os.open(path, flags)
    if direct and sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1)
            fcntl.fcntl(fd, getattr(fcntl, "F_RDAHEAD", _F_RDAHEAD), 0)
            return fd, True
        except OSError as e:
            log_once(("nocache", os.path.dirname(path)),
                     "FlashReader: F_NOCACHE refused for %s (%s); reading through the page cache",
                     path, e)
    elif direct and not sys.platform.startswith("linux"):
        log_once("platform", "FlashReader: no uncached reads on %s; using the page cache",
                 sys.platform)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead on random reads
    return fd, False


def plan_runs(starts, need, align, gap, max_read):
    """Coalesce sorted items into aligned reads.

    starts: int64 item offsets, sorted unless gap < 0 (no coalescing);
    need: int64 bytes per item.
    -> run_off, run_len, run_need, run_stage, row_start, row_src (all int64):
    run i reads run_len[i] bytes at run_off[i] (into stage[run_stage[i]:] when
    the runs share one staging buffer), of which run_need[i] must arrive; it
    holds items row_start[i]:row_start[i+1]; item k starts row_src[k] bytes
    into its run's buffer.
    """
    n = len(starts)
    ends = starts + need
    new = np.empty(n, dtype=bool)
    new[0] = True
    if gap < 0:  # no coalescing: one read per item, in the given order
        new[:] = True
    elif n > 1:
        reach = np.maximum.accumulate(ends)  # overlapping/duplicate items join the run
        new[1:] = starts[1:] - reach[:-1] > gap
        # cap a merged read at max_read: split where it crosses a max_read boundary
        rid = np.cumsum(new) - 1
        first = starts[new][rid]
        piece = (starts - first) // max_read
        new[1:] |= piece[1:] != piece[:-1]
    ridx = np.flatnonzero(new)
    rid = np.cumsum(new) - 1
    run_off = starts[ridx] // align * align
    run_end = ends if len(ridx) == n else np.maximum.reduceat(ends, ridx)
    run_need = run_end - run_off
    run_len = (run_need + align - 1) // align * align
    run_stage = np.zeros(len(ridx), dtype=np.int64)
    np.cumsum(run_len[:-1], out=run_stage[1:])
    row_start = np.append(ridx, n).astype(np.int64)
    row_src = starts - run_off[rid]
    return run_off, run_len, run_need, run_stage, row_start, row_src


class _Plan:
    """One batch, ready for a pool: run arrays, row arrays, segment table."""

    __slots__ = ("run_off", "run_len", "run_need", "run_stage", "row_start", "row_src",
                 "row_dst", "row_id", "segs", "seg_table", "stage_bytes", "slot_bytes",
                 "checks", "crc", "base", "stride")


class _PyPool:
    """The fallback: Python threads, each taking the next run of the batch."""

    def __init__(self, threads):
        self.nthreads = threads
        lock = threading.Lock()
        self._work = threading.Condition(lock)
        self._done = threading.Condition(lock)
        self._tickets = 0
        self._stop = False
        self._job = None
        self._threads = [threading.Thread(target=self._worker, daemon=True, name=f"flash-{i}")
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _worker(self):
        with self._work:
            while True:
                while not self._stop and self._tickets == 0:
                    self._work.wait()
                if self._stop:
                    return
                self._tickets -= 1
                job = self._job
                self._work.release()
                try:
                    job.work()
                finally:
                    self._work.acquire()
                job.active -= 1
                if job.active == 0:
                    self._done.notify()

    def run(self, job):
        with self._work:
            n = min(self.nthreads, job.nruns)
            job.active = n
            self._job = job
            self._tickets = n
            self._work.notify(n)
            while job.active:
                self._done.wait()
            self._job = None

    def close(self):
        with self._work:
            self._stop = True
            self._work.notify_all()
        for t in self._threads:
            t.join()


_tls = threading.local()


class _PyBatch:
    """A batch for _PyPool: os.preadv into the staging buffer, NumPy conversion."""

    def __init__(self, fd, align, plan, stage, fault):
        self.fd, self.align = fd, align
        self.slot_bytes = plan.slot_bytes
        self.stage = stage
        self.run_off = plan.run_off.tolist()
        self.run_len = plan.run_len.tolist()
        self.run_need = plan.run_need.tolist()
        self.run_stage = plan.run_stage.tolist()
        self.row_start = plan.row_start.tolist()
        self.row_src = plan.row_src.tolist()
        self.row_dst = plan.row_dst.tolist() if plan.row_dst is not None else None
        self.row_id = plan.row_id.tolist() if plan.row_id is not None else None
        self.segs = plan.segs
        self.checks = plan.checks.tolist()
        self.crc = plan.crc
        self.nruns = len(self.run_off)
        self.fault_off, self.fault_errno = fault
        self.failure = None
        self.error = None
        self.active = 0
        self._next = itertools.count().__next__  # atomic under the GIL

    def work(self):
        with np.errstate(over="ignore"):  # float32 -> float16 overflows to inf, as in C
            while self.failure is None:
                i = self._next()
                if i >= self.nruns:
                    return
                try:
                    self._run(i)
                except Exception as e:  # a bug, not an I/O error: re-raised by the caller
                    self.error = e
                    self.failure = (i, 0, 0)

    def _buffer(self, i):
        """-> (uint8 array, start offset): where run i lands."""
        if not self.slot_bytes:
            return self.stage, self.run_stage[i]
        slot = getattr(_tls, "slot", None)  # this worker's own slot, kept between batches
        if slot is None or len(slot[0]) < self.slot_bytes:
            mm = mmap.mmap(-1, self.slot_bytes)
            _tls.slot = slot = (np.frombuffer(mm, dtype=np.uint8), mm)
        return slot[0], 0

    def _run(self, i):
        off, ln, need = self.run_off[i], self.run_len[i], self.run_need[i]
        stage, so = self._buffer(i)
        mv = memoryview(stage)
        got, err = 0, 0
        if off <= self.fault_off < off + ln:
            err = self.fault_errno
        else:
            while got < need:
                try:
                    r = os.preadv(self.fd, [mv[so + got : so + ln]], off + got)
                except InterruptedError:
                    continue
                except OSError as e:
                    err = e.errno
                    break
                if r == 0:
                    break
                got += r
                if got % self.align:
                    break
        if err or got < need:
            if self.failure is None:
                self.failure = (i, err, got)
            return
        if self.checks:
            from .checksum import crc32c

            for k in range(self.row_start[i], self.row_start[i + 1]):
                for c, (off, n, col) in enumerate(self.checks):
                    a = so + self.row_src[k] + off
                    if crc32c(stage[a : a + n].tobytes()) != int(self.crc[self.row_id[k], col]):
                        if self.failure is None:
                            self.failure = (i, errno.EBADMSG, k * len(self.checks) + c)
                        return
        if not self.segs:
            return
        for k in range(self.row_start[i], self.row_start[i + 1]):
            src, row = so + self.row_src[k], self.row_dst[k]
            for seg_off, n, src_dtype, dst in self.segs:
                a = src + seg_off
                if isinstance(src_dtype, Quantized):
                    _dequant_py(stage, a, n, src_dtype, self.row_id[k], dst[row, :n])
                else:
                    _convert_py(stage, a, n, src_dtype, dst[row, :n])


def _convert_py(stage, a, n, src_dtype, out):
    """stage[a:] holds n values of src_dtype -> out (float32 or float16), converted."""
    if src_dtype == "bfloat16":
        bits = stage[a : a + 2 * n].view(np.uint16)
        if out.dtype == np.float32:
            o = out.view(np.uint32)
            o[:] = bits
            o <<= 16
        else:
            out[:] = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        isz = ITEMSIZE[src_dtype]
        out[:] = stage[a : a + isz * n].view(src_dtype)


class _NativePool:
    def __init__(self, mod, threads):
        self.nthreads = threads
        self._pool = mod.Pool(threads)

    def run_plan(self, fd, align, plan, stage, fault):
        # plan.segs holds the Quantized tables whose addresses plan.seg_table carries:
        # the caller keeps the plan (so the arrays) alive for the call
        return self._pool.run(
            fd, align, len(plan.run_off), plan.run_off, plan.run_len, plan.run_need,
            plan.run_stage, plan.row_start, plan.row_src,
            plan.row_dst if plan.row_dst is not None else _EMPTY,
            plan.row_id if plan.row_id is not None else _EMPTY, plan.seg_table,
            stage if not plan.slot_bytes else _NO_STAGE, plan.slot_bytes, fault[0], fault[1],
            plan.checks, plan.crc, plan.crc.shape[1] if plan.crc.ndim == 2 else 0)

    def close(self):
        self._pool.close()


_EMPTY = np.zeros(0, dtype=np.int64)
_NO_CHECKS = np.zeros((0, 3), dtype=np.int64)
_NO_CRC = np.zeros(0, dtype=np.uint32)
_NO_STAGE = bytearray(0)
_NO_SEGS = np.zeros((0, len(SEG_FIELDS)), dtype=np.int64)


class FlashReader:
    """Parallel uncached batch reads; see the module docstring.

    threads: size of the persistent pool (the paper uses 32).
    direct: uncached reads (O_DIRECT / F_NOCACHE), logged fallback to buffered.
    coalesce_gap, max_read: coalescing (bytes); coalesce_gap < 0 disables it.
    backend: "auto" (native if built), "native" or "python".
    align: override the alignment of uncached reads (default: queried per file).
    """

    def __init__(self, threads=READ_THREADS, direct=True, coalesce_gap=DEFAULT_COALESCE_GAP,
                 max_read=DEFAULT_MAX_READ, backend="auto", align=None):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.threads = threads
        self.direct = direct
        self.coalesce_gap = coalesce_gap
        self.max_read = max_read
        self.align = align
        self.stats = ReaderStats()
        self._files = []
        self._lock = threading.Lock()
        self._stage_mm = None
        self._stage = None
        self._fault = (-1, 0)  # test hook: fail reads covering this offset with this errno
        self._compiled = {}  # segments / checks tuples -> their validated tables (_memo)
        mod, why = _native_module()
        if backend == "native" and mod is None:
            raise FlashError(f"FlashReader: native backend requested but {why}")
        if backend not in ("auto", "native", "python"):
            raise ValueError(f"unknown backend {backend!r}")
        if backend == "auto" and mod is None:
            log_once("nonative", "FlashReader: %s; using the pure-Python pool "
                     "(slower per read; `pip install -e .` builds the extension)", why)
        self._mod = mod if backend != "python" else None
        self.backend = "native" if self._mod is not None else "python"
        self._pool = None
        self._pid = None

    # ---- files

    def open(self, path, expected_size=None, expected_sha256=None):
        """Open a file for uncached reads -> FlashFile.

        Raises ReadError naming the file if it is missing, not a regular file (a
        folder, a device, a pipe: checked before opening, which a pipe would block),
        unreadable, not of expected_size, or (when given, which reads the whole
        file) its sha256 differs from expected_sha256.
        """
        path = os.fspath(path)
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ReadError(path, None, "not a regular file (a folder, a device or a pipe)")
            fd, uncached = _open_uncached(path, self.direct)
        except FileNotFoundError:
            raise ReadError(path, None, "missing (no such file)")
        except OSError as e:
            raise ReadError(path, None, f"cannot open ({e.strerror})")
        size = os.fstat(fd).st_size
        if expected_size is not None and size != expected_size:
            os.close(fd)
            raise ReadError(path, None, f"size {size} != expected {expected_size} "
                            "(file truncated or changed since conversion)")
        align = (self.align or logical_block_size(fd)) if uncached else 1
        f = FlashFile(path, fd, size, uncached, align)
        self._files.append(f)
        if expected_sha256 is not None:
            digest = self.sha256(f)
            if digest != expected_sha256:
                self.close_file(f)
                raise ReadError(path, None, "sha256 differs from the expected one "
                                "(file changed since conversion)")
        return f

    def close_file(self, f):
        f.close()
        if f in self._files:
            self._files.remove(f)

    def sha256(self, f, chunk=8 << 20, per_batch=8):
        """sha256 of the whole file, read uncached through the pool."""
        h = hashlib.sha256()
        step = chunk * per_batch
        for base in range(0, f.size, step):
            offs = list(range(base, min(base + step, f.size), chunk))
            lens = [min(chunk, f.size - o) for o in offs]
            for part in self.read(f, offs, lens, copy=False):
                h.update(part)
        return h.hexdigest()

    # ---- batches

    def read_bundles(self, f, neuron_ids, stride, segments, dst_rows, base=0, gap=None, checks=None):
        """Read bundles and place their segments into destination rows.

        For each k: the bundle at neuron_ids[k] * stride; for each segment
        (byte_offset_in_bundle, n_values, src_dtype, dst), its n_values values
        of src_dtype go, converted, into dst[dst_rows[k], :n_values]. src_dtype:
        'float32', 'float16', 'bfloat16', or a Quantized (dequantized on copy;
        its column form picks table row neuron_ids[k] // group_size). Returns
        when every row is in place. Raises ReadError on any failure; then
        the rows of the failed read(s) are untouched, rows of reads that
        succeeded hold their new values, and the batch as a whole must be
        treated as not done. dst_rows must not repeat within a batch.
        base: byte offset added to every bundle's start (a part of each bundle);
        gap: this batch's coalescing gap (0: merge only touching reads, < 0: never
        merge); by default the reader's (DEFAULT_COALESCE_GAP: a read's own cost in bytes).
        checks: (crc, parts): every bundle's parts [(offset, length, column)] must have
        the CRC32C crc[neuron_ids[k], column] (crc: uint32 [n_bundles, columns]) before
        any row of its read is placed; a mismatch is read once more, then raised as a
        ChecksumError naming the bundle, the part and its offset in the file.
        """
        t0 = time.perf_counter()
        ids = np.asarray(neuron_ids, dtype=np.int64).reshape(-1)
        rows = np.asarray(dst_rows, dtype=np.int64).reshape(-1)
        if ids.shape != rows.shape:
            raise ValueError("neuron_ids and dst_rows differ in length")
        segs, table, need = self._check_segments(segments, stride, rows, ids)
        if len(ids) == 0:
            return
        last = base + int(ids.max()) * stride
        if last + need > f.size:
            raise ReadError(f.path, last, f"bundle ends beyond the end of the file "
                            f"({last + need} > {f.size} bytes)")
        order = self._order(ids)
        if order is not None:
            ids, rows = ids[order], rows[order]
        starts = base + ids * stride
        with self._lock:
            plan = self._plan(f, starts, np.full(len(starts), need, dtype=np.int64), private=True,
                              gap=gap)
            plan.row_dst = rows
            plan.row_id = ids
            plan.segs = segs
            plan.seg_table = table
            plan.checks, plan.crc = self._check_checks(checks, ids, need)
            plan.base, plan.stride = base, stride
            self._execute(f, plan)
            self._account(len(ids) * need, plan, t0)

    def _check_checks(self, checks, ids, need):
        if checks is None:
            return _NO_CHECKS, _NO_CRC
        crc, parts = checks
        table = self._memo(("checks", checks, need), lambda: self._compile_checks(crc, parts, need))
        if len(ids) and int(ids.max()) >= crc.shape[0]:
            raise ValueError(f"checks: bundle {int(ids.max())} has no checksum ({crc.shape[0]} rows)")
        return table, crc

    @staticmethod
    def _compile_checks(crc, parts, need):
        if not (isinstance(crc, np.ndarray) and crc.dtype == np.uint32 and crc.ndim == 2
                and crc.flags.c_contiguous):
            raise ValueError("checks: crc must be a C-contiguous 2-D uint32 array")
        table = np.array(parts, dtype=np.int64).reshape(-1, 3)
        if ((table[:, 0] < 0) | (table[:, 1] < 0) | (table[:, 0] + table[:, 1] > need)
                | (table[:, 2] < 0) | (table[:, 2] >= crc.shape[1])).any():
            raise ValueError(f"checks: a part outside the {need} bytes read per bundle, or no such column")
        return table

    def read(self, f, offsets, lengths, copy=True):
        """Plain batch read -> list of bytes-like, in the order asked.

        copy=False returns views of the reader's staging buffer, valid only
        until the reader's next call.
        """
        t0 = time.perf_counter()
        offs, lens = self._check_ranges(f, offsets, lengths)
        if len(offs) == 0:
            return []
        order = self._order(offs)
        with self._lock:
            plan = self._plan(f, offs if order is None else offs[order],
                              lens if order is None else lens[order])
            counts = np.diff(plan.row_start)
            src = np.repeat(plan.run_stage, counts) + plan.row_src  # in the shared staging
            if order is not None:
                src[order] = src.copy()
            plan.row_dst, plan.row_id, plan.segs, plan.seg_table = None, None, (), _NO_SEGS
            plan.checks, plan.crc = _NO_CHECKS, _NO_CRC
            self._execute(f, plan)
            mv = memoryview(self._stage_mm)[: plan.stage_bytes]
            if copy:
                mv = memoryview(bytes(mv))
            out = [mv[a : a + n] for a, n in zip(src.tolist(), lens.tolist())]
            self._account(int(lens.sum()), plan, t0)
        return out

    def read_discard(self, f, offsets, lengths):
        """Read and throw the bytes away: the I/O path alone, for benchmarks.

        The same plan, pool, per-thread staging slots and uncached reads as
        read_bundles, without the copy into destination rows. Returns nothing.
        """
        t0 = time.perf_counter()
        offs, lens = self._check_ranges(f, offsets, lengths)
        if len(offs) == 0:
            return
        order = self._order(offs)
        with self._lock:
            if order is not None:
                offs, lens = offs[order], lens[order]
            plan = self._plan(f, offs, lens, private=True)
            plan.row_dst, plan.row_id, plan.segs, plan.seg_table = None, None, (), _NO_SEGS
            plan.checks, plan.crc = _NO_CHECKS, _NO_CRC
            self._execute(f, plan)
            self._account(int(lens.sum()), plan, t0)

    # ---- internals

    def _check_ranges(self, f, offsets, lengths):
        offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
        lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if offs.shape != lens.shape:
            raise ValueError("offsets and lengths differ in length")
        if len(offs) == 0:
            return offs, lens
        if offs.min() < 0 or lens.min() < 0:
            raise ValueError("negative offset or length")
        ends = offs + lens
        k = int(np.argmax(ends))
        if ends[k] > f.size:
            raise ReadError(f.path, int(offs[k]), f"range ends beyond the end of the file "
                            f"({int(ends[k])} > {f.size} bytes)")
        return offs, lens

    def _order(self, offs):
        """The sorting permutation coalescing needs; None if sorted or not coalescing."""
        if self.coalesce_gap < 0 or len(offs) < 2 or (offs[1:] >= offs[:-1]).all():
            return None
        return np.argsort(offs, kind="stable")

    def _check_segments(self, segments, stride, rows, ids):
        """-> (segs, seg table, bytes needed per bundle), or ValueError. What depends only on the
        segments is compiled once per tuple of segments (a store passes the same tuple token
        after token); the rows and ids are checked on every call."""
        if stride <= 0:
            raise ValueError("stride must be positive")
        if not segments:
            raise ValueError("read_bundles needs at least one segment")
        if len(ids) and ids.min() < 0:
            raise ValueError("negative neuron id")
        c = self._memo(("segs", segments, stride), lambda: self._compile_segments(segments, stride))
        segs, table, need, dst_rows, tables = c
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= dst_rows):
            raise ValueError(f"dst_rows outside 0..{dst_rows - 1}")
        if len(ids) and tables:
            top = int(ids.max())
            for what, group, n_rows in tables:
                if top // group >= n_rows:
                    raise ValueError(f"{what}: neuron id {top} needs table row {top // group}, "
                                     f"the table has {n_rows} rows")
        return segs, table, need

    def _memo(self, key, make):
        """make(), kept for a key whose container is a tuple (its identity then names the same
        contents; the entry holds the tuple so the identity is not reused)."""
        if not isinstance(key[1], tuple):
            return make()
        k = (key[0], id(key[1]), key[2])
        hit = self._compiled.get(k)
        if hit is not None and hit[0] is key[1]:
            return hit[1]
        value = make()
        if len(self._compiled) >= 1024:  # a bound, for callers that make new tuples each time
            self._compiled.clear()
        self._compiled[k] = (key[1], value)
        return value

    def _compile_segments(self, segments, stride):
        segs, table, need, dst_rows, tables = [], [], 0, None, []
        for off, n, src_dtype, dst in segments:
            quant = isinstance(src_dtype, Quantized)
            if not quant and src_dtype not in DTYPE_CODES:
                raise ValueError(f"src dtype {src_dtype!r}: not one of {list(DTYPE_CODES)} "
                                 "or a Quantized")
            if not isinstance(dst, np.ndarray) or dst.dtype not in DST_CODES or dst.ndim != 2:
                raise ValueError("dst must be a 2-D float32 or float16 numpy array")
            if not (dst.flags.c_contiguous and dst.flags.aligned and dst.flags.writeable):
                raise ValueError("dst must be C-contiguous, aligned and writeable")
            if quant:
                qcols, nbytes, table_rows = self._check_quantized(off, n, src_dtype)
                if table_rows is not None:
                    tables.append((f"quantized segment ({off}, {n}, bits={src_dtype.bits}, "
                                   f"group_size={src_dtype.group_size})", src_dtype.group_size, table_rows))
                isz = 1
            else:
                qcols, isz = (0,) * 6, ITEMSIZE[src_dtype]
                nbytes = n * isz
            if off < 0 or off % isz or stride % isz or n < 0 or n > dst.shape[1]:
                raise ValueError(f"segment ({off}, {n}, {src_dtype}) does not fit "
                                 f"stride {stride} / dst {dst.shape}")
            if off + nbytes > stride:
                raise ValueError(f"segment ({off}, {n}, {src_dtype}) overruns the bundle stride "
                                 f"{stride} ({nbytes} bytes at {off})")
            dst_rows = dst.shape[0] if dst_rows is None else min(dst_rows, dst.shape[0])
            need = max(need, off + nbytes)
            segs.append((int(off), int(n), src_dtype, dst))
            table.append((off, n, QUANT_CODE if quant else DTYPE_CODES[src_dtype],
                          DST_CODES[dst.dtype], dst.__array_interface__["data"][0],
                          dst.strides[0]) + qcols)
        table = np.array(table, dtype=np.int64).reshape(-1, len(SEG_FIELDS))
        return segs, table, need, dst_rows, tables

    @staticmethod
    def _check_quantized(off, n, q):
        """-> (seg table columns bits .. table_stride, bytes in the bundle, the column form's table
        rows or None); ValueError if bad."""
        what = f"quantized segment ({off}, {n}, bits={q.bits}, group_size={q.group_size})"
        if q.bits not in QUANT_BITS:
            raise ValueError(f"{what}: {q.bits}-bit values are not supported (bits: {QUANT_BITS})")
        if q.group_size not in QUANT_GROUPS:
            raise ValueError(f"{what}: group size {q.group_size} is not supported "
                             f"(group_size: {QUANT_GROUPS})")
        if q.scale_dtype not in DTYPE_CODES:
            raise ValueError(f"{what}: scale_dtype {q.scale_dtype!r} is not one of {list(DTYPE_CODES)}")
        if n < 0 or n * q.bits % 8:
            raise ValueError(f"{what}: {n} values of {q.bits} bits are not a whole number of bytes")
        if q.table is None:
            if n % q.group_size:
                raise ValueError(f"{what}: inline scales need n a multiple of the group size")
            return (q.bits, q.group_size, DTYPE_CODES[q.scale_dtype], 0, 0, 0), q.nbytes(n), None
        if not (isinstance(q.table, tuple) and len(q.table) == 2):
            raise ValueError(f"{what}: table must be None or a (scales, biases) tuple")
        want = _TABLE_DTYPES[q.scale_dtype]
        shape = None
        for name, t in zip(("scales", "biases"), q.table):
            if not isinstance(t, np.ndarray) or t.ndim != 2:
                raise ValueError(f"{what}: table {name} must be a 2-D numpy array")
            if t.dtype != want:
                raise ValueError(f"{what}: table {name} is {t.dtype}, scale_dtype {q.scale_dtype} "
                                 f"needs {want}")
            if not (t.flags.c_contiguous and t.flags.aligned):
                raise ValueError(f"{what}: table {name} must be C-contiguous and aligned")
            if t.shape[1] < n:
                raise ValueError(f"{what}: table {name} {t.shape} is narrower than the {n} values")
            if shape is not None and t.shape != shape:
                raise ValueError(f"{what}: table scales {shape} and biases {t.shape} differ in shape")
            shape = t.shape
        scales, biases = q.table
        return (q.bits, q.group_size, DTYPE_CODES[q.scale_dtype],
                scales.__array_interface__["data"][0], biases.__array_interface__["data"][0],
                scales.strides[0]), q.nbytes(n), shape[0]

    def _plan(self, f, starts, need, private=False, gap=None):
        """private: each pool thread reads into its own small slot and copies
        the rows out at once (read_bundles); else the runs share one staging
        buffer that outlives the batch (read)."""
        plan = _Plan()
        (plan.run_off, plan.run_len, plan.run_need, plan.run_stage, plan.row_start,
         plan.row_src) = plan_runs(starts, need, f.align, self.coalesce_gap if gap is None else gap,
                                   max(self.max_read, f.align))
        if private:
            plan.slot_bytes = (int(plan.run_len.max()) + 4095) // 4096 * 4096
            plan.stage_bytes = 0
        else:
            plan.slot_bytes = 0
            plan.stage_bytes = int(plan.run_stage[-1] + plan.run_len[-1])
            self._ensure_stage(plan.stage_bytes)
        return plan

    def _ensure_stage(self, nbytes):
        if self._stage is not None and len(self._stage) >= nbytes:
            return
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())
        self._stage = None
        self._stage_mm = mmap.mmap(-1, size)  # anonymous: page-aligned
        self._stage = np.frombuffer(self._stage_mm, dtype=np.uint8)

    def _get_pool(self):
        if self._pool is None or self._pid != os.getpid():  # threads do not survive fork
            if self._mod is not None:
                self._pool = _NativePool(self._mod, self.threads)
            else:
                self._pool = _PyPool(self.threads)
            self._pid = os.getpid()
        return self._pool

    def _execute(self, f, plan, retry=True, reread=True):
        if f.fd < 0:
            raise ReadError(f.path, None, "file is closed")
        pool = self._get_pool()
        if self._mod is not None:
            failure = pool.run_plan(f.fd, f.align, plan, self._stage, self._fault)
        else:
            job = _PyBatch(f.fd, f.align, plan, self._stage, self._fault)
            pool.run(job)
            if job.error is not None:
                raise job.error
            failure = job.failure
        if failure is None:
            return
        i, err, got = failure
        if i < 0:
            raise ReadError(f.path, None, f"no memory for the staging slots ({os.strerror(err)})")
        off, need = int(plan.run_off[i]), int(plan.run_need[i])
        if err == errno.EBADMSG and len(plan.checks):
            if reread:  # a transient corruption (bus, cache) passes the second time
                log_once(("reread", f.path), "FlashReader: %s: a bundle did not match its checksum; "
                         "reading it again", f.path)
                return self._execute(f, plan, retry, reread=False)
            k, c = divmod(got, len(plan.checks))
            bundle = int(plan.row_id[k])
            raise ChecksumError(f.path, bundle, int(plan.checks[c][2]),
                                plan.base + bundle * plan.stride + int(plan.checks[c][0]))
        if err == errno.EINVAL and f.direct and retry:
            # some file systems accept O_DIRECT at open and refuse the reads
            log_once(("odirect-read", os.path.dirname(f.path)),
                     "FlashReader: uncached reads of %s fail (EINVAL); reading through "
                     "the page cache instead", f.path)
            self._reopen_buffered(f)
            self._fault = (-1, 0)  # an injected fault belongs to the old descriptor
            return self._execute(f, plan, retry=False, reread=reread)
        if err:
            name = errno.errorcode.get(err, str(err))
            raise ReadError(f.path, off, f"{name}: {os.strerror(err)}")
        try:
            now = os.fstat(f.fd).st_size
        except OSError:
            now = "?"
        raise ReadError(f.path, off + got, f"short read: {got} of {need} bytes arrived "
                        f"(file is now {now} bytes, {f.size} when opened: truncated or "
                        "changed since?)")

    def _reopen_buffered(self, f):
        fd, _ = _open_uncached(f.path, direct=False)
        os.close(f.fd)
        f.fd, f.direct, f.align = fd, False, 1

    def _account(self, requested, plan, t0):
        s = self.stats
        dt = time.perf_counter() - t0
        s.bytes_requested += requested
        s.bytes_read += int(plan.run_len.sum())
        s.reads_requested += len(plan.row_src)
        s.reads_issued += len(plan.run_off)
        s.batches += 1
        s.last_batch_s = dt
        s.total_batch_s += dt

    def close(self):
        for f in self._files:
            f.close()
        self._files.clear()
        if self._pool is not None and self._pid == os.getpid():
            self._pool.close()
        self._pool = None
        self._stage = None
        self._stage_mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"FlashReader(threads={self.threads}, backend={self.backend}, "
                f"direct={self.direct}, coalesce_gap={self.coalesce_gap})")

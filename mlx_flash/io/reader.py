"""FlashReader: batches of uncached positioned reads from a persistent thread pool.

One call reads one batch (a layer's wanted bundles for a token) and returns
when every destination row is in place:

    reader = FlashReader(threads=32)
    f = reader.open("ffn/layer_000.bin", expected_size=...)
    reader.read_bundles(f, neuron_ids, stride,
                        [(0, d, "float16", up), (2 * d, d, "float16", down)], dst_rows)

A segment's source is float32/float16/bfloat16, or Quantized (MLX's group-wise
affine quantization, dequantized on copy; see quantized_rows.Quantized).

The batch plan (its runs, rows and segments) is built and validated by plan.py and run by
the native pool or the pure-Python one (pool.py), which both read the same plan; files.py
opens the files (uncached) and names the errors, formats.py and quantized_rows.py the
values a segment holds.

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
import mmap
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import FlashError
from .files import ChecksumError, FlashFile, ReadError, log_once, logical_block_size, open_uncached
from .native import native_module
from .plan import NO_CHECKS, NO_CRC, NO_SEGS, Plan, compile_checks, compile_segments, plan_runs
from .pool import NativePool, PyBatch, PyPool

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
        mod, why = native_module()
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
            fd, uncached = open_uncached(path, self.direct)
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
            return NO_CHECKS, NO_CRC
        crc, parts = checks
        table = self._memo(("checks", checks, need), lambda: compile_checks(crc, parts, need))
        if len(ids) and int(ids.max()) >= crc.shape[0]:
            raise ValueError(f"checks: bundle {int(ids.max())} has no checksum ({crc.shape[0]} rows)")
        return table, crc

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
            plan.row_dst, plan.row_id, plan.segs, plan.seg_table = None, None, (), NO_SEGS
            plan.checks, plan.crc = NO_CHECKS, NO_CRC
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
            plan.row_dst, plan.row_id, plan.segs, plan.seg_table = None, None, (), NO_SEGS
            plan.checks, plan.crc = NO_CHECKS, NO_CRC
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
        c = self._memo(("segs", segments, stride), lambda: compile_segments(segments, stride))
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

    def _plan(self, f, starts, need, private=False, gap=None):
        """private: each pool thread reads into its own small slot and copies
        the rows out at once (read_bundles); else the runs share one staging
        buffer that outlives the batch (read)."""
        plan = Plan()
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
                self._pool = NativePool(self._mod, self.threads)
            else:
                self._pool = PyPool(self.threads)
            self._pid = os.getpid()
        return self._pool

    def _execute(self, f, plan, retry=True, reread=True):
        if f.fd < 0:
            raise ReadError(f.path, None, "file is closed")
        pool = self._get_pool()
        if self._mod is not None:
            failure = pool.run_plan(f.fd, f.align, plan, self._stage, self._fault)
        else:
            job = PyBatch(f.fd, f.align, plan, self._stage, self._fault)
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
        fd, _ = open_uncached(f.path, direct=False)
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

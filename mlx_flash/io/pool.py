"""The pools that run a batch's plan (plan.py): the native one (pthreads in _native.c: one
call per batch, GIL released, conversion in C) when the extension is built, else the
pure-Python fallback (Python threads, os.preadv, NumPy conversion). Both read each run into
a staging buffer (a worker's own page-aligned slot, or the batch's shared one), check it,
and copy/convert its rows into their destinations at once; a failed read leaves its rows
untouched and is reported as (run, errno, bytes that arrived)."""

import errno
import itertools
import mmap
import os
import threading

import numpy as np

from .formats import convert_py
from .quantized_rows import Quantized, dequant_py


class PyPool:
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


class PyBatch:
    """A batch for PyPool: os.preadv into the staging buffer, NumPy conversion."""

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
                    dequant_py(stage, a, n, src_dtype, self.row_id[k], dst[row, :n])
                else:
                    convert_py(stage, a, n, src_dtype, dst[row, :n])


_EMPTY = np.zeros(0, dtype=np.int64)
_NO_STAGE = bytearray(0)


class NativePool:
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

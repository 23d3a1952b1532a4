"""A batch's plan, as both pools read it: its runs (coalesced, aligned reads: plan_runs),
its rows (where each bundle lands) and its segments (what each row's values are and where
they go: the seg table, compile_segments), plus the checksums a read must match
(compile_checks). Built and validated here so that the native pool (_native.c) and the
pure-Python one (pool.py) run the same plan."""

import numpy as np

from .formats import DST_CODES, DTYPE_CODES, ITEMSIZE
from .quantized_rows import QUANT_CODE, Quantized, check_quantized

# the seg table's columns (int64), as _native.c's seg_t
SEG_FIELDS = ("off", "n", "src", "dst", "dst_addr", "dst_stride",
              "bits", "group", "scale", "scales_addr", "biases_addr", "table_stride")

NO_CHECKS = np.zeros((0, 3), dtype=np.int64)
NO_CRC = np.zeros(0, dtype=np.uint32)
NO_SEGS = np.zeros((0, len(SEG_FIELDS)), dtype=np.int64)


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


class Plan:
    """One batch, ready for a pool: run arrays, row arrays, segment table."""

    __slots__ = ("run_off", "run_len", "run_need", "run_stage", "row_start", "row_src",
                 "row_dst", "row_id", "segs", "seg_table", "stage_bytes", "slot_bytes",
                 "checks", "crc", "base", "stride")


def compile_segments(segments, stride):
    """-> (segs, seg table, bytes needed per bundle, rows every dst has, the column-form tables
    [(what, group, rows)]), or ValueError: what depends only on the segments."""
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
            qcols, nbytes, table_rows = check_quantized(off, n, src_dtype)
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


def compile_checks(crc, parts, need):
    """-> the checks table [(offset, length, column)] (int64), or ValueError."""
    if not (isinstance(crc, np.ndarray) and crc.dtype == np.uint32 and crc.ndim == 2
            and crc.flags.c_contiguous):
        raise ValueError("checks: crc must be a C-contiguous 2-D uint32 array")
    table = np.array(parts, dtype=np.int64).reshape(-1, 3)
    if ((table[:, 0] < 0) | (table[:, 1] < 0) | (table[:, 0] + table[:, 1] > need)
            | (table[:, 2] < 0) | (table[:, 2] >= crc.shape[1])).any():
        raise ValueError(f"checks: a part outside the {need} bytes read per bundle, or no such column")
    return table

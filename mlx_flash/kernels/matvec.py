"""The products and dequantizations of the native kernels (_matvec.c), over views of MLX's or
NumPy's memory: the quantized matvec and matmul of weights held at their bits (QuantMatrix,
qmv_many); products over a token's rows of a float32 or 16-bit matrix (gather_mv /
gather_axpy) and their pass forms (gather_mm, gather_mm_cols); and the same over packed rows
or columns read from flash (qmv_rows, qaxpy_cols, qmm_rows, qmm_cols, dequantize_rows,
dequantize_cols). Each takes the module that kernels_module() returns."""

import numpy as np

import mlx.core as mx

SCALE_CODE_OF = {"float32": 0, "float16": 1, "bfloat16": 2}  # _matvec.c's dtype codes, by name
SCALE_CODES = {getattr(mx, name): code for name, code in SCALE_CODE_OF.items()}


def host_f32(x):
    """An MLX array's values as a C-contiguous float32 NumPy vector (a view of its memory when
    it is one already: a decode step's input, evaluated here)."""
    if x.dtype != mx.float32:
        x = x.astype(mx.float32)
    mx.eval(x)
    return np.ascontiguousarray(np.array(x, copy=False).reshape(-1))


def _numpy(a):
    """A NumPy view of an evaluated MLX array's memory (bfloat16 as its uint16 bits)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=False)


class QuantMatrix:
    """A group-wise quantized [N, K] weight as MLX holds it (packed uint32 words, scales and
    biases [N, K / group]) seen by the kernels: views of MLX's memory, no copies."""

    def __init__(self, module, weight, scales, biases, bits, group_size):
        mx.eval(weight, scales, biases)
        if scales.dtype not in SCALE_CODES or biases.dtype != scales.dtype:
            raise ValueError(f"quantized weight: scales {scales.dtype} / biases {biases.dtype} are not "
                             "float32, float16 or bfloat16 alike")
        self._set(module, _numpy(weight), _numpy(scales), _numpy(biases), bits, group_size, SCALE_CODES[scales.dtype])
        self._keep = (weight, scales, biases)  # the views above point into these

    @classmethod
    def of_host(cls, module, w, s, b, bits, group_size):
        """The same over NumPy arrays (packed words [N, K * bits / 32] uint32, scales and biases
        [N, K / group] float32 / float16, bfloat16 as uint16) that are not MLX's: rows a store
        read into its own buffer (runtime/stores/attention.py). No copies."""
        code = SCALE_CODE_OF.get("bfloat16" if s.dtype == np.uint16 else str(s.dtype))
        if code is None or b.dtype != s.dtype or w.dtype != np.uint32:
            raise ValueError(f"quantized weight: words {w.dtype}, scales {s.dtype}, biases {b.dtype}")
        self = cls.__new__(cls)
        self._set(module, w, s, b, bits, group_size, code)
        self._keep = ()
        return self

    def _set(self, module, w, s, b, bits, group_size, code):
        self.kernels, self.bits, self.group_size, self.code = module, bits, group_size, code
        self.n, self.k = w.shape[0], w.shape[1] * 32 // bits
        self.w, self.s, self.b = w, s, b

    def matvec(self, x, out=None):
        """x: float32 NumPy [K] (contiguous) -> y [N] = x @ W.T."""
        y = np.empty(self.n, np.float32) if out is None else out
        self.kernels.qmv(x, self.w, self.s, self.b, y, self.n, self.k, self.bits, self.group_size, self.code)
        return y

    def matmul(self, x, out=None):
        """x: float32 NumPy [pos, K] (contiguous), a pass of several positions -> y [pos, N] =
        x @ W.T, each row dequantized once for all of them (qmm)."""
        y = np.empty((x.shape[0], self.n), np.float32) if out is None else out
        self.kernels.qmm(x, self.w, self.s, self.b, y, self.n, self.k, self.bits, self.group_size, self.code)
        return y

    def dequantize(self, start, stop, out):
        """Rows start .. stop-1 as float32 into `out` (a writable buffer of (stop - start) * K floats)."""
        self.kernels.dequantize(None, self.w[start:stop], self.s[start:stop], self.b[start:stop], out,
                                stop - start, self.k, self.bits, self.group_size, self.code)


def qmv_many(xs, mats, x_of, out=None):
    """[mats[i].matvec(xs[x_of[i]])] in one native call, its rows shared out as one job (a
    layer's routed experts: one call for every gate and up on one x, one for every down),
    each x prepared once. xs: float32 [K] vectors; mats: QuantMatrix of one module, all [N, K]
    at one width, group and scale dtype. -> float32 [len(mats), N] (into `out` when given)."""
    first = mats[0]
    y = np.empty((len(mats), first.n), np.float32) if out is None else out
    first.kernels.qmv_many(tuple(xs), tuple(m.w for m in mats), tuple(m.s for m in mats), tuple(m.b for m in mats),
                           tuple(x_of), y, first.n, first.k, first.bits, first.group_size, first.code)
    return y


def alike(mats):
    """Whether qmv_many may take these QuantMatrix together (one shape, width, group, scale dtype;
    at most the module's MAX_MANY)."""
    first = mats[0]
    return len(mats) <= first.kernels.MAX_MANY and all(
        (m.n, m.k, m.bits, m.group_size, m.code, m.kernels) ==
        (first.n, first.k, first.bits, first.group_size, first.code, first.kernels) for m in mats)


ROW_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2}


def row_code(w):
    """_matvec.c's code of a matrix's values: float32 0, float16 1, and 2 for uint16 (bfloat16's
    bits, as models/half.py views a bfloat16 weight)."""
    if w.dtype not in ROW_CODES:
        raise ValueError(f"the kernels take float32, float16 or bfloat16 (uint16) rows, not {w.dtype}")
    return ROW_CODES[w.dtype]


def gather_mv(kernels, x, w, sel):
    """[W[i] . x for i in sel]: x float32 [K], W NumPy [rows, K] (float32, float16, or uint16:
    bfloat16's bits; 16-bit values converted as they are read), sel int64 -> float32 [len(sel)]."""
    y = np.empty(len(sel), np.float32)
    kernels.gather_mv(x, w, sel, y, w.shape[1], False, row_code(w))
    return y


def gather_axpy(kernels, h, w, sel, out=None):
    """sum_i h[i] * W[sel[i]]: h float32 [len(sel)], W NumPy [rows, K] as gather_mv's -> float32 [K].
    out: a float32 [K] the sum is added to, term by term in the rows' order (a previous part's)."""
    y = np.empty(w.shape[1], np.float32) if out is None else out
    kernels.gather_axpy(h, w, sel, y, w.shape[1], out is not None, row_code(w))
    return y


def gather_mm(kernels, x, w, sel, code=None):
    """gather_mv for a pass of several positions (a batch's decode step): x float32 [pos, K] ->
    float32 [pos, len(sel)], each row of W (as gather_mv's) converted once, into a tile, for all
    of them. code: W's values' (row_code's guess from its dtype where None: uint16 as bfloat16)."""
    y = np.empty((x.shape[0], len(sel)), np.float32)
    kernels.gather_mm(x, w, sel, y, w.shape[1], False, row_code(w) if code is None else code)
    return y


def gather_mm_cols(kernels, h, w, sel, out=None):
    """gather_axpy for a pass of several positions: h float32 [pos, len(sel)] -> float32 [pos, K]
    = h @ W[sel], each row converted once for all positions. out: a float32 [pos, K] the sums are
    added to, term by term in the rows' order (a previous part's: the sums of one call over both)."""
    if len(sel) == 0:
        return np.zeros((h.shape[0], w.shape[1]), np.float32) if out is None else out
    y = np.empty((h.shape[0], w.shape[1]), np.float32) if out is None else out
    kernels.gather_mm_cols(h, w, sel, y, w.shape[1], out is not None, row_code(w))
    return y


def _int64(a):
    return np.ascontiguousarray(a, dtype=np.int64)


def qmv_rows(kernels, x, buf, sel, spec, scales_off, biases_off):
    """x @ row.T for the rows `sel` of `buf` (uint8 / any NumPy [rows, row_stride] bytes),
    each row's packed values (spec: QuantSpec) at byte 0, its scales and biases at their
    offsets -> float32 [len(sel)]."""
    y = np.empty(len(sel), np.float32)
    kernels.qmv_rows(x, buf, buf.strides[0], scales_off, biases_off, _int64(sel), y, x.size, spec.bits,
                     spec.group_size, SCALE_CODE_OF[spec.scale_dtype])
    return y


def qmm_rows(kernels, x, buf, sel, spec, scales_off, biases_off):
    """qmv_rows for a pass of several positions: x float32 [pos, K] -> float32 [pos, len(sel)],
    each row dequantized once for all of them."""
    y = np.empty((x.shape[0], len(sel)), np.float32)
    kernels.qmm_rows(x, buf, buf.strides[0], scales_off, biases_off, _int64(sel), y, x.shape[1], spec.bits,
                     spec.group_size, SCALE_CODE_OF[spec.scale_dtype])
    return y


def qmm_cols(kernels, h, buf, sel, trow, tables, spec, out=None):
    """qaxpy_cols for a pass of several positions: h float32 [pos, len(sel)] -> float32 [pos, d]
    = sum_i h[:, i] * column sel[i] (any row order), each column dequantized once for all
    positions. out: a float32 [pos, d] the sums are added to."""
    scales, biases = tables
    y = np.empty((h.shape[0], scales.shape[1]), np.float32) if out is None else out
    kernels.qmm_cols(h, buf, buf.strides[0], _int64(sel), _int64(trow), scales, biases, y, scales.shape[1],
                     spec.bits, SCALE_CODE_OF[spec.scale_dtype], out is not None)
    return y


def qaxpy_cols(kernels, h, buf, sel, trow, tables, spec, out=None):
    """sum_i h[i] * column sel[i] of `buf`, each packed values whose value c is
    scales[trow[i], c] * q + biases[trow[i], c] (tables: the layer's (scales, biases) as
    stored; sel ordered by trow) -> float32 [d]. out: a float32 [d] the sum is added to, group
    by group in the rows' order: where out holds whole groups of earlier rows (a previous
    part's), the result is the one a single call over all the rows gives, to the bit."""
    scales, biases = tables
    y = np.empty(scales.shape[1], np.float32) if out is None else out
    kernels.qaxpy_cols(h, buf, buf.strides[0], _int64(sel), _int64(trow), scales, biases, y, scales.shape[1],
                       spec.bits, SCALE_CODE_OF[spec.scale_dtype], out is not None)
    return y


def dequantize_rows(kernels, buf, sel, spec, scales_off, biases_off, k, out=None):
    """The values of rows `sel` of `buf` (as qmv_rows reads them) -> float32 [len(sel), k]
    (into `out`, a C-contiguous float32 [len(sel), k], when given)."""
    y = np.empty((len(sel), k), np.float32) if out is None else out
    kernels.dequantize_rows(None, buf, buf.strides[0], scales_off, biases_off, _int64(sel), y, k, spec.bits,
                            spec.group_size, SCALE_CODE_OF[spec.scale_dtype])
    return y


def dequantize_cols(kernels, buf, sel, trow, tables, spec, out=None):
    """The values of columns `sel` of `buf` (as qaxpy_cols reads them) -> float32 [len(sel), d]
    (into `out`, as dequantize_rows's)."""
    scales, biases = tables
    y = np.empty((len(sel), scales.shape[1]), np.float32) if out is None else out
    kernels.dequantize_cols(None, buf, buf.strides[0], _int64(sel), _int64(trow), scales, biases, y, scales.shape[1],
                            spec.bits, SCALE_CODE_OF[spec.scale_dtype])
    return y

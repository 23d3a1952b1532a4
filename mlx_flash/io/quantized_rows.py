"""Quantized: a read_bundles segment of group-wise affine quantized values (MLX's
mx.quantize layout), dequantized on copy; its checks (check_quantized: the seg table's
columns) and its dequantization in NumPy for the pure-Python pool (_native.c does the
same in C)."""

from dataclasses import dataclass

import numpy as np

from .formats import DTYPE_CODES, ITEMSIZE

QUANT_CODE = 3  # a Quantized segment's src code in the seg table
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)


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


TABLE_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                "bfloat16": np.dtype(np.uint16)}


def scales_f32(raw, scale_dtype):
    """Scale/bias values as stored (uint8 bytes or a table's row) -> float32, exactly."""
    if scale_dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(TABLE_DTYPES[scale_dtype]).astype(np.float32)


def unpack_py(packed, bits, n):
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


def dequant_py(stage, a, n, q, neuron, out):
    """stage[a:] holds a Quantized segment of n values (bundle id `neuron`) -> out."""
    pb = q.packed_bytes(n)
    vals = unpack_py(stage[a : a + pb], q.bits, n).astype(np.float32)
    if q.table is None:
        g, ssz = n // q.group_size, ITEMSIZE[q.scale_dtype]
        sb = scales_f32(stage[a + pb : a + pb + 2 * g * ssz], q.scale_dtype)
        scales = np.repeat(sb[:g], q.group_size)
        biases = np.repeat(sb[g:], q.group_size)
    else:
        t = neuron // q.group_size
        scales = scales_f32(q.table[0][t, :n], q.scale_dtype)
        biases = scales_f32(q.table[1][t, :n], q.scale_dtype)
    w = vals * scales  # float32, rounded; then the add, rounded: as the C code
    w += biases
    out[:] = w


def check_quantized(off, n, q):
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
    want = TABLE_DTYPES[q.scale_dtype]
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

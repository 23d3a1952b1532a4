"""Group-wise affine quantization as MLX defines it (`mx.quantize`), in NumPy.

A weight W [out, in] at `bits` bits with groups of `group_size` along `in` is
    packed  uint32 [out, in * bits / 32]: the values q (0 .. 2^bits - 1) as one
            little-endian bit stream per row (value k in bits k*bits .. k*bits + bits - 1;
            verified for 2/3/4/5/6/8 bits against mx.quantize in tests/test_quant.py)
    scales, biases [out, in / group_size], each value w = scale * q + bias.

The flash layout keeps these values bit-exact. A bundle holds a *row* of W
(its packed values, then its scales, then its biases), or a *column* of W: the
column's values packed the same way along `out`, whose scales cannot travel
with it (each value has its own group, one per row of W) and stay in DRAM as a
table (layout/format.py: `scales` files).
"""

from dataclasses import dataclass

import numpy as np

from ..errors import FlashError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class QuantSpec:
    """How a layout's rows are quantized (the same for every weight kind and layer)."""

    bits: int
    group_size: int
    scale_dtype: str  # float16 | bfloat16 | float32, of scales and biases

    def __post_init__(self):
        check_quant(self.bits, self.group_size)
        if self.scale_dtype not in SCALE_DTYPES:
            raise FlashError(f"quantization scales of dtype {self.scale_dtype} are not supported "
                             f"(choose from {', '.join(SCALE_DTYPES)})")

    def packed_bytes(self, n):
        """Bytes of n packed values."""
        return n * self.bits // 8

    def row_bytes(self, n):
        """A quantized row of n values with its scales and biases inline."""
        return self.packed_bytes(n) + 2 * (n // self.group_size) * SCALE_DTYPES[self.scale_dtype]

    def inline_offsets(self, n):
        """(scales, biases) byte offsets in a row of n values with its scales and biases inline."""
        scales = self.packed_bytes(n)
        return scales, scales + (n // self.group_size) * SCALE_DTYPES[self.scale_dtype]


def check_quant(bits, group_size, where=""):
    where = f"{where}: " if where else ""
    if bits not in BITS:
        raise FlashError(f"{where}{bits}-bit quantization is not supported (choose from "
                         f"{', '.join(map(str, BITS))})")
    if group_size not in GROUP_SIZES:
        raise FlashError(f"{where}quantization group size {group_size} is not supported (choose from "
                         f"{', '.join(map(str, GROUP_SIZES))})")


def unpack(packed, bits, n):
    """uint32 (or uint8) [..., words] -> uint8 values [..., n]."""
    raw = np.ascontiguousarray(packed).view(np.uint8)
    if bits == 8:
        return raw[..., :n].copy()
    if bits == 4:
        out = np.empty(raw.shape[:-1] + (raw.shape[-1] * 2,), dtype=np.uint8)
        out[..., 0::2] = raw & 0x0F
        out[..., 1::2] = raw >> 4
        return out[..., :n]
    b = np.unpackbits(raw, axis=-1, bitorder="little")[..., : n * bits]
    b = b.reshape(b.shape[:-1] + (n, bits))
    return (b << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)


def pack(q, bits):
    """uint8 values [..., n] -> uint8 bytes [..., n * bits / 8] (n * bits a multiple of 8)."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    n = q.shape[-1]
    if n * bits % 8:
        raise FlashError(f"{n} values at {bits} bits are not a whole number of bytes")
    if bits == 8:
        return q.copy()
    if bits == 4:
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    b = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(b.reshape(q.shape[:-1] + (n * bits,)), axis=-1, bitorder="little")


_WIDEN = {}  # (bits, to_bits) -> the table widening one packed byte


def widen(packed, bits, to_bits):
    """Packed values at `bits` -> the same values packed at `to_bits` (2 -> 4, 2 -> 8, 4 -> 8), uint32
    words [..., w] -> [..., w * to_bits / bits]. With the same scales and biases (group size
    unchanged) a weight keeps its every value: scale * q + bias. One table lookup per byte."""
    if (bits, to_bits) not in ((2, 4), (2, 8), (4, 8)):
        raise ValueError(f"packed values widen 2 -> 4, 2 -> 8 or 4 -> 8 bits, not {bits} -> {to_bits}")
    table = _WIDEN.get((bits, to_bits))
    if table is None:  # byte b holds 8 / bits values; they become 8 / bits values of to_bits each
        per, mask = 8 // bits, (1 << bits) - 1
        b = np.arange(256, dtype=np.uint32)
        wide = sum(((b >> (bits * j)) & mask) << (to_bits * j) for j in range(per))
        table = _WIDEN[(bits, to_bits)] = wide.astype(np.uint16 if per * to_bits == 16 else np.uint32)
    raw = np.ascontiguousarray(packed).view(np.uint8)
    return table[raw].view(np.uint32)


def to_words(packed_bytes):
    """uint8 [..., k] (k a multiple of 4) -> the uint32 words MLX keeps."""
    return np.ascontiguousarray(packed_bytes).view("<u4").astype(np.uint32, copy=False)


def dequantize(packed, scales, biases, bits, group_size, n):
    """NumPy reference of mx.dequantize in float32 (scales/biases already float32)."""
    q = unpack(packed, bits, n).astype(np.float32)
    s = np.repeat(np.asarray(scales, dtype=np.float32), group_size, axis=-1)
    b = np.repeat(np.asarray(biases, dtype=np.float32), group_size, axis=-1)
    return s * q + b


def columns(packed, bits, n_in):
    """The columns of a quantized W [out, in] as packed rows: [in, out * bits / 8] uint8
    (values unchanged, only their order)."""
    q = unpack(packed, bits, n_in)  # [out, in]
    return pack(np.ascontiguousarray(q.T), bits)


@dataclass
class QuantTensor:
    """A quantized weight as MLX keeps it: packed uint32 [out, in * bits / 32], scales and
    biases [out, in / group_size] in their storage form (bfloat16 as uint16)."""

    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    spec: QuantSpec

    @property
    def shape(self):
        """The weight's logical shape [out, in]."""
        return (self.packed.shape[0], self.packed.shape[1] * 32 // self.spec.bits)

    def dequantized(self):
        from .safetensors_io import from_storage

        s = from_storage(self.scales, self.spec.scale_dtype)
        b = from_storage(self.biases, self.spec.scale_dtype)
        return dequantize(self.packed, s, b, self.spec.bits, self.spec.group_size, self.shape[1])

    def rows(self, perm):
        """The same weight with its rows reordered (whole rows keep their groups: exact)."""
        return QuantTensor(np.ascontiguousarray(perm(self.packed)), np.ascontiguousarray(perm(self.scales)),
                           np.ascontiguousarray(perm(self.biases)), self.spec)


def quantize(w, bits, group_size, scale_dtype):
    """float [out, in] -> QuantTensor, by MLX's own mx.quantize on w at `scale_dtype`
    (what mlx_lm.convert -q does to a model held at that dtype)."""
    import mlx.core as mx

    from .safetensors_io import to_storage

    dt = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[scale_dtype]
    wq, s, b = mx.quantize(mx.array(np.asarray(w, dtype=np.float32)).astype(dt), group_size=group_size,
                           bits=bits)
    s, b = (np.array(x.astype(mx.float32)) for x in (s, b))
    return QuantTensor(np.array(wq), to_storage(s, scale_dtype), to_storage(b, scale_dtype),
                       QuantSpec(bits, group_size, scale_dtype))


def value_shapes(st, quantization):
    """{name: shape} of a resident safetensors file's tensors counted in values: a quantized
    weight (named in `quantization`, config.json's mlx-lm form) by the values its packed words
    hold, its scales and biases left out; every other tensor as stored."""
    names = set(st.names())
    out = {}
    for n in st.names():
        stem, part = n.rsplit(".", 1)
        q = quantization.get(stem) if stem + ".scales" in names else None
        if isinstance(q, dict):
            if part != "weight":
                continue
            shape = st.shape(n)
            out[n] = tuple(shape[:-1]) + (shape[-1] * 32 // q["bits"],)
        else:
            out[n] = tuple(st.shape(n))
    return out

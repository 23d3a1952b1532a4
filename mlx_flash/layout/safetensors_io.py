"""Streaming safetensors: read one tensor at a time, write tensor by tensor.

The format is an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw data. We parse it ourselves
so that a tensor is read with one pread (no mmap pages left resident, no whole
file in memory) and bfloat16 needs no framework.
"""

import json
import os
import struct

import numpy as np

from ..errors import FlashError

# safetensors dtype -> (numpy dtype used to hold the raw bytes, itemsize)
_RAW = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "U32": np.uint32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
NUMPY_TO_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
ST_TO_NUMPY = {v: k for k, v in NUMPY_TO_ST.items()}


def bf16_to_f32(raw_u16):
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round-to-nearest-even float32 -> bfloat16 bits (as uint16)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def to_storage(x, dtype):
    """float array -> numpy array holding `dtype`'s bytes (bf16 as uint16)."""
    if dtype == "bfloat16":
        return f32_to_bf16(x)
    return np.ascontiguousarray(x, dtype=dtype)


def from_storage(raw, dtype):
    """Bytes of `dtype` as held by numpy -> float32 numpy array."""
    if dtype == "bfloat16":
        return bf16_to_f32(raw.view(np.uint16))
    return raw.view(dtype).astype(np.float32)


class SafetensorsFile:
    """One .safetensors file, read tensor by tensor."""

    def __init__(self, path):
        self.path = str(path)
        try:
            self.size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("file too short")
                (n,) = struct.unpack("<Q", head)
                if n > self.size - 8 or n > 100_000_000:
                    raise ValueError("bad header length")
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise FlashError(f"{self.path}: not a readable safetensors file ({e})")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.tensors = header
        for name, info in header.items():
            end = self.data_start + info["data_offsets"][1]
            if end > self.size:
                raise FlashError(
                    f"{self.path}: truncated (tensor {name} ends at byte {end}, "
                    f"file has {self.size})"
                )

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name):
        return self.tensors[name]["dtype"]

    def read_raw(self, name):
        info = self.tensors[name]
        st_dtype = info["dtype"]
        if st_dtype not in _RAW:
            raise FlashError(f"{self.path}: tensor {name} has unsupported dtype {st_dtype}")
        start, end = info["data_offsets"]
        buf = bytearray(end - start)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + start)
            got = f.readinto(memoryview(buf))
        if got != len(buf):
            raise FlashError(f"{self.path}: short read of tensor {name}")
        return np.frombuffer(buf, dtype=_RAW[st_dtype]).reshape(info["shape"]), st_dtype

    def read(self, name):
        """The tensor as float32 (floating types) or its own integer dtype."""
        raw, st_dtype = self.read_raw(name)
        if st_dtype == "BF16":
            return bf16_to_f32(raw)
        if st_dtype in ("F16", "F64"):
            return raw.astype(np.float32)
        return raw


class SafetensorsWriter:
    """Write a safetensors file whose tensor list is known up front.

    `specs` is [(name, shape, dtype)] with dtype float32/float16/bfloat16 or a
    numpy integer dtype name; tensors are then written in that order with
    `write(name, array)`, so only one tensor is ever held in memory.
    """

    def __init__(self, path, specs, metadata=None):
        self.path = str(path)
        header = {}
        offset = 0
        self.order = []
        for name, shape, dtype in specs:
            st = NUMPY_TO_ST.get(dtype) or {
                "int32": "I32", "uint32": "U32", "int64": "I64", "uint8": "U8"
            }[dtype]
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_RAW[st]).itemsize
            header[name] = {
                "dtype": st,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self.order.append((name, tuple(shape), dtype, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * ((8 - len(blob) % 8) % 8)  # align data to 8 bytes
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(blob)))
        self.f.write(blob)
        self.next = 0

    def write(self, name, array, raw=False):
        """raw: `array` already holds the dtype's bytes (bfloat16 as uint16)."""
        want, shape, dtype, nbytes = self.order[self.next]
        if name != want or tuple(array.shape) != shape:
            raise ValueError(f"expected {want}{shape}, got {name}{tuple(array.shape)}")
        if raw:
            data = array
        else:
            data = to_storage(array, dtype) if dtype in NUMPY_TO_ST else array.astype(dtype)
        assert data.nbytes == nbytes
        self.f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
        self.next += 1

    def close(self):
        if self.next != len(self.order):
            self.f.close()
            raise ValueError(f"{self.path}: only {self.next} of {len(self.order)} tensors written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

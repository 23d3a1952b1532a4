"""Expert bundles (issue 12, EdgeMoE §3): a mixture-of-experts layer's experts on flash.

    experts/layer_NNN.bin     expert e's bundle at offset e * stride: its gate, up
                              and down projections back to back, each as MLX holds
                              a weight (a float matrix [out, in] at `dtype`, or a
                              quantized one: packed uint32 [out, in * bits / 32],
                              then scales [out, in / group], then biases), so that
                              one uncached read fetches one expert, in the very
                              form `mx.gather_qmm` / `mx.gather_mm` compute on
    experts/layer_NNN.crc32c  the CRC32C of each bundle's three parts, uint32 [E, 3]

gate and up are [d_expert, d_model], down [d_model, d_expert] (mlx_lm's
SwitchGLU). The router, attention, norms and shared experts are resident.
Layers without experts (Qwen3-MoE's `mlp_only_layers`) keep a dense MLP in the
resident file and have no entry (None) in the manifest's list.
"""

from dataclasses import dataclass

import numpy as np

from .quant import SCALE_DTYPES, QuantSpec

KINDS = ("gate", "up", "down")
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def round_up(n, align):
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class ExpertLayout:
    n_experts: int  # experts per MoE layer
    d_model: int
    d_expert: int  # the expert's hidden size (moe_intermediate_size)
    dtype: str  # a float layout's values (float32 | float16 | bfloat16)
    quant: QuantSpec | None = None
    align: int = 4096

    # what the tools that check files of bundles read of a layout (layout/verify.py, read_checksums)
    @property
    def kinds(self):
        return KINDS

    @property
    def n_neurons(self):  # (bundles per file: here experts)
        return self.n_experts

    def shape(self, kind):
        """The weight's [out, in] as mlx_lm holds it."""
        return (self.d_model, self.d_expert) if kind == "down" else (self.d_expert, self.d_model)

    def arrays(self, kind):
        """[(name, shape, storage dtype)] of one kind's part, in bundle order."""
        out, n_in = self.shape(kind)
        if self.quant is None:
            return [("weight", (out, n_in), self.dtype)]
        q = self.quant
        groups = (out, n_in // q.group_size)
        return [("weight", (out, n_in * q.bits // 32), "uint32"), ("scales", groups, q.scale_dtype),
                ("biases", groups, q.scale_dtype)]

    def array_bytes(self, kind, name):
        for n, shape, dt in self.arrays(kind):
            if n == name:
                size = 4 if dt == "uint32" else (FLOAT_BYTES.get(dt) or SCALE_DTYPES[dt])
                return int(np.prod(shape)) * size
        raise KeyError(name)

    def array_offset(self, kind, name):
        """Byte offset of one array of one kind in a bundle."""
        off = 0
        for k in KINDS:
            for n, _, _ in self.arrays(k):
                if (k, n) == (kind, name):
                    return off
                off += self.array_bytes(k, n)
        raise KeyError((kind, name))

    def kind_bytes(self, kind):
        return sum(self.array_bytes(kind, n) for n, _, _ in self.arrays(kind))

    def parts(self):
        """[(offset, bytes)] of each kind's part: what a checksum covers."""
        return [(self.array_offset(k, "weight"), self.kind_bytes(k)) for k in KINDS]

    @property
    def bundle_bytes(self):
        return sum(self.kind_bytes(k) for k in KINDS)

    @property
    def stride(self):
        return round_up(self.bundle_bytes, self.align)

    @property
    def file_size(self):
        return self.n_experts * self.stride

    def pack(self, arrays):
        """{(kind, name): array in its storage form} of one expert -> its padded bundle (uint8)."""
        buf = np.zeros(self.stride, dtype=np.uint8)
        for k in KINDS:
            for n, shape, _ in self.arrays(k):
                a = np.ascontiguousarray(arrays[(k, n)])
                if a.shape != tuple(shape) or a.nbytes != self.array_bytes(k, n):
                    raise ValueError(f"expert {k}.{n}: expected {shape} ({self.array_bytes(k, n)} bytes), "
                                     f"got {a.dtype} {a.shape}")
                off = self.array_offset(k, n)
                buf[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        return buf

    def to_dict(self):
        return {"n_experts": self.n_experts, "d_model": self.d_model, "d_expert": self.d_expert,
                "dtype": self.dtype, "align": self.align,
                "quant": None if self.quant is None else vars(self.quant).copy()}

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        if d.get("quant") is not None:
            d["quant"] = QuantSpec(**d["quant"])
        return cls(**d)

"""Expert bundles (EdgeMoE §3): a mixture-of-experts layer's experts on flash.

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

Experts at their own bit widths (EdgeMoE §3.2, `convert --expert-bits`): a layer whose experts
differ in bits has one file per width, `experts/layer_NNN.bB.bin` (+ .crc32c), holding its
experts of that width in ascending order; its manifest entry is {"groups": [{"bits", "experts",
file entry...}]}. The manifest's layout is then the widest experts': the form the expert buffer
holds every expert in (narrower values widened exactly on reading: quant.widen).
Layers without experts (Qwen3-MoE's `mlp_only_layers`) keep a dense MLP in the
resident file and have no entry (None) in the manifest's list.
"""

from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class ExpertGroup:
    """A file of one layer's experts at one precision: its manifest entry, its layout, the experts
    (ascending) its bundles hold, in order."""

    entry: dict
    layout: ExpertLayout
    experts: np.ndarray

    @property
    def bits(self):
        return None if self.layout.quant is None else self.layout.quant.bits


def group_layout(layout, bits, n_experts):
    """The layout of `n_experts` of a layer stored at `bits` (the rest of `layout` kept)."""
    return replace(layout, n_experts=n_experts, quant=replace(layout.quant, bits=bits))


def layer_groups(section, layer):
    """[ExpertGroup] of a layer of the manifest's experts section (empty: a layer without experts)."""
    entry, lay = section["files"][layer], section["layout"]
    if entry is None:
        return []
    if "groups" not in entry:
        return [ExpertGroup(entry, lay, np.arange(lay.n_experts))]
    return [ExpertGroup(g, group_layout(lay, g["bits"], len(g["experts"])), np.array(g["experts"], dtype=np.int64))
            for g in entry["groups"]]


def all_groups(section):
    """[ExpertGroup] of every layer of the experts section, in layer order."""
    return [g for i in range(len(section["files"])) for g in layer_groups(section, i)]


def expert_files(section):
    """Every file entry of the experts section (one per layer, or one per layer and bit width)."""
    return [g.entry for g in all_groups(section)]


def expert_bits(section):
    """[bits of each expert | None per layer], or None when every expert has the layout's precision."""
    if not any(e is not None and "groups" in e for e in section["files"]):
        return None
    out = []
    for layer in range(len(section["files"])):
        groups = layer_groups(section, layer)
        if not groups:
            out.append(None)
            continue
        bits = np.zeros(section["layout"].n_experts, dtype=np.int64)
        for g in groups:
            bits[g.experts] = g.bits
        out.append(bits.tolist())
    return out

"""What the converter does with each weight's precision, and the quantized bundle parts.

Rules (one per tensor, printed when a value changes):
- a weight the source stores in MLX's affine form (an mlx-lm quantized folder;
  GGUF Q4_0 / Q4_1 / Q8_0) is kept as it is, bit-exact, unless --q-bits /
  --q-group-size ask for another form (then it is re-quantized);
- GGUF Q4_K / Q5_K are MLX affine groups of 32 too (convert/kquants.py: the values
  kept, each group's scale and bias rounded once to float16; Q5_K at 8 bits);
- a weight quantized in a form with no such MLX equivalent (GGUF Q6_K, Q2_K, Q3_K,
  Q5_x) is dequantized and re-quantized (--q-bits; by default 8 bits for Q6_K and Q5_x,
  4 for Q2_K / Q3_K: the widths with fast kernels; group 32 or --q-group-size);
- a float weight is quantized only with --quantize (as mlx_lm.convert -q does:
  mx.quantize of the weight at --dtype, so both give the same values);
- --dequantize: every weight float at --dtype (the layout of version 1);
- --q-keep embed,lm_head,attn: those parts stay float at --dtype; attn:A-B (or attn:A) only
  in layers A..B, repeatable (attn:0-1,attn:30-31: the first and last two layers, a common
  choice for keeping quality at few bits).
Only 2-D `.weight` tensors whose input dimension is a multiple of the group size
are quantized (norms and biases stay float), like mlx_lm.
"""

import re
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..errors import FlashError
from ..layout.quant import QuantSpec, QuantTensor, check_quant, columns, pack, quantize, to_words, unpack

KEEP_PARTS = ("embed", "lm_head", "attn")
PER_LAYER_PARTS = ("attn",)  # parts a --q-keep item may restrict to layers (part:A-B)
EXPERT_BITS = (2, 4, 8)  # the widths an expert may have (widened exactly to the widest: layout/quant.widen)
# GGUF types with no exact MLX form -> the bits they are re-quantized to by default: the
# widths with fast kernels (4 and 8), at least the type's own (Q6_K at 8 bits changes a
# value by at most half an 8-bit step of its group's range)
LOSSY_BITS = {"Q2_K": 4, "Q3_K": 4, "Q6_K": 8}


@dataclass(frozen=True)
class QuantOptions:
    quantize: bool = False  # quantize float weights too (--quantize)
    bits: int | None = None  # --q-bits
    group_size: int | None = None  # --q-group-size
    dequantize: bool = False  # --dequantize: everything float
    keep: tuple = ()  # --q-keep: parts that stay float ("attn", or "attn:0-1" for some layers)
    # --expert-bits (a mixture of experts): per layer, each expert's bits (a tuple), or None (no experts)
    expert_bits: tuple | None = None
    # --ffn-bits: the one width of the feed-forward weights when the source's differ (default: the widest)
    ffn_bits: int | None = None

    def __post_init__(self):
        if self.dequantize and (self.quantize or self.bits or self.group_size or self.expert_bits):
            raise FlashError("--dequantize cannot be combined with --quantize / --q-bits / --q-group-size / "
                             "--expert-bits")
        if self.expert_bits is not None and self.bits is not None:
            raise FlashError("--expert-bits gives the experts' bits: drop --q-bits")
        for layer, bits in enumerate(self.expert_bits or ()):
            bad = [b for b in bits or () if b not in EXPERT_BITS]
            if bad:
                raise FlashError(f"--expert-bits: layer {layer} has an expert at {bad[0]} bits "
                                 f"(choose from {', '.join(map(str, EXPERT_BITS))})")
        check_quant(self.bits or 4, self.group_size or 64)
        if self.ffn_bits is not None and (self.dequantize or self.bits):
            raise FlashError("--ffn-bits chooses among the source's widths: drop --q-bits / --dequantize")
        if self.ffn_bits is not None:
            check_quant(self.ffn_bits, self.group_size or 64)
        for item in self.keep:
            _keep_item(item)

    def keeps(self, name):
        """Does --q-keep hold the tensor `name` float?"""
        part, layer = part_of(name), layer_of(name)
        for item in self.keep:
            p, layers = _keep_item(item)
            if p == part and (layers is None or (layer is not None and layers[0] <= layer <= layers[1])):
                return True
        return False

    def check_layers(self, n_layers):
        """Every layer a --q-keep item names exists in this model."""
        for item in self.keep:
            _, layers = _keep_item(item)
            if layers is not None and layers[1] >= n_layers:
                raise FlashError(f"--q-keep {item}: the model has layers 0-{n_layers - 1}")

    def key(self):
        key = [self.quantize, self.bits, self.group_size, self.dequantize, sorted(self.keep)]
        if self.ffn_bits is not None:
            key.append({"ffn_bits": self.ffn_bits})
        return key if self.expert_bits is None else key + [[list(b) if b else None for b in self.expert_bits]]


def _keep_item(item):
    """'attn' -> ("attn", None); 'attn:2-5' -> ("attn", (2, 5)); 'attn:3' -> ("attn", (3, 3))."""
    part, _, layers = item.partition(":")
    if part not in KEEP_PARTS:
        raise FlashError(f"--q-keep {item}: unknown part (choose from {', '.join(KEEP_PARTS)})")
    if not layers:
        return part, None
    if part not in PER_LAYER_PARTS:
        raise FlashError(f"--q-keep {item}: {part} is not per layer (only {', '.join(PER_LAYER_PARTS)} takes :A-B)")
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", layers)
    if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
        raise FlashError(f"--q-keep {item}: layers as A or A-B with A <= B (e.g. {part}:0-1)")
    first = int(m.group(1))
    return part, (first, int(m.group(2)) if m.group(2) is not None else first)


def layer_of(name):
    """The layer index in a tensor's name (model.layers.3.…, model.decoder.layers.3.…), or None."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def part_of(name):
    """The --q-keep part a tensor belongs to, or None (the FFN, norms)."""
    if "embed" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".self_attn." in name:
        return "attn"
    return None


def target(src, name, shape, options, dtype, notes):
    """-> ("float", None) | ("keep", spec) | ("quantize", spec) for one source tensor."""
    if options.dequantize or len(shape) != 2 or not name.endswith(".weight"):
        return "float", None
    # sources that hold float weights only (the benchmarks' random checkpoints) have no quant()
    exact = src.quant(name) if hasattr(src, "quant") else None
    lossy = src.lossy(name) if hasattr(src, "lossy") else None
    if options.keeps(name):
        return "float", None
    if exact is not None and options.bits in (None, exact.bits) and options.group_size in (None, exact.group_size):
        return "keep", exact
    if exact is None and lossy is None and not options.quantize:
        return "float", None
    bits = options.bits or (exact.bits if exact else LOSSY_BITS.get(lossy, 8) if lossy else 4)
    group = options.group_size or (exact.group_size if exact else 32 if lossy else 64)
    if shape[1] % group:
        notes.add(f"{name}: input dimension {shape[1]} is not a multiple of {group}; kept at {dtype}")
        return "float", None
    if lossy is not None:
        notes.add(f"GGUF {lossy} tensors have no exact MLX form: dequantized and re-quantized to {bits}-bit "
                  f"affine, group {group} (values change slightly; --q-bits chooses)")
    elif exact is not None:
        notes.add(f"{exact.bits}-bit group-{exact.group_size} tensors re-quantized to {bits}-bit group {group} "
                  "(values change)")
    return "quantize", QuantSpec(bits, group, dtype if exact is None else exact.scale_dtype)


def read_weight(src, name, decision):
    """The tensor at its target precision: float32 numpy, or a QuantTensor."""
    kind, spec = decision
    if kind == "float":
        return src.read(name)
    if kind == "keep":
        return src.read_quantized(name)
    if kind == "widen":  # the same values and scales, each value in more bits
        w = src.read_quantized(name)
        q = unpack(w.packed, w.spec.bits, w.shape[1])
        return QuantTensor(to_words(pack(q, spec.bits)), w.scales, w.biases, spec)
    return quantize(src.read(name), spec.bits, spec.group_size, spec.scale_dtype)


def ffn_spec(decisions, where, notes=None, bits=None):
    """The one QuantSpec every FFN weight is stored at, or None for a float layout. Quantized
    weights that differ only in bits (GGUF Q4_0 / Q4_1 beside Q8_0, Q4_K beside Q6_K) are all
    held at one width: `bits` (--ffn-bits), else the widest the source stores exactly (no kept
    value changes), else the widest. Kept weights narrower than it are widened exactly (a
    4-bit value is an 8-bit value with the same scale and bias); weights re-quantized anyway
    (a Q6_K beside Q4_K) are re-quantized to it. A Q4_K_M GGUF's FFN is thus held at 4 bits
    (its perplexity against llama.cpp's, and against --ffn-bits 8: benchmarks/qwen-1.5b).
    `decisions` is updated."""
    specs = {spec for kind, spec in decisions.values()}
    if None not in specs and len({(s.group_size, s.scale_dtype) for s in specs}) == 1 and \
            (len(specs) > 1 or (bits is not None and next(iter(specs)).bits != bits)):
        first = next(iter(specs))
        kept = [spec for kind, spec in decisions.values() if kind == "keep"] or list(specs)
        wide = max(kept, key=lambda s: s.bits) if bits is None else QuantSpec(bits, first.group_size,
                                                                               first.scale_dtype)
        for name, (kind, spec) in decisions.items():
            if spec != wide:
                narrower = spec.bits < wide.bits
                decisions[name] = ("widen" if kind == "keep" and narrower else
                                   "quantize" if kind == "keep" else kind, wide)
        if notes is not None:
            notes.add(f"the feed-forward weights are stored at {', '.join(sorted(str(s.bits) for s in specs))} "
                      f"bits: all held at {wide.bits} bits ("
                      + ("the source's exact values unchanged, the re-quantized ones re-quantized to it; "
                         "--ffn-bits chooses another width" if bits is None else
                         "--ffn-bits: narrower values widened unchanged, wider ones re-quantized") + ")")
    specs = Counter(spec for _, spec in decisions.values())
    if len(specs) == 1:
        return next(iter(specs))
    found = ", ".join(f"{n} at {'float' if s is None else f'{s.bits}-bit group {s.group_size} ({s.scale_dtype} scales)'}"
                      for s, n in specs.most_common())
    raise FlashError(f"{where}: the feed-forward weights are stored at different precisions ({found}); "
                     "the flash layout holds one: choose it with --q-bits / --q-group-size, or --dequantize")


def report(notes):
    for note in sorted(notes):
        print(f"[mlx_flash] convert: {note}", file=sys.stderr)


# --- bundle parts (layout/format.py's BundleLayout.pack takes them per kind)


def row_parts(w):
    """A quantized W [out, in] -> per row: its packed values, scales, biases (uint8 [out, ...])."""
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(w.packed.shape[0], -1)
                           for a in (w.packed, w.scales, w.biases)], axis=1)


def column_parts(w):
    """A quantized W [out, in] -> (per column: its packed values [in, out*bits/8],
    the table (scales, biases) [in / group, out])."""
    n_in = w.shape[1]
    return columns(w.packed, w.spec.bits, n_in), (np.ascontiguousarray(w.scales.T),
                                                   np.ascontiguousarray(w.biases.T))

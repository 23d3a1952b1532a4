"""A mixture-of-experts model -> the flash layout's expert bundles (layout/experts.py).

Sources: a Hugging Face folder (one tensor per expert: Mixtral's experts.E.w1/w2/w3,
Qwen's / OLMoE's experts.E.gate_proj/up_proj/down_proj) or an mlx-lm folder (the
experts of a layer stacked: switch_mlp.gate_proj.weight [E, out, in], quantized or not).
Streaming: one layer's experts of one kind in memory at a time, so a model larger than
the machine's memory converts. Precision, one for all experts: an mlx-lm folder's
quantized experts keep their values bit-exact; float experts stay float at --dtype
unless --quantize (-q) asks for --q-bits / --q-group-size (mlx_lm.convert -q's values);
--dequantize makes everything float. Everything that is not an expert (router,
attention, norms, embeddings, shared experts, dense layers) is resident, as for a dense
model.
"""

import numpy as np

from ..errors import FlashError
from ..layout.experts import KINDS, ExpertLayout, group_layout
from ..layout.format import MOE_VERSION, BundleLayout, Manifest, checksum_name, write_manifest
from ..layout.quant import QuantSpec, QuantTensor, quantize
from ..layout.safetensors_io import to_storage
from .writer import (_nbytes, _progress, _resident_specs, _write_config, _write_resident, bundle_entry,
                      write_packed)
from .quantize import LOSSY_BITS, report, target


class ExpertSource:
    """A source's experts, by (layer, kind, expert), at the source's own precision."""

    def __init__(self, src, original, tensors, where):
        self.src, self.original, self.tensors = src, original, tensors
        first = next((t for t in tensors.values() if t is not None), None)
        if first is None:
            raise FlashError(f"{where}: config.json gives this model no layer with experts")
        stacked, per_expert = first["gate"]
        self.stacked = stacked in original
        for layer, t in tensors.items():
            for kind, (stacked, per_expert) in (t or {}).items():
                names = [stacked] if self.stacked else per_expert
                missing = [n for n in names if n not in original]
                if missing:
                    raise FlashError(f"{where}: no tensor {missing[0]} (nor mlx-lm's stacked {stacked}); "
                                     "is config.json right for these weights?")
        self._layer = None  # the layer whose stacked tensors are held (one layer's three kinds)
        self._stack = {}

    def names(self):
        """The source names of every expert tensor (not resident)."""
        out = set()
        for t in self.tensors.values():
            for stacked, per_expert in (t or {}).values():
                out.update([stacked] if self.stacked else per_expert)
        return out

    def _name(self, layer, kind, e):
        stacked, per_expert = self.tensors[layer][kind]
        return self.original[stacked if self.stacked else per_expert[e]]

    def spec(self, layer, kind):
        """The QuantSpec the source stores this layer's experts of `kind` at exactly, or None."""
        name = self._name(layer, kind, 0)
        return self.src.quant(name) if hasattr(self.src, "quant") else None

    def lossy(self, layer, kind):
        """The source's quantized type with no exact MLX form (a GGUF K-quant) of these experts, or None."""
        name = self._name(layer, kind, 0)
        return self.src.lossy(name) if hasattr(self.src, "lossy") else None

    def weight(self, layer, kind, e):
        """Expert e's weight: float32 [out, in], or a QuantTensor as stored."""
        name = self._name(layer, kind, e)
        exact = self.spec(layer, kind)
        if not self.stacked:
            return self.src.read_quantized(name) if exact is not None else self.src.read(name)
        if self._layer != layer:  # one layer's experts at a time (a bundle holds all three kinds)
            self._stack, self._layer = {}, layer
        if kind not in self._stack:
            self._stack[kind] = self.src.read_quantized(name) if exact is not None else self.src.read(name)
        s = self._stack[kind]
        if isinstance(s, QuantTensor):
            return QuantTensor(s.packed[e], s.scales[e], s.biases[e], s.spec)
        return s[e]


def expert_spec(experts, first_layer, options, dtype, notes):
    """The one QuantSpec the experts are stored at (None: float at dtype); with --expert-bits, the
    widest experts' (what the expert buffer holds every expert at)."""
    exact = experts.spec(first_layer, "gate")
    if options.dequantize:
        return None
    if options.expert_bits is not None:
        bits = max(b for layer in options.expert_bits if layer for b in layer)
        group = options.group_size or (exact.group_size if exact else 64)
        notes.add("experts at their own bits (--expert-bits): those whose bits or group size differ from the "
                  "source's are re-quantized (values change)")
        return QuantSpec(bits, group, exact.scale_dtype if exact else dtype)
    if exact is not None and options.bits in (None, exact.bits) and options.group_size in (None, exact.group_size):
        return exact
    lossy = experts.lossy(first_layer, "gate") if exact is None else None
    if lossy is not None:  # (a K-quant: quantized, but in no form MLX computes on)
        bits, group = options.bits or LOSSY_BITS.get(lossy, 8), options.group_size or 32
        notes.add(f"GGUF {lossy} experts have no exact MLX form: dequantized and re-quantized to {bits}-bit group "
                  f"{group} (values change; --q-bits / --q-group-size choose, --dequantize keeps them float)")
        return QuantSpec(bits, group, dtype)
    if exact is None and not options.quantize:
        return None
    bits, group = options.bits or (exact.bits if exact else 4), options.group_size or (exact.group_size if exact else 64)
    if exact is not None:
        notes.add(f"{exact.bits}-bit group-{exact.group_size} experts re-quantized to {bits}-bit group {group} "
                  "(values change)")
    return QuantSpec(bits, group, exact.scale_dtype if exact else dtype)


def expert_arrays(w, layout, kind, where):
    """A source weight -> {(kind, name): array in storage form} at the layout's precision."""
    want = layout.shape(kind)
    got = w.shape if isinstance(w, QuantTensor) else tuple(w.shape)
    if tuple(got) != want:
        raise FlashError(f"{where}: {kind} has shape {tuple(got)}, expected {want} (d_model {layout.d_model}, "
                         f"expert size {layout.d_expert})")
    q = layout.quant
    if q is None:
        w = w.dequantized() if isinstance(w, QuantTensor) else w
        return {(kind, "weight"): to_storage(np.asarray(w, dtype=np.float32), layout.dtype)}
    if not (isinstance(w, QuantTensor) and w.spec == q):
        w = quantize(w.dequantized() if isinstance(w, QuantTensor) else w, q.bits, q.group_size, q.scale_dtype)
    return {(kind, "weight"): w.packed, (kind, "scales"): w.scales, (kind, "biases"): w.biases}


def write_moe_folder(src, tmp, source_name, dtype, align, progress, dip, journal, options, family, args):
    if dip:
        raise FlashError(f"{source_name}: --dip writes neuron bundles for input pruning; a mixture-of-experts "
                         "model's experts are read whole (drop --dip)")
    n_layers = args.num_hidden_layers
    options.check_layers(n_layers)
    canonical = getattr(family, "canonical_name", lambda name: name)
    original = {canonical(n): n for n in src.names()}
    tensors = {i: family.expert_tensors(args, i) for i in range(n_layers)}
    experts = ExpertSource(src, original, tensors, source_name)
    notes = set()
    first = min(i for i, t in tensors.items() if t is not None)
    spec = expert_spec(experts, first, options, dtype, notes)
    if spec is not None and (args.hidden_size % spec.group_size or args.d_expert % spec.group_size):
        raise FlashError(f"{source_name}: hidden size {args.hidden_size} and expert size {args.d_expert} must be "
                         f"multiples of the quantization group size {spec.group_size}")
    layout = ExpertLayout(args.n_experts, args.hidden_size, args.d_expert, dtype, spec, align)
    bits_of = _expert_bits(options.expert_bits, tensors, args.n_experts, source_name)
    expert_names = experts.names()
    resident = []
    for name, orig in original.items():
        if name in expert_names:
            continue
        new = family.resident_name(args, name)
        if new is not None:
            decision = target(src, orig, src.shape(orig), options, dtype, notes)
            resident.append((orig, new, src.shape(orig), decision))
    resident_specs = [e for _, new, shape, dec in resident for e in _resident_specs(new, shape, dtype, dec)]
    moe_layers = [i for i, t in tensors.items() if t is not None]
    total = sum(_nbytes(shape, dt) for _, shape, dt in resident_specs) + sum(
        g.file_size for i in moe_layers for g, _ in _groups(layout, bits_of[i]))
    report(notes)
    bar = _progress(total, progress, "convert")
    quantized_modules = _write_resident(src, tmp, resident, resident_specs, dtype, bar, journal)
    (tmp / "experts").mkdir(exist_ok=True)
    files = []
    for layer in range(n_layers):
        if tensors[layer] is None:
            files.append(None)
            continue
        groups = _groups(layout, bits_of[layer])
        entries = []
        for glay, ids in groups:
            rel = f"experts/layer_{layer:03d}.bin" if glay is layout else \
                f"experts/layer_{layer:03d}.b{glay.quant.bits}.bin"
            if journal.has(rel) and journal.has(checksum_name(rel)):  # written by an earlier run
                entries.append(bundle_entry(tmp, rel, journal))
                bar.update(glay.file_size)
                continue
            entries.append(write_packed(tmp, rel, _bundles(experts, glay, layer, source_name, ids), glay.parts(),
                                        bar, journal))
        if groups[0][0] is layout:  # every expert at the layout's precision: the plain form
            files.append(entries[0])
        else:
            files.append({"groups": [dict(e, bits=glay.quant.bits, experts=ids.tolist())
                                     for e, (glay, ids) in zip(entries, groups)]})
    resident_entry = _write_config(src, tmp, journal, quantized_modules)
    manifest = Manifest(
        model_type=args.model_type,
        dtype=dtype,
        # (no neuron bundles: an empty FFN layout keeps the manifest's shape for the tools that read it)
        layout=BundleLayout(KINDS, args.hidden_size, 0, dtype, align, spec),
        ffn_files=[],
        resident=resident_entry,
        source=source_name,
        options={"quant": options.key()},
        experts={"layout": layout, "files": files},
        version=MOE_VERSION,
    )
    write_manifest(tmp, manifest)
    bar.close()


def _expert_bits(expert_bits, tensors, n_experts, where):
    """--expert-bits checked against the model -> {layer: bits of each expert (array) | None}."""
    if expert_bits is None:
        return {i: None for i in tensors}
    if len(expert_bits) != len(tensors):
        raise FlashError(f"{where}: --expert-bits gives {len(expert_bits)} layers, the model has {len(tensors)}")
    out = {}
    for i, bits in enumerate(expert_bits):
        if (bits is None) != (tensors[i] is None):
            raise FlashError(f"{where}: --expert-bits layer {i}: " + ("the layer has experts: give their bits"
                             if bits is None else "the layer has no experts (give null)"))
        if bits is not None and len(bits) != n_experts:
            raise FlashError(f"{where}: --expert-bits layer {i} gives {len(bits)} experts' bits, the layer has "
                             f"{n_experts}")
        out[i] = None if bits is None else np.array(bits, dtype=np.int64)
    return out


def _groups(layout, bits):
    """[(layout, expert ids)] of one layer's files: one at the layout's precision, or one per width."""
    if bits is None or np.all(bits == layout.quant.bits):
        return [(layout, np.arange(layout.n_experts))]
    return [(group_layout(layout, int(b), int((bits == b).sum())), np.flatnonzero(bits == b))
            for b in np.unique(bits)]


def _bundles(experts, layout, layer, where, ids=None):
    """Layer `layer`'s expert bundles (of the experts `ids`; all by default), one [1, stride] chunk
    each, in file order."""
    for e in (range(layout.n_experts) if ids is None else ids):
        arrays = {}
        for kind in KINDS:
            arrays |= expert_arrays(experts.weight(layer, kind, e), layout, kind,
                                    f"{where}: layer {layer}, expert {e}")
        yield layout.pack(arrays).reshape(1, -1)

"""Per-expert bit widths chosen on calibration text under a perplexity tolerance (EdgeMoE §3.2):
`mlx_flash.convert --expert-bits auto --max-ppl-loss 0.05`.

On a reference conversion whose experts are float (the source's values exactly), held whole in
DRAM, the calibration text's perplexity is measured with the experts' values replaced by their
quantized values (quantize then dequantize, as the converter would write them):
1. the bounds: every expert at each candidate width; `high` is the narrowest width within the
   tolerance of the float experts, `low` the next narrower candidate (EdgeMoE's "upper and lower
   bound of bitwidth");
2. importance, by `importance`:
   - "perplexity" (EdgeMoE's): all experts at `high`, each expert alone at `low`, its perplexity
     rise: one evaluation per expert;
   - "output" (the default): one pass records each MoE layer's input and routing; an expert's
     importance is the error its `low` values add to its layer's output over the tokens routed
     to it (routing weight x |f_low(x) - f_high(x)|^2), relative to the layer's output energy:
     one evaluation in all, a proxy of the first;
3. the K least important experts at `low`, the rest at `high`: the largest K within the tolerance,
   by bisection over K (EdgeMoE grows K step by step; bisection takes log2(experts) evaluations and
   assumes the loss grows with K, which it does but for noise).
The cost is 2 + |candidates| + log2(experts) evaluations of the calibration tokens (+ one per expert
with importance "perplexity": for hundreds of experts, hours); the reference must fit in DRAM (the
search refuses otherwise).
"""

import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import FlashError
from .quantize import EXPERT_BITS


@dataclass
class ExpertBitsChoice:
    bits: tuple  # per layer: each expert's bits (a tuple), or None (a layer without experts)
    tolerance: float
    reference_ppl: float  # the float experts' perplexity on the calibration tokens
    uniform_ppl: dict  # {bits: perplexity with every expert at those bits}
    high: int
    low: int | None
    importance_kind: str = "output"
    importance: list = field(default_factory=list)  # per layer: each expert's importance (see the docstring)
    k: int = 0  # experts at `low`
    ppl: float = 0.0  # the chosen widths' perplexity on the calibration tokens
    tokens: int = 0
    evaluations: int = 0
    seconds: float = 0.0

    def as_dict(self):
        return {k: (v if k != "bits" else [list(b) if b else None for b in v]) for k, v in vars(self).items()}

    def summary(self):
        counts = {}
        for layer in self.bits:
            for b in layer or ():
                counts[b] = counts.get(b, 0) + 1
        mean = sum(b * n for b, n in counts.items()) / max(1, sum(counts.values()))
        return (f"expert bits: {', '.join(f'{n} at {b}-bit' for b, n in sorted(counts.items()))} (mean {mean:.2f}); "
                f"calibration perplexity {self.ppl:.3f} against {self.reference_ppl:.3f} with float experts "
                f"(+{100 * (self.ppl / self.reference_ppl - 1):.1f} %, tolerance {100 * self.tolerance:.0f} %; "
                f"every expert at {self.high}-bit: {self.uniform_ppl[self.high]:.3f}); {self.evaluations} "
                f"evaluations of {self.tokens} tokens, {self.seconds:.0f} s")


class _Experts:
    """The float experts of a dense-loaded model's store, each settable to its quantized values."""

    def __init__(self, store, group_size):
        from ..layout.experts import KINDS

        if store.layout.quant is not None:
            raise FlashError("the bit-width search needs float experts (the reference is converted with "
                             "--dequantize)")
        lay = store.layout
        if lay.d_model % group_size or lay.d_expert % group_size:
            raise FlashError(f"hidden size {lay.d_model} and expert size {lay.d_expert} must be multiples of the "
                             f"quantization group size {group_size} (--q-group-size)")
        self.store, self.group_size, self.kinds = store, group_size, KINDS
        self.E = store.layout.n_experts
        self.views = {k: np.array(store.weights[k], copy=False) for k in KINDS}  # [slots, out, in]
        self.original = {k: v.copy() for k, v in self.views.items()}
        self.layers = store.layers
        self.bits = {}  # (layer, e) -> bits now set (absent: float)
        self.keep = ()  # the widths whose values are kept once computed (the search's two)
        self._cache = {}  # (layer, e, bits) -> {kind: values}

    def slot(self, layer, e):
        return int(self.store.cache.slot_of[layer * self.E + e])

    def values(self, kind, slot, bits):
        """An expert's weight as stored at `bits` (MLX's quantization, the converter's values), float32."""
        import mlx.core as mx

        w = mx.array(self.original[kind][slot])
        return np.array(mx.dequantize(*mx.quantize(w, self.group_size, bits), self.group_size, bits))

    def set(self, layer, e, bits):
        if self.bits.get((layer, e)) == bits:
            return
        s = self.slot(layer, e)
        key = (layer, e, bits)
        values = self._cache.get(key) or {k: self.values(k, s, bits) for k in self.kinds}
        if bits in self.keep:
            self._cache[key] = values
        for k in self.kinds:
            self.views[k][s] = values[k]
        self.bits[(layer, e)] = bits

    def set_all(self, bits_of):
        """bits_of(layer, e) -> bits."""
        for layer in self.layers:
            for e in range(self.E):
                self.set(layer, e, bits_of(layer, e))


def _nll(model, seqs):
    import mlx.core as mx

    total, n = 0.0, 0
    for seq in seqs:
        logits = model(mx.array([seq[:-1]]))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        total += -mx.take_along_axis(lp, mx.array(seq[1:])[:, None], axis=-1).sum().item()
        n += len(seq) - 1
    return total / n


IMPORTANCE = ("output", "perplexity")


def _record_routing(model):
    """-> ({layer: [(x, inds, scores) of each call]} as NumPy, a function taking the hooks off)."""
    import mlx.core as mx

    from ..models.moe import on_route

    seen = {}

    def record(layer, x, inds, scores):
        seen.setdefault(layer, []).append(
            (np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]), np.array(inds).reshape(-1, inds.shape[-1]),
             np.array(scores.astype(mx.float32)).reshape(-1, scores.shape[-1])))

    return seen, on_route(model, record)


def _output_importance(experts, seen, high, low):
    """{(layer, e): routing-weighted |f_low(x) - f_high(x)|^2 over the tokens routed to e, relative
    to the energy of the layer's output} from the recorded routing."""
    out = {}
    for layer, calls in seen.items():
        x = np.concatenate([c[0] for c in calls])
        inds = np.concatenate([c[1] for c in calls]).astype(np.int64)
        scores = np.concatenate([c[2] for c in calls])
        values = {}
        y = np.zeros_like(x)
        errors = {}
        for e in range(experts.E):
            p, j = np.nonzero(inds == e)
            if not p.size:
                errors[e] = 0.0
                continue
            s = experts.slot(layer, e)
            for b in (high, low):
                w = {k: experts.values(k, s, b) for k in experts.kinds}
                g, u = x[p] @ w["gate"].T, x[p] @ w["up"].T
                values[b] = (g / (1 + np.exp(-g)) * u) @ w["down"].T
            weight = scores[p, j][:, None]
            np.add.at(y, p, weight * values[high])
            errors[e] = float(np.sum((weight * (values[low] - values[high])) ** 2))
        energy = float(np.sum(y ** 2)) or 1.0
        for e, err in errors.items():
            out[(layer, e)] = err / energy
    return out


def _importance(kind, model, experts, ppl, shape, high, low, t0, log):
    """{(layer, e): how much expert e of the layer at `low` costs, the rest at `high`} ({}: no
    lower width): kind "output", from the layers' outputs on one pass's recorded routing; else
    the perplexity each costs alone (a pass an expert)."""
    importance = {}
    if low is not None and kind == "output":
        experts.set_all(lambda layer, e: high)
        seen, off = _record_routing(model)
        try:
            ppl()
        finally:
            off()
        importance = _output_importance(experts, seen, high, low)
        log(f"[expert-bits] importance from the layers' outputs ({time.perf_counter() - t0:.0f} s)")
    elif low is not None:
        experts.set_all(lambda layer, e: high)
        base = ppl()
        for i, (layer, e) in enumerate(shape):
            experts.set(layer, e, low)
            importance[(layer, e)] = ppl() - base
            experts.set(layer, e, high)
            if (i + 1) % max(1, len(shape) // 10) == 0:
                log(f"[expert-bits] importance: {i + 1}/{len(shape)} experts ({time.perf_counter() - t0:.0f} s)")
    return importance


def _most_at_low(order, experts, ppl, high, low, limit, uniform, log):
    """The most experts at `low` (the least important first, `order`), the rest at `high`, whose
    perplexity stays within `limit`: a binary search on their number -> (that number, its
    perplexity)."""

    def with_k(k):
        lows = set(order[:k])
        experts.set_all(lambda layer, e: low if (layer, e) in lows else high)
        return ppl()

    k, best = 0, uniform[high]
    if low is not None:
        lo_k, hi_k = 0, len(order)  # invariant: lo_k fits (k = 0 is every expert at `high`)
        results = {}
        while lo_k < hi_k:
            mid = (lo_k + hi_k + 1) // 2
            results[mid] = with_k(mid)
            if results[mid] <= limit:
                lo_k = mid
            else:
                hi_k = mid - 1
        k = lo_k
        best = results.get(k, uniform[high])
        log(f"[expert-bits] {k} of {len(order)} experts at {low}-bit, the rest at {high}-bit: {best:.3f}")
    return k, best


def choose_expert_bits(folder, tolerance=0.05, data="c4", tokens=2048, seq_len=256, candidates=EXPERT_BITS,
                       group_size=64, importance="output", log=print):
    """-> ExpertBitsChoice for the float-expert flash folder `folder`."""
    import mlx_flash
    from ..sparsity.calibrate import token_sequences

    if importance not in IMPORTANCE:
        raise FlashError(f"--expert-importance {importance}: choose from {', '.join(IMPORTANCE)}")
    if not 0 < tolerance < 1:
        raise FlashError(f"--max-ppl-loss {tolerance}: give a fraction, e.g. 0.05 for 5 %")
    t0 = time.perf_counter()
    model, tok = mlx_flash.load(folder)
    try:
        rt = model.runtime
        if not hasattr(rt, "store") or rt.mode != "dense":
            raise FlashError(f"{folder}: the bit-width search runs on a mixture of experts held whole in DRAM")
        experts = _Experts(rt.store, group_size)
        seqs = token_sequences(tok, data, tokens, seq_len, targets=True)
        n_tokens = sum(len(s) - 1 for s in seqs)
        evals = 0

        def ppl():
            nonlocal evals
            evals += 1
            return math.exp(_nll(model, seqs))

        reference = ppl()
        limit = reference * (1 + tolerance)
        log(f"[expert-bits] {n_tokens} calibration tokens ({data}); float experts: perplexity {reference:.3f}, "
            f"tolerance {limit:.3f}")
        uniform = {}
        for b in sorted(candidates, reverse=True):
            experts.set_all(lambda layer, e, b=b: b)
            uniform[b] = ppl()
            log(f"[expert-bits] every expert at {b}-bit: {uniform[b]:.3f}")
        within = [b for b in sorted(candidates) if uniform[b] <= limit]
        high = within[0] if within else max(candidates)
        if not within:
            log(f"[expert-bits] even {high}-bit exceeds the tolerance: every expert at {high}-bit")
        below = [b for b in candidates if b < high]
        low = max(below) if below else None
        shape = [(layer, e) for layer in experts.layers for e in range(experts.E)]
        kind = importance
        experts.keep = (high, low)
        importance = _importance(kind, model, experts, ppl, shape, high, low, t0, log)
        order = sorted(shape, key=lambda le: importance.get(le, 0.0))
        k, best = _most_at_low(order, experts, ppl, high, low, limit, uniform, log)
        lows = set(order[:k])
        n_layers = rt.store.n_layers
        bits = tuple(tuple(low if (layer, e) in lows else high for e in range(experts.E))
                     if layer in experts.layers else None for layer in range(n_layers))
        imp = [[float(f"{importance.get((layer, e), 0.0):.4g}") for e in range(experts.E)] if layer in experts.layers
               else None for layer in range(n_layers)]
        return ExpertBitsChoice(bits, tolerance, reference, uniform, high, low, kind, imp, k, best, n_tokens, evals,
                                time.perf_counter() - t0)
    finally:
        model.runtime.close()


def auto_expert_bits(source, out, options, tolerance, data="c4", tokens=2048, importance="output", progress=True,
                     revision=None):
    """convert --expert-bits auto: a float reference conversion of `source` beside `out` (deleted
    after), the search on it -> (ExpertBitsChoice, the options with its widths)."""
    import shutil
    from dataclasses import replace

    from ..runtime.memory import physical_memory
    from .convert import convert
    from .quantize import QuantOptions

    ref = out.parent / f".{out.name}.expert-bits-reference"
    try:
        print(f"[expert-bits] a float reference of the experts: {ref}", file=sys.stderr)
        convert(source, ref, dtype="float32", force=True, progress=progress, revision=revision,
                quant=QuantOptions(dequantize=True))
        size = sum(p.stat().st_size for p in ref.rglob("*") if p.is_file())
        if size > 0.6 * physical_memory():
            raise FlashError(f"--expert-bits auto holds the model in DRAM at float32 ({size / 1e9:.1f} GB), more "
                             f"than this machine's memory allows ({physical_memory() / 1e9:.1f} GB): give the "
                             "widths as a file (--expert-bits FILE.json) chosen on a larger machine")
        choice = choose_expert_bits(ref, tolerance, data, tokens, group_size=options.group_size or 64,
                                    importance=importance, log=lambda s: print(s, file=sys.stderr))
    finally:
        shutil.rmtree(ref, ignore_errors=True)
    return choice, replace(options, expert_bits=choice.bits)


def read_expert_bits(path):
    """--expert-bits FILE.json ({"bits": [...]} or the list itself) -> the per-layer tuple."""
    import json
    from pathlib import Path

    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise FlashError(f"--expert-bits {path}: {e.strerror}")
    except ValueError as e:
        raise FlashError(f"--expert-bits {path}: invalid JSON ({e})")
    bits = d.get("bits") if isinstance(d, dict) else d
    if not isinstance(bits, list) or not all(b is None or (isinstance(b, list) and all(isinstance(x, int) for x in b))
                                             for b in bits):
        raise FlashError(f"--expert-bits {path}: expected {{\"bits\": [[bits of each expert] or null, per layer]}}")
    return tuple(None if b is None else tuple(b) for b in bits)

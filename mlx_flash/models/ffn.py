"""The feed-forward layer whose weights come from the flash layout.

The FFN never holds its big weights itself: it asks a row store for the rows
of the neurons it computes on (`FFNRows`), each weight kind as a contiguous
[n, d_model] matrix ("down" is the transposed down projection, so that its
rows are neurons too). Neuron order does not change the result, so a store
may hand out any subset in any order; the dense store hands out all of them.
"""

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from .. import kernels as _kernels
from ..errors import FlashError
from . import host


@dataclass
class PackedRows:
    """Rows of a cache that holds a quantized layout's bundle parts as they are on flash
    (runtime/stores: packed caches): the native kernels compute on them in place."""

    views: dict  # {kind: NumPy [capacity, kind_bytes / 4] float32 containers of raw bytes}
    sel: np.ndarray  # the rows to use (int64)
    ids: np.ndarray  # their neuron ids (the column kinds' table rows: id // group)
    layout: object  # the BundleLayout (quant spec, kind bytes, which kinds are columns)
    tables: Optional[dict]  # {kind: (scales, biases)} of the layer, for column kinds
    kernels: object
    # where sel is every row in neuron order (a dense store's): the column kernel's table rows
    # (ids // group), already in its order; else None (FlashFFN._packed sorts them a token)
    in_order: Optional[np.ndarray] = None


@dataclass
class FFNRows:
    up: mx.array  # [n, d_model]
    down: mx.array  # [n, d_model]
    gate: Optional[mx.array] = None  # [n, d_model], gated (GLU) FFNs only
    ids: Optional[mx.array] = None  # neuron ids of the rows; None = all, in order
    h: Optional[mx.array] = None  # activations of these neurons, when the store computed them (DIP)
    mask: Optional[mx.array] = None  # [..., n] 0/1: which rows each token uses (cached extras are not)
    # rows the native kernels read in place on the CPU, for one token (a float32 cache's active
    # rows) or every row for a few positions or a batch's decode step (a float16-held FFN, a
    # hybrid's float16 cache and its float32 stream): (NumPy views {kind: [capacity, d_model]}
    # at float32 or float16, the rows, the native kernels); up / down / gate are then None
    select: Optional[tuple] = None
    packed: Optional[PackedRows] = None  # rows at their bits (then up / down / gate are None)
    y: Optional[mx.array] = None  # the part's output, when the store computed it (DIP, one token)


def fatrelu(threshold):
    """FATReLU (paper App. C.5): x where x >= threshold, else 0."""

    def act(x):
        return mx.where(x >= threshold, x, mx.zeros_like(x))

    return act


def relu2(x):
    return mx.square(nn.relu(x))


ACTIVATIONS = {
    "silu": nn.silu,
    "swish": nn.silu,
    "relu": nn.relu,
    "relu2": relu2,
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
}


def host_silu(g):
    """SiLU of a float32 NumPy vector (one token's gate, between native products)."""
    with np.errstate(over="ignore"):  # exp(-g) overflows to inf for g < -88: g / inf = -0, as MLX's
        return g / (1 + np.exp(-g))


# the activations one token's FFN computes on the host, between the native kernels' products:
# in MLX, they cost an evaluation each (h = act(gate) * up before down: ~120 us on this VM,
# 3.6 ms of SmolLM2's ~50 ms token), in NumPy ~5 us
def host_gelu_approx(g):
    """nn.gelu_approx (tanh-approximated GELU: Gemma's) of a float32 NumPy vector, its formula
    0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) in place on one temporary (~8 us for 2,048
    values; g**3 alone costs ~150)."""
    t = g * g
    t *= np.float32(0.044715)
    t += 1
    t *= g
    t *= np.float32(math.sqrt(2 / math.pi))
    np.tanh(t, out=t)
    t += 1
    t *= g
    t *= np.float32(0.5)
    return t


HOST_ACTIVATIONS = {nn.silu: host_silu, nn.relu: lambda g: np.maximum(g, 0), nn.gelu_approx: host_gelu_approx}


def activation(name, threshold=None):
    if name == "fatrelu":
        if threshold is None:
            raise FlashError("hidden_act 'fatrelu' needs 'fatrelu_threshold' in config.json")
        return fatrelu(float(threshold))
    if name not in ACTIVATIONS:
        raise FlashError(
            f"unsupported activation '{name}' (supported: {', '.join(ACTIVATIONS)}, fatrelu)"
        )
    return ACTIVATIONS[name]


class FlashFFN(nn.Module):
    """y = act(x W_gate^T) * (x W_up^T) W_down^T, or act(x W_up^T + b) W_down^T + b'.

    `store` is set by the loader: `store.rows(layer, x)` -> FFNRows or a list of them;
    an entry of the list may be a callable returning more FFNRows (rows still being
    read): the FFN evaluates what it has summed so far, then calls it (starts evaluating
    it, without waiting, when the callable has `overwrites = False`: its rows overwrite
    nothing that sum reads, as with staged caches).
    """

    def __init__(self, layer, d_model, n_neurons, act, gated, bias=False):
        super().__init__()
        self.layer = layer
        self.d_model = d_model
        self.n_neurons = n_neurons
        self.gated = gated
        self._act = act
        self.store = None
        self.arena = None  # models.half.Arena a prompt's packed rows are dequantized into (the runtime's)
        if bias:
            if gated:  # (a Llama's mlp_bias: the gate's too)
                self.gate_bias = mx.zeros((n_neurons,))
            self.up_bias = mx.zeros((n_neurons,))
            self.down_bias = mx.zeros((d_model,))

    def __call__(self, x):
        y, acc = self._sum(x)
        return self._total(x, y, acc)

    def host_step(self, v):
        """One position's FFN of a float32 host vector v [d_model] -> [d_model] (models/host.py):
        the host sum itself where the native kernels computed every part, without MLX."""
        x = mx.array(v.reshape(1, 1, -1))
        y, acc = self._sum(x)
        if y is None and acc is not None and "down_bias" not in self:
            return acc.reshape(-1)
        return _kernels.host_f32(self._total(x, y, acc))

    def _total(self, x, y, acc):
        """The FFN's output from _sum's MLX part y and host sum acc."""
        if acc is not None or y is None:
            s = mx.zeros(x.shape[:-1] + (self.d_model,), dtype=x.dtype) if acc is None else \
                mx.array(acc).reshape(*x.shape[:-1], self.d_model).astype(x.dtype)
            y = s if y is None else y + s
        if "down_bias" in self:
            y = y + self.down_bias
        return y

    def _sum(self, x):
        """The FFN over x before its down bias: (an MLX part or None, a host sum or None)."""
        if self.store is None:
            raise FlashError("FFN has no weight store; load the model with mlx_flash.load")
        try:
            parts = self.store.rows(self.layer, x)
        except Exception as e:
            if type(e).__name__ != "TooManyNeurons":
                raise
            return self._in_halves(x), None
        if isinstance(parts, FFNRows):
            parts = [parts]
        # Neuron subsets are independent: the FFN is the sum over its parts. A callable
        # part is rows still being read: compute what is here first, then ask for them.
        # One token's parts the native kernels compute (held and streamed rows: hybrid) add
        # into one host sum, each part's rows after the previous part's, in the order one
        # call over all of them would; several positions' packed parts are multiplied in
        # chunks of their rows taken in order across the parts, as one part's would be, or (a
        # batch's decode step, _packed_pass; rows read in place: _selected_pass) each row's
        # product alone and the down columns summed on from part to part: either way hybrid's
        # output is dense's to the bit (but for rows read in place whose width is not a whole
        # number of 8 floats, at the AVX2 level: the portable tail sums a 64-row block apart).
        y, acc, packed = None, None, []
        positions = x.size // x.shape[-1]
        one = positions == 1
        # a pass of a few positions (a speculative verify pass): each position through the
        # one-token kernels, into a host sum of its own (the values of a one-position pass)
        few = [x.reshape(positions, -1)[i] for i in range(positions)] if 1 < positions <= _kernels.SMALL_PASS else None
        sums = [None] * positions if few else None
        parts = list(parts)
        while parts:
            rows = parts.pop(0)
            if callable(rows):
                if packed:  # (computed before the rows they read may be overwritten)
                    y = self._add(y, self._packed_parts(x, packed))
                    packed = []
                if y is not None:
                    (mx.eval if getattr(rows, "overwrites", True) else mx.async_eval)(y)
                parts = list(rows()) + parts
                continue
            if rows.y is not None:
                y = rows.y if y is None else y + rows.y
                continue
            if rows.h is not None:
                y = rows.h @ rows.down if y is None else y + rows.h @ rows.down
                continue
            if rows.select is not None or rows.packed is not None:
                one_token = self._selected if rows.packed is None else self._packed
                if one:
                    acc = one_token(x, rows, acc)
                elif few is not None and rows.mask is None:
                    sums = [one_token(xi, rows, si) for xi, si in zip(few, sums)]
                else:
                    packed.append(rows)
                continue
            y = self._dense_part(x, rows, y)
        if packed:
            y = self._add(y, self._packed_parts(x, packed))
        if few is not None and sums[0] is not None:
            acc = np.stack(sums)
        return y, acc

    def _dense_part(self, x, rows, y):
        """y + the FFN over float rows (masked per token if the part says so)."""
        h = self.biased("up", x @ rows.up.T, rows.ids)
        if self.gated:
            h = self._activated(self.biased("gate", x @ rows.gate.T, rows.ids), h)
        else:
            h = self._activated(h)
        if rows.mask is not None:
            h = h * rows.mask.astype(h.dtype)
        return h @ rows.down if y is None else y + h @ rows.down

    HOST_ACTIVATION_MIN = 1 << 14  # values from which a pass's activation goes through NumPy

    def _activated(self, g, u=None):
        """act(g) (* u: a gated FFN's up product). On the CPU at float32, for a pass of several
        positions (a prompt's chunk), through NumPy where the activation has a host form: MLX's
        CPU exp runs ~8x slower than NumPy's (a 160 x 8,960 SiLU 40 ms against 5), a third of a
        prompt's FFN time; evaluated here, as each chunk is before the next. The same formula,
        within float32's rounding of exp / tanh."""
        host_act = HOST_ACTIVATIONS.get(self._act)
        if (not host.PASSES or host_act is None or g.dtype != mx.float32 or g.size < self.HOST_ACTIVATION_MIN
                or mx.default_device() != mx.cpu):
            return self._act(g) if u is None else self._act(g) * u
        mx.eval([a for a in (g, u) if a is not None])
        h = host_act(np.array(g, copy=False))
        if u is not None:
            h *= np.array(u, copy=False)
        return mx.array(h)

    def biased(self, kind, y, ids=None):
        """y (a product of the `kind` rows "up" or "gate", the neurons `ids` or all) plus that kind's
        bias where the FFN has one (OPT's, Phi's, a Llama's mlp_bias)."""
        bias = getattr(self, f"{kind}_bias", None)
        return y if bias is None else y + (bias if ids is None else bias[ids])

    def _one_token(self, x, rows, up, gate, down):
        """One token's FFN over rows the native kernels read in place: up(v) / gate(v) -> the
        rows' products with the token's vector v, down(h) -> the host sum with sum_i h[i] *
        down row i added."""
        from ..kernels import host_f32

        return self._on_host(host_f32(x), rows, up, gate, down)

    def _on_host(self, v, rows, up, gate, down):
        """The FFN over host vectors v ([K], or a pass's [positions, K]): up / gate / down as
        _one_token's, the activation on the host where it has one (through MLX where not, or
        with an up bias)."""
        from ..kernels import host_f32

        host_act = HOST_ACTIVATIONS.get(self._act)
        if host_act is not None and "up_bias" not in self:
            h = host_act(gate(v)) * up(v) if self.gated else host_act(up(v))
            return down(np.ascontiguousarray(h, dtype=np.float32))
        h = self.biased("up", mx.array(up(v)), rows.ids)
        h = self._act(self.biased("gate", mx.array(gate(v)), rows.ids)) * h if self.gated else self._act(h)
        return down(host_f32(h).reshape(h.shape))

    def _selected(self, x, rows, acc):
        """One token's FFN over the chosen rows of a float32 cache (the same sums as the masked
        product, over the active rows only), added to the host sum `acc` (None: a new one)."""
        from ..kernels import gather_axpy, gather_mv

        views, sel, kernels = rows.select
        if sel.size == 0:
            return acc
        return self._one_token(x, rows, lambda v: gather_mv(kernels, v, views["up"], sel),
                               lambda v: gather_mv(kernels, v, views["gate"], sel),
                               lambda h: gather_axpy(kernels, h, views["down"], sel, out=acc))

    @staticmethod
    def _add(y, part):
        return part if y is None else y + part

    def _packed(self, x, rows, acc=None):
        """One token's FFN over rows held at their bits (native kernels: gate / up rows with
        inline scales, down columns with the layer's scale table), added to the host sum `acc`
        (None: a new one)."""
        from ..kernels import qaxpy_cols, qmv_rows

        p = rows.packed
        if p.sel.size == 0:
            return acc
        raw = {k: v.view(np.uint8) for k, v in p.views.items()}
        spec = p.layout.quant
        offsets = spec.inline_offsets(self.d_model)
        if p.in_order is not None:  # (every row, in order: ~70 us a layer of sorting and gathers saved)
            sel, trow, order = p.sel, p.in_order, None
        else:
            trow = p.ids // spec.group_size
            order = np.argsort(trow, kind="stable")  # the column kernel's row order
            sel, trow = p.sel[order], trow[order]

        def down(h):
            h = h if order is None else np.ascontiguousarray(h[order])
            return qaxpy_cols(p.kernels, h, raw["down"], sel, trow, p.tables["down"], spec, out=acc)

        return self._one_token(x, rows, lambda v: qmv_rows(p.kernels, v, raw["up"], p.sel, spec, *offsets),
                               lambda v: qmv_rows(p.kernels, v, raw["gate"], p.sel, spec, *offsets), down)

    def _packed_pass(self, x, parts):
        """A pass of several positions (a batch's decode step) over packed rows: each part's gate
        and up rows multiplied into every position (qmm_rows), the activation, and its down
        columns summed into one host sum (qmm_cols, each part continuing the previous part's
        sums row by row, as one part holding them all would): every row dequantized once, in C,
        for every position, and no chunk through MLX."""
        from ..kernels import host_f32, qmm_cols, qmm_rows

        positions = x.size // x.shape[-1]
        v = host_f32(x).reshape(positions, self.d_model)
        acc = None
        for rows in parts:
            p = rows.packed
            if p.sel.size == 0:
                continue
            raw = {k: a.view(np.uint8) for k, a in p.views.items()}
            spec = p.layout.quant
            offsets = spec.inline_offsets(self.d_model)
            acc = self._on_host(v, rows, lambda u: qmm_rows(p.kernels, u, raw["up"], p.sel, spec, *offsets),
                                lambda u: qmm_rows(p.kernels, u, raw["gate"], p.sel, spec, *offsets),
                                lambda h: qmm_cols(p.kernels, h, raw["down"], p.sel, p.ids // spec.group_size,
                                                   p.tables["down"], spec, out=acc))
        return self._of_host(x, acc)

    def _of_host(self, x, acc):
        """A pass's host sum [positions, d_model] (None: no rows) as x's MLX array."""
        if acc is None:
            return mx.zeros(x.shape[:-1] + (self.d_model,), dtype=x.dtype)
        return mx.array(acc).reshape(*x.shape[:-1], self.d_model).astype(x.dtype)

    def _selected_pass(self, x, parts):
        """A batch's decode step over float32 or 16-bit rows the kernels read in place
        (FFNRows.select: a dense FFN held at 16 bits, a hybrid's float16 cache and its float32
        stream; their stores give them so only where kernels.pass_kernels takes the step): each
        part's gate and up rows multiplied into every
        position (gather_mm), the activation, and its down rows summed into one host sum
        (gather_mm_cols, each part continuing the previous part's sums): every row converted once,
        in C, for every position, where the arena converted the layer for BLAS."""
        from ..kernels import gather_mm, gather_mm_cols, host_f32

        positions = x.size // x.shape[-1]
        v = host_f32(x).reshape(positions, self.d_model)
        acc = None
        for rows in parts:
            views, sel, kernels = rows.select
            if rows.mask is not None:  # (no store gives a masked part in place at a pass)
                raise FlashError("a pass over rows read in place cannot take a mask")
            if sel.size == 0:
                continue
            acc = self._on_host(v, rows, lambda u: gather_mm(kernels, u, views["up"], sel),
                                lambda u: gather_mm(kernels, u, views["gate"], sel),
                                lambda h: gather_mm_cols(kernels, h, views["down"], sel, out=acc))
        return self._of_host(x, acc)

    def _packed_parts(self, x, parts):
        """Several positions over rows the kernels read in place: float or 16-bit rows
        (FFNRows.select) through _selected_pass; packed rows in a batch's decode step or a prompt's
        chunk that kernels.pass_kernels takes (no mask) through _packed_pass, else (a prompt's
        chunk, unless kernels.PROMPT_PASS; a larger batch) dequantized chunks through BLAS."""
        selected = [r for r in parts if r.packed is None]
        if selected:
            y = self._selected_pass(x, selected)
            rest = [r for r in parts if r.packed is not None]
            return y if not rest else y + self._packed_parts(x, rest)
        if (_kernels.pass_kernels(parts[0].packed.kernels, x) and all(r.mask is None for r in parts)
                and parts[0].packed.layout.columns == ("down",)):
            return self._packed_pass(x, parts)
        return self._packed_chunks(x, parts)

    PACKED_CHUNK_VALUES = 1 << 20  # float32 values of one kind's dequantized chunk (4 MiB)

    def _packed_chunks(self, x, parts):
        """Several positions over packed rows (the parts' rows in order, as one sequence):
        chunks of rows dequantized to float32 (in C) and multiplied by BLAS, evaluated before
        the next. The chunks are dequantized into the runtime's arena where it has one (the
        quantized resident modules', sized for three kinds: models/quantized.py arena_values),
        else into fresh ~4 MiB a kind. A chunk is the same rows whichever parts hold them, so
        the sums are those of one part holding them all."""
        from ..kernels import dequantize_cols, dequantize_rows

        spec, d = parts[0].packed.layout.quant, self.d_model
        kinds = parts[0].packed.layout.kinds
        scales_off, biases_off = spec.inline_offsets(d)
        arena = self.arena if self.arena is not None and self.arena.values >= len(kinds) * d else None
        step = max(1, (self.PACKED_CHUNK_VALUES if arena is None else arena.values // len(kinds)) // d)
        starts = np.cumsum([0] + [r.packed.sel.size for r in parts])  # each part's first row in the sequence
        raws = [{k: v.view(np.uint8) for k, v in r.packed.views.items()} for r in parts]
        y = None
        for start in range(0, int(starts[-1]), step):
            stop = min(start + step, int(starts[-1]))
            w, ids, masks = {}, [], []
            at_row = 0  # the chunk's rows so far (where the next part's go in the arena)
            for i, r in enumerate(parts):  # the chunk's rows each part holds
                lo, hi = max(start, starts[i]) - starts[i], min(stop, starts[i + 1]) - starts[i]
                if lo >= hi:
                    continue
                p, at = r.packed, slice(int(lo), int(hi))
                sel, n = p.sel[at], int(hi - lo)
                for j, k in enumerate(p.layout.kinds):
                    out = None
                    if arena is not None:
                        base = (j * step + at_row) * d
                        out = arena.view[base: base + n * d].reshape(n, d)
                    if k in p.layout.columns:
                        v = dequantize_cols(p.kernels, raws[i][k], sel, p.ids[at] // spec.group_size, p.tables[k], spec,
                                            out=out)
                    else:
                        v = dequantize_rows(p.kernels, raws[i][k], sel, spec, scales_off, biases_off, d, out=out)
                    if arena is None:
                        w.setdefault(k, []).append(v)
                at_row += n
                ids.append(p.ids[at])
                masks.append(None if r.mask is None else r.mask[..., at])
            if arena is not None:  # (the chunk's rows of each kind side by side: views of the arena)
                w = {k: arena.array[j * step * d: (j * step + at_row) * d].reshape(at_row, d)
                     for j, k in enumerate(kinds)}
            else:
                w = {k: mx.array(v[0] if len(v) == 1 else np.concatenate(v)) for k, v in w.items()}
            if all(m is None for m in masks):
                mask = None
            else:
                ones = mx.ones(x.shape[:-1] + (1,), dtype=mx.bool_)
                mask = mx.concatenate([mx.broadcast_to(ones, x.shape[:-1] + (len(a),)) if m is None else m
                                       for m, a in zip(masks, ids)], axis=-1)
            part = FFNRows(up=w["up"], down=w["down"], gate=w.get("gate"), ids=mx.array(np.concatenate(ids)),
                           mask=mask)
            y = self._dense_part(x, part, y)
            mx.eval(y)
        return y

    def _in_halves(self, x):
        """A prompt chunk whose neurons do not fit the store: run it in two halves.

        Each half is evaluated before the next one changes the store's rows.
        """
        axis = -2 if x.shape[-2] > 1 else 0  # one position of several sequences: split the batch
        if x.ndim < 3 and axis == 0 or x.shape[axis] < 2:
            raise FlashError("one token needs more neurons than the memory budget leaves its layer; "
                             "raise --memory-budget or lower --density")
        half = x.shape[axis] // 2
        first, rest = (x[..., :half, :], x[..., half:, :]) if axis == -2 else (x[:half], x[half:])
        a = self(first)
        mx.eval(a)
        b = self(rest)
        return mx.concatenate([a, b], axis=axis)


def layer_ffn(layer):
    """The FlashFFN of a transformer block, whatever the family calls it."""
    for name in ("mlp", "ffn", "feed_forward"):
        if name in layer and isinstance(layer[name], FlashFFN):
            return layer[name]
    raise FlashError(f"{type(layer).__name__} has no FlashFFN")

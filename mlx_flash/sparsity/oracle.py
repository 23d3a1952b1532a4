"""oracle: exact. ReLU FFNs: the neurons with act(x W_up^T + b) != 0. GLU FFNs: the
top-k |act(x W_gate^T) * x W_up^T| (k = density * n). It keeps the dense gate/up
weights for that: it is for measurement, and its resident bytes say so."""

import numpy as np

import mlx.core as mx

from .base import Source, device_top_k_mask


class WeightsSource(Source):
    """A source that decides from some of the FFN's own weights, kept in DRAM."""

    kinds = {True: (), False: ()}  # gated -> the weight kinds it keeps

    def __init__(self, weights, act, gated, up_bias, density, gate_bias=None):
        self.weights = weights  # per layer {kind: mx.array [n, d]}
        self.act = act
        self.gated = gated
        self.up_bias = up_bias  # per layer mx.array [n] or None
        self.gate_bias = gate_bias  # per layer mx.array [n] or None, or None
        self.density = density
        self.resident_bytes = sum(a.nbytes for w in weights for a in w.values())

    @classmethod
    def build(cls, ctx):
        return cls(ctx.layer_weights(cls.kinds[ctx.gated]), ctx.act, ctx.gated, ctx.up_bias, ctx.density,
                   ctx.gate_bias)

    def _up(self, layer, x2):
        return self._product(layer, x2, "up", self.up_bias)

    def _gate(self, layer, x2):
        return self._product(layer, x2, "gate", self.gate_bias)

    def _product(self, layer, x2, kind, bias):
        y = x2 @ self.weights[layer][kind].T
        return y + bias[layer] if bias is not None and bias[layer] is not None else y


class Oracle(WeightsSource):
    name = "oracle"
    kinds = {True: ("gate", "up"), False: ("up",)}

    def select(self, layer, x):
        x2 = x.reshape(-1, x.shape[-1])
        u = self._up(layer, x2)
        if self.gated:
            h = mx.abs(self.act(self._gate(layer, x2)) * u)
            if self.density >= 1.0:  # exact: every neuron whose output is not zero
                return np.array(h != 0)
            return device_top_k_mask(h, self.k(self.density, h.shape[-1]))
        return np.array(self.act(u)) != 0

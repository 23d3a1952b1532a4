"""threshold: ReLU / FATReLU: the neurons whose activation is non-zero (exact for
these, like the oracle). GLU: the gate as predictor (paper App. C.5): the top-k
|act(x W_gate^T)|, the gate weights resident. A non-gated FFN whose activation has no
zeros (GELU: Phi-2, Falcon): the top-k |act(x W_up^T + b)|, the up weights resident."""

from functools import cached_property

import numpy as np

import mlx.core as mx

from .base import device_top_k_mask
from .oracle import WeightsSource


class Threshold(WeightsSource):
    name = "threshold"
    kinds = {True: ("gate",), False: ("up",)}

    def select(self, layer, x):
        x2 = x.reshape(-1, x.shape[-1])
        if self.gated:
            g = mx.abs(self.act(self._gate(layer, x2)))
            if self.density >= 1.0:  # exact for ReLU / FATReLU gates: act(gate) == 0 adds nothing
                return np.array(g != 0)
            return device_top_k_mask(g, self.k(self.density, g.shape[-1]))
        a = self.act(self._up(layer, x2))
        if self.density >= 1.0 or self.zeroes_negatives:
            return np.array(a) != 0
        return device_top_k_mask(mx.abs(a), self.k(self.density, a.shape[-1]))

    @cached_property
    def zeroes_negatives(self):
        """Whether the activation is ReLU-like (ReLU, ReLU², FATReLU: exact zeros, its non-zero
        neurons the exact set) rather than GELU-like (no zeros: a density is needed); asked once."""
        return self.act(mx.array([-1.0])).item() == 0

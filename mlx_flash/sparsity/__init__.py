"""Sparsity sources: which FFN neurons a token needs, decided from the FFN input.

Every source has `select(layer, x) -> np.ndarray[bool] [tokens, n]` (each
token's neurons; the store loads their union and masks each token to its own)
and `resident_bytes` (the weights it keeps in DRAM to decide, counted in the
memory budget).

- oracle: exact. ReLU FFNs: neurons with act(x W_up^T + b) != 0. GLU FFNs: the
  top-k |act(x W_gate^T) * x W_up^T| (k = density * n). It keeps the dense
  gate/up weights for that: it is for measurement, and its resident bytes say so.
- threshold: ReLU / FATReLU: the neurons whose activation is non-zero (exact for
  these, like the oracle). GLU: the gate as predictor (paper App. C.5): the
  top-k |act(x W_gate^T)|, the gate weights resident.
Predictors (low-rank), DIP and DIP-CA come later behind the same call.
"""

import numpy as np

import mlx.core as mx

from ..errors import FlashError

SOURCES = ("oracle", "threshold")  # predictor: PredictorSource; dip / dip-ca: dip_store.py


def top_k_mask(scores, k):
    """scores [t, n] -> bool mask of each row's top-k."""
    if k >= scores.shape[-1]:
        return np.ones(scores.shape, dtype=bool)
    idx = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, idx, True, axis=-1)
    return mask


class _WeightsSource:
    def __init__(self, weights, act, gated, up_bias, density):
        # weights: per layer {kind: mx.array [n, d]} for the kinds this source needs
        self.weights = weights
        self.act = act
        self.gated = gated
        self.up_bias = up_bias  # per layer mx.array [n] or None
        self.density = density
        self.resident_bytes = sum(a.nbytes for w in weights for a in w.values())

    def _k(self, n):
        return max(1, int(round(self.density * n)))


class Oracle(_WeightsSource):
    name = "oracle"

    def select(self, layer, x):
        w = self.weights[layer]
        x2 = x.reshape(-1, x.shape[-1])
        u = x2 @ w["up"].T
        if self.up_bias is not None and self.up_bias[layer] is not None:
            u = u + self.up_bias[layer]
        if self.gated:
            h = np.array(mx.abs(self.act(x2 @ w["gate"].T) * u))
            if self.density >= 1.0:  # exact: every neuron whose output is not zero
                return h != 0
            return top_k_mask(h, self._k(h.shape[-1]))
        return np.array(self.act(u)) != 0


class Threshold(_WeightsSource):
    name = "threshold"

    def select(self, layer, x):
        w = self.weights[layer]
        x2 = x.reshape(-1, x.shape[-1])
        if self.gated:
            g = np.array(mx.abs(self.act(x2 @ w["gate"].T)))
            if self.density >= 1.0:  # exact for ReLU / FATReLU gates: act(gate) == 0 adds nothing
                return g != 0
            return top_k_mask(g, self._k(g.shape[-1]))
        u = x2 @ w["up"].T
        if self.up_bias is not None and self.up_bias[layer] is not None:
            u = u + self.up_bias[layer]
        return np.array(self.act(u)) != 0


def make_source(name, density, layer_weights, act, gated, up_bias):
    """layer_weights(kinds) -> per-layer {kind: mx.array}: the loader reads them from flash."""
    if name not in SOURCES:
        raise FlashError(f"unknown sparsity source '{name}' (available: {', '.join(SOURCES)})")
    if not 0 < density <= 1:
        raise FlashError(f"--density must be in (0, 1], got {density}")
    if name == "oracle":
        kinds = ("gate", "up") if gated else ("up",)
        return Oracle(layer_weights(kinds), act, gated, up_bias, density)
    kinds = ("gate",) if gated else ("up",)
    return Threshold(layer_weights(kinds), act, gated, up_bias, density)


class PredictorSource:
    """The calibrated low-rank predictors (paper §3.1): p(x) >= the layer's threshold.

    With density < 1, at most the top density * n predicted neurons are kept.
    """

    name = "predictor"

    def __init__(self, folder, manifest, density, dtype=mx.float32):
        from ..layout.format import check_file
        from .predictor import LowRankPredictor

        cal = manifest.calibration.get("predictors")
        if not cal:
            raise FlashError(
                f"{folder}: no trained predictors; run `mlx_flash.calibrate --model {folder}` first"
            )
        check_file(folder, cal, checksum=True)
        w = mx.load(str(folder / cal["file"]))
        self.layers = []
        for i, r in enumerate(cal["ranks"]):
            p = LowRankPredictor(w[f"layers.{i}.down.weight"].shape[1], w[f"layers.{i}.up.bias"].shape[0], r)
            p.load_weights([(k.split(".", 2)[2], v.astype(dtype)) for k, v in w.items()
                            if k.startswith(f"layers.{i}.")])
            mx.eval(p.parameters())
            self.layers.append(p)
        self.thresholds = cal["thresholds"]
        self.density = density
        from mlx.utils import tree_flatten

        self.resident_bytes = sum(v.nbytes for p in self.layers for _, v in tree_flatten(p.parameters()))

    def select(self, layer, x):
        p = np.array(mx.sigmoid(self.layers[layer](x.reshape(-1, x.shape[-1]))).astype(mx.float32))
        mask = p >= self.thresholds[layer]
        if self.density < 1.0:
            mask &= top_k_mask(p, max(1, int(round(self.density * p.shape[-1]))))
        return mask

"""What every sparsity source is: a class with a name, the store it runs in, what it
needs from the model folder, the weights it keeps in DRAM, and `select`."""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import FlashError

# what a source may need besides the FFN bundles: how to find it in the manifest, and
# the error that tells the user how to make it
NEEDS = {
    "predictors": (lambda m: m.calibration.get("predictors"),
                   "{folder}: no trained predictors; run `mlx_flash.calibrate --model {folder}` first"),
    "thresholds": (lambda m: m.dip and m.calibration.get("thresholds"),
                   "{folder}: needs the DIP orientation on flash (`mlx_flash.convert --dip`) and calibrated "
                   "thresholds (`mlx_flash.calibrate --model {folder}`)"),
    "dip": (lambda m: m.dip,
            "{folder}: no DIP orientation on flash; convert again with `mlx_flash.convert --dip`"),
}


def top_k_mask(scores, k):
    """scores [t, n] -> bool mask of each row's top-k."""
    if k >= scores.shape[-1]:
        return np.ones(scores.shape, dtype=bool)
    idx = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, idx, True, axis=-1)
    return mask


def device_top_k_mask(scores, k):
    """scores: an MLX [t, n] array -> the NumPy bool mask of each row's top-k, the top-k found
    where MLX computes and only their ids read back (k ints cross to the host, not n scores)."""
    import mlx.core as mx

    if k >= scores.shape[-1]:
        return np.ones(scores.shape, dtype=bool)
    idx = np.array(mx.argpartition(-scores, kth=k - 1, axis=-1)[:, :k])
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, idx, True, axis=-1)
    return mask


@dataclass
class SourceContext:
    """What a source is built from (runtime/build.py fills it)."""

    folder: Path
    manifest: object  # layout.format.Manifest
    density: float
    dtype: object  # the MLX compute dtype
    act: Callable  # the FFN's activation
    gated: bool
    has_bias: bool
    up_bias: list  # per layer: mx.array [n] or None
    layer_weights: Callable  # kinds -> per layer {kind: mx.array [n, d]}, read from flash
    gate_bias: list = None  # per layer: mx.array [n] or None (a gated FFN with biases: Llama's mlp_bias)
    recovery: bool = True  # add calibrate --recover's adapters where a source uses them
    verify: bool = True  # check the sha256 of calibration files


class Source:
    """A sparsity source: `select(layer, x) -> np.ndarray[bool] [tokens, n]`, each token's
    neurons (the store loads their union and masks each token to its own).

    Subclasses set `name` (the --sparsity value), `store` ("flash": the windowed neuron
    caches; "dip": the DIP store, which chooses inputs and neurons itself), `needs` (a
    key of NEEDS, or None) and `gated_only`; `build(ctx)` makes one, and
    `resident_bytes` counts the weights it keeps in DRAM (in the memory budget)."""

    name = None
    store = "flash"
    needs = None
    gated_only = False  # SwiGLU FFNs without biases only
    resident_bytes = 0

    @classmethod
    def check(cls, ctx):
        """A clear error when the model cannot run this source."""
        if cls.gated_only and (not ctx.gated or ctx.has_bias):
            raise FlashError(f"--sparsity {cls.name} needs a gated (SwiGLU) FFN without biases")
        cls.check_needs(ctx.folder, ctx.manifest)

    @classmethod
    def check_needs(cls, folder, manifest):
        if cls.needs:
            find, message = NEEDS[cls.needs]
            if not find(manifest):
                raise FlashError(message.format(folder=folder))

    @classmethod
    def build(cls, ctx):
        raise NotImplementedError

    def select(self, layer, x):
        raise NotImplementedError

    @staticmethod
    def k(density, n):
        return max(1, int(round(density * n)))

"""dip, dip-ca: Dynamic Input Pruning (Federici et al. §4-5), with cache-aware masking;
calibrated, calibrated-ca: the same two sides with per-layer thresholds (issue 19);
calibrated-uniform: their ablation, every layer at --density.

These sources choose input dimensions and neurons from the FFN's own computation
(|x|, then |h~|), so they run in the DIP store (runtime/stores/dip.py), which
computes h~ itself; the class says so, and what the model needs: a SwiGLU FFN
and the DIP orientation on flash (`mlx_flash.convert --dip`); the calibrated ones
also the thresholds `mlx_flash.calibrate` searched."""

from .base import Source


class DIP(Source):
    name = "dip"
    store = "dip"
    needs = "dip"
    gated_only = True
    cache_aware = False

    def __init__(self, density):
        self.density = density

    @classmethod
    def build(cls, ctx):
        return cls(ctx.density)


class DIPCacheAware(DIP):
    """DIP-CA (Eq. 10): uncached entries' scores scaled by gamma (the store applies it)."""

    name = "dip-ca"
    cache_aware = True


class Calibrated(DIP):
    """DIP's two sides with per-layer thresholds instead of one top-k (allocation.py):
    input dims with |x_i| >= t_in[layer], neurons with |h~_j| >= t_out[layer]. Each
    layer and side keeps the share the calibration search gave it for this average
    `--density` (of the FFN's weight bytes per token)."""

    name = "calibrated"
    needs = "thresholds"

    def __init__(self, density, allocation):
        super().__init__(density)
        self.allocation = allocation

    @property
    def thresholds(self):
        """Per layer (t_in, t_out)."""
        return [tuple(t) for t in self.allocation.threshold.tolist()]

    @classmethod
    def build(cls, ctx):
        from .allocation import allocation

        return cls(ctx.density, allocation(ctx.manifest.calibration["thresholds"], ctx.density))


class CalibratedCacheAware(Calibrated):
    """`calibrated` with DIP-CA's re-weighting: a token keeps as many entries per side as
    the thresholds give it, the top ones once uncached scores are scaled by gamma."""

    name = "calibrated-ca"
    cache_aware = True


class CalibratedUniform(Calibrated):
    """The ablation of `calibrated`: the same calibrated thresholds machinery, but every
    layer and side keeps `--density` (what the per-layer search is measured against)."""

    name = "calibrated-uniform"

    @classmethod
    def build(cls, ctx):
        from .allocation import uniform

        return cls(ctx.density, uniform(ctx.manifest.calibration["thresholds"], ctx.density))

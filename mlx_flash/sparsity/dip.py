"""dip, dip-ca: Dynamic Input Pruning (Federici et al. §4-5), with cache-aware masking;
calibrated, calibrated-ca: the same two sides with per-layer thresholds (allocation.py);
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
    `--density` (of the FFN's weight bytes per token). With `mlx_flash.calibrate --recover`'s
    adapters in the folder (recovery.py), each layer adds its adapter's B (A x), resident,
    unless --no-recovery."""

    name = "calibrated"
    needs = "thresholds"
    uses_recovery = True

    def __init__(self, density, allocation, adapters=None, score_norms=None):
        super().__init__(density)
        self.allocation = allocation
        self.adapters = adapters  # per layer (A^T [d, r], B^T [r, d]) or None
        # per layer (input dims' [d], neurons' [d_ff]) weight norms the scores are weighed by
        # (the wina score, allocation.py), or None: |x| and |h~| as they are
        self.score_norms = score_norms
        self.resident_bytes = sum(a.nbytes + b.nbytes for a, b in adapters) if adapters else 0
        self.resident_bytes += sum(a.nbytes + b.nbytes for a, b in score_norms) if score_norms else 0

    @property
    def thresholds(self):
        """Per layer (t_in, t_out)."""
        return [tuple(t) for t in self.allocation.threshold.tolist()]

    @classmethod
    def build(cls, ctx):
        from .allocation import allocation

        return cls(ctx.density, allocation(ctx.manifest.calibration["thresholds"], ctx.density),
                   cls._adapters(ctx), cls._norms(ctx))

    @staticmethod
    def _norms(ctx):
        from .allocation import read_norms

        return read_norms(ctx.folder, ctx.manifest, ctx.verify)

    @classmethod
    def _adapters(cls, ctx):
        """calibrate --recover's adapters, when the folder has them and they are wanted (a line
        says which)."""
        import logging

        from .recovery import load_adapters

        section = ctx.manifest.calibration.get("recovery")
        if section is None:
            return None
        log = logging.getLogger("mlx_flash")
        if not (cls.uses_recovery and ctx.recovery):
            why = "--no-recovery" if cls.uses_recovery else f"{cls.name} is the search's ablation"
            log.warning("%s: recovery adapters (calibrate --recover) left out: %s", ctx.folder, why)
            return None
        adapters = load_adapters(ctx.folder, ctx.manifest, ctx.dtype, ctx.verify)
        log.warning("%s: adding the recovery adapters of calibrate --recover (rank %d, trained at --density "
                    "%g%s; --no-recovery leaves them out)", ctx.folder, section["rank"], section["density"],
                    "" if abs(section["density"] - ctx.density) < 1e-9 else f", running at {ctx.density:g}")
        return adapters


class CalibratedCacheAware(Calibrated):
    """`calibrated` with DIP-CA's re-weighting: a token keeps as many entries per side as
    the thresholds give it, the top ones once uncached scores are scaled by gamma."""

    name = "calibrated-ca"
    cache_aware = True


class CalibratedUniform(Calibrated):
    """The ablation of `calibrated`: the same calibrated thresholds machinery, but every
    layer and side keeps `--density` (what the per-layer search is measured against)."""

    name = "calibrated-uniform"
    uses_recovery = False  # the adapters were trained for the searched thresholds

    @classmethod
    def build(cls, ctx):
        from .allocation import uniform

        return cls(ctx.density, uniform(ctx.manifest.calibration["thresholds"], ctx.density), cls._adapters(ctx),
                   cls._norms(ctx))

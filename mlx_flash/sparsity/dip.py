"""dip, dip-ca: Dynamic Input Pruning (Federici et al. §4-5), with cache-aware masking.

These sources choose input dimensions and neurons from the FFN's own computation
(|x|, then |h~|), so they run in the DIP store (runtime/stores/dip.py), which
computes h~ itself; the class says so, and what the model needs: a SwiGLU FFN
and the DIP orientation on flash (`mlx_flash.convert --dip`)."""

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

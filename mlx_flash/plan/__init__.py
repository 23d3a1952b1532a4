"""--mode auto's plan, and what a limit leaves the weights.

cost.py     the cost model: a plan's work per token -> predicted I/O, compute, total
choose.py   the exact plan (dense, hybrid, naive; float16 rows or not) predicted fastest
profile.py  the machine profile the cost model reads (mlx_flash.benchmark profile writes it)
measure.py  the machine probe that measures it (disk, compute, per-layer costs), and the quick
            probe generate --explain runs when none is cached
explain.py  --explain: the plan and its predicted breakdown
fit.py      what --memory-limit / --memory-budget leave the weights, the KV cache's place and
            the prompt chunks, decided before the weights load (the loader calls it)
"""

from .choose import choose_exact
from .cost import predict, predict_at_disk_rate
from .profile import load_profile

__all__ = ["choose_exact", "load_profile", "predict", "predict_at_disk_rate"]

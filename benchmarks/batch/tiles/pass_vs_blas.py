"""A batch's decode step past 32 sequences: the pass kernels' tiles (kernels.BATCH_PASS 256)
against dequantized chunks + BLAS (BATCH_PASS 32), GB/s of a 7B FFN matrix (11008 x 4096)
consumed by a step of 32 / 64 / 128 sequences, per weight form, through the profile's own timing
(plan/measure.py _rates_at: the runtime's modules and FlashFFN's kernels, 128 MB of distinct
copies cycled through). The two settings alternate, two rounds.

usage: .venv/bin/python benchmarks/batch/tiles/pass_vs_blas.py
"""
import mlx_flash  # noqa: F401 (before mlx.core)
from mlx_flash.kernels import passes as K  # (the pass kernels' caps: BATCH_PASS, PROMPT_PASS, SMALL_PASS)
from mlx_flash.plan import measure as bp

FORMS = ("q4", "q4-rows", "q8", "q8-rows", "float16", "float32")
with K.pass_notes_off():
    for rnd in range(2):
        for cap in (32, 256):
            K.BATCH_PASS = cap
            for P in (32, 64, 128):
                r = bp._rates_at(11008, 4096, 4, bp.STREAMED_BYTES // 2, positions=P)
                print(f"round {rnd + 1} BATCH_PASS {cap:3d} {P:3d} sequences: "
                      + ", ".join(f"{f} {r[f]:.2f}" for f in FORMS), flush=True)

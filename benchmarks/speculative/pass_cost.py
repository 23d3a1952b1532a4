"""The cost of one forward pass of L positions after a prompt (a speculative verify pass is
one of 2-5 positions), with the few-position kernels path on and off, rounds alternating.

    .venv/bin/python benchmarks/speculative/pass_cost.py                         # dense, the default model
    .venv/bin/python benchmarks/speculative/pass_cost.py --mode hybrid --memory-budget 50%

"on": passes of up to kernels.SMALL_PASS positions run the one-position native kernels
position by position; "off" (SMALL_PASS = 0): every pass of several positions dequantizes
the resident matrices (and the FFN rows) into chunks for BLAS, as before. Prints the
median ms of each (L, path) over the rounds and their ratio.
"""

import argparse
import sys
import time

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_flash import kernels

PROMPT = "Tell me a story about a robot who learns to paint pictures of the sea."


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--mode", default=None)
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--positions", default="1,2,3,4,5")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    opts = {k: v for k, v in (("mode", a.mode), ("memory_budget", a.memory_budget)) if v}
    model, tok = mlx_flash.load(a.model, **opts)
    ids = tok.encode(PROMPT)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([ids]), cache=cache))
    on = kernels.SMALL_PASS
    lengths = [int(v) for v in a.positions.split(",")]
    ms = {(L, path): [] for L in lengths for path in ("on", "off")}
    for r in range(a.rounds):
        for path in (("on", "off") if r % 2 == 0 else ("off", "on")):
            kernels.SMALL_PASS = on if path == "on" else 0
            for L in lengths:
                t0 = time.perf_counter()
                mx.eval(model(mx.array([ids[:L]]), cache=cache))
                ms[(L, path)].append(1e3 * (time.perf_counter() - t0))
                trim_prompt_cache(cache, L)
    kernels.SMALL_PASS = on
    print(f"{a.model} {opts or 'dense'}: ms per pass, median of {a.rounds} rounds (SMALL_PASS = {on})")
    for L in lengths:
        m_on, m_off = np.median(ms[(L, 'on')]), np.median(ms[(L, 'off')])
        print(f"L={L}: on {m_on:.1f}  off {m_off:.1f}  off/on {m_off / m_on:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

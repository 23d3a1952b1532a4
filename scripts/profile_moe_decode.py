"""Where a mixture of experts' decode token goes: ms per token and cProfile's top functions.

    .venv/bin/python scripts/profile_moe_decode.py MODEL [--budget 50%] [--tokens 8] [--top 18]

Loads MODEL under --memory-budget, runs a 4-token prompt and 4 warm-up tokens, then profiles
--tokens decode tokens (the profiler adds its own overhead: compare rows of one run).
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--budget", default="50%")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--top", type=int, default=18)
    a = p.parse_args()
    import mlx_flash
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_flash.load(a.model, memory_budget=a.budget)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    token = mx.array([[5]])
    for _ in range(4):
        mx.eval(model(token, cache=cache))
    times, prof = [], cProfile.Profile()
    prof.enable()
    for _ in range(a.tokens):
        t0 = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append(time.perf_counter() - t0)
    prof.disable()
    print("ms per token:", [round(1000 * t) for t in times])
    print("expert buffer hit rate:", model.runtime.stats()["summary"]["hit_rate"])
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()

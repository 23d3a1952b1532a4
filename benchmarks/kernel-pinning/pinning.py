"""The kernels' workers pinned or not: a model decoded with the pool's pinning on and
off in alternating rounds within one process (kernels set_pinning), the order flipped each round:
ms a token (median of the decode), and the runtime's per-token I/O and compute means.

usage: .venv/bin/python benchmarks/kernel-pinning/pinning.py MODEL MODE [--memory-budget B] [--tokens N] [--rounds R]
        [--no-prefetch]
"""
import argparse, statistics, time
import mlx_flash
from mlx_flash import load
from mlx_flash.generate import stream_generate
from mlx_flash.kernels import kernels_module

ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("mode")
ap.add_argument("--memory-budget"); ap.add_argument("--tokens", type=int, default=8)
ap.add_argument("--rounds", type=int, default=3); ap.add_argument("--no-prefetch", action="store_true")
a = ap.parse_args()
kw = dict(mode=a.mode)
if a.memory_budget: kw["memory_budget"] = a.memory_budget
if a.no_prefetch: kw["prefetch"] = False
model, tok = load(a.model, **kw)
K, _ = kernels_module()
store = model.runtime.store
if store is not None and store.stats is not None:
    store.timed = True
def run():
    if store is not None and store.stats is not None:
        store.stats.rows.clear()
    times, last = [], time.perf_counter()
    for _ in stream_generate(model, tok, "The history of the", max_tokens=a.tokens):
        now = time.perf_counter(); times.append(now - last); last = now
    s = model.runtime.stats()["summary"]
    return statistics.median(times[1:]) * 1e3, s.get("mean_io_ms", 0.0), s.get("mean_compute_ms", 0.0)
run()  # warm
got = {False: [], True: []}
for r in range(a.rounds):
    for pin in ((False, True) if r % 2 == 0 else (True, False)):
        K.set_pinning(pin)
        got[pin].append(run())
        print(f"round {r} pinned={pin}: {got[pin][-1][0]:.1f} ms a token (I/O {got[pin][-1][1]:.1f}, compute {got[pin][-1][2]:.1f})", flush=True)
print(f"{a.model} {a.mode} budget={a.memory_budget} prefetch={not a.no_prefetch}, {a.tokens} tokens, {a.rounds} rounds:")
for pin in (False, True):
    ms = [g[0] for g in got[pin]]; io = [g[1] for g in got[pin]]; c = [g[2] for g in got[pin]]
    print(f"  pinned={pin!s:5s} ms a token median {statistics.median(ms):.1f} (rounds {', '.join(f'{m:.0f}' for m in ms)}); "
          f"I/O {statistics.median(io):.1f}, compute {statistics.median(c):.1f}")

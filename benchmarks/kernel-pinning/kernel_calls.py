"""What each native product took inside a decode: the kernels of the 4-bit OPT-6.7B
shape timed call by call (the attention's four products by their place in the layer, the FFN's
rows and columns), in --mode dense or --mode naive without prefetch, 3 runs of 6 tokens; and
the threads' CPU seconds. The pool's pinning follows MLX_FLASH_KERNEL_PIN (0: off).

usage: [MLX_FLASH_KERNEL_PIN=0] .venv/bin/python benchmarks/kernel-pinning/kernel_calls.py MODEL dense|naive
"""
import collections, os, statistics, sys, time
import mlx_flash
from mlx_flash import load
from mlx_flash.generate import generate
import mlx_flash.kernels as kmod

ev = []
def timed(name, f):
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); ev.append((name(a), time.perf_counter() - t)); return r
    return g
kmod.qmv_rows = timed(lambda a: "qmv_rows", kmod.qmv_rows)
kmod.qaxpy_cols = timed(lambda a: "qaxpy_cols", kmod.qaxpy_cols)
mode = sys.argv[2]
opts = dict(mode="naive", prefetch=False, verify=False) if mode == "naive" else dict(mode="dense")
model, tok = load(sys.argv[1], **opts)
K = kmod.kernels_module()[0]
K.qmv = timed(lambda a: f"qmv n={a[5]}", K.qmv)  # (QuantMatrix calls it through the module)
generate(model, tok, "The", max_tokens=1)
def cpu_s():
    out = {}
    for t in os.listdir("/proc/self/task"):
        f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
        out[t] = (open(f"/proc/self/task/{t}/comm").read().strip(), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    return out
for run in range(3):
    ev.clear(); a = cpu_s(); t0 = time.perf_counter()
    generate(model, tok, "The", max_tokens=6)
    wall, b = time.perf_counter() - t0, cpu_s()
    by, i = collections.defaultdict(list), 0
    for name, d in ev:
        if name == "qmv n=4096":
            by[f"attention {'qkvo'[i % 4]}"].append(d); i += 1
        elif name in ("qmv_rows", "qaxpy_cols"):
            by[name].append(d)
    busy = sorted(((v[0], round(v[1] - a.get(k, ("", 0))[1], 2)) for k, v in b.items()), key=lambda z: -z[1])[:3]
    print(f"{mode} pinning={K.pinning()} run {run}: " + "  ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in by.items())
          + f" (ms, medians); {wall:.1f} s; threads' CPU s {busy}")

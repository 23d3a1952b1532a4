"""The reload test's measurement (tests/test_memory_limit.py test_a_load_planned_again_does_not_count_its_first_attempt)
printed: the runtime each plan measured, and the second plan's less the first's (stop 45: 22.0-23.0 MB on
this stop's code and 22.0-22.1 on 3d0bf44, run with PYTHONPATH at a worktree of it; a CI run 25.2).

usage: .venv/bin/python results/memory-limit-stop45/reload.py   (from the checkout, after `make model`)
"""
import subprocess, sys
smollm2 = "models/smollm2-135m-instruct"
probe = f"""
import mlx_flash
from mlx_flash.runtime import memory
rss = memory.process_rss()
m, t = mlx_flash.load({smollm2!r}, mode="dense", memory_limit="2GB", ctx_size=2048, progress=False)
print("added", m.runtime.memory.baseline - rss)
"""
r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
added = int(r.stdout.strip().splitlines()[-1].split()[1])
code = f"""
import mlx_flash, mlx_flash.plan.fit as L
from mlx_flash.runtime import memory
MB = 10**6
shape = memory.Shape(n_layers=30, d_model=576, n_ff=1536, n_heads=9, kv_per_token=30 * 2 * 192, vocab=49152)
rss = memory.process_rss()
def weights(lim):
    try:
        return memory.plan_memory(str(lim), shape, 4, 2048, baseline=rss + {added}).weights
    except Exception:
        return 0
limit = next(lim for lim in range(rss + 100 * MB, rss + 800 * MB, 5 * MB) if weights(lim) > 60 * MB)
seen = []
plan = L.plan_memory
def spy(*a, **k):
    seen.append(memory.process_rss())
    return plan(*a, **k)
L.plan_memory = spy
m, t = mlx_flash.load({smollm2!r}, mode="dense", memory_limit=str(limit), ctx_size=2048, progress=False)
print("flash", m.runtime.memory.kv_on_flash, "runtimes", *[round(v/1e6,1) for v in seen], "diff", round((seen[-1]-seen[0])/1e6, 1))
"""
r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print(r.stdout.strip().splitlines()[-1])

"""A 4-bit OPT-6.7B batch step's FFN kernels, call by call: at --memory-budget 50 % (hybrid) each layer's
FFN is two parts of 8192 neurons, the held one first, each through qmm_rows (up) and qmm_cols (down).
The first part runs while the next layer's streamed rows are being read (prefetch), the second after
those reads are done. Prints ms a step and the mean ms of the first (even) and second (odd) calls of
each kernel over 4 decode steps of 16 sequences (stop 45: qmm_cols 11.9 vs 8.7 ms, qmm_rows 9.5 vs 8.9);
with "dense", one part of 16384 a layer and no reads.

usage: .venv/bin/python results/batch/stop45-opt-6.7b-q4/parts.py hybrid|dense [verify|noverify] [reader threads, default 32]
(noverify: load(verify=False), no CRC check of the reads)
"""
import sys, time
import mlx_flash  # noqa: F401 (before mlx.core)
import numpy as np
from mlx_flash import kernels as K
from mlx_flash.bench.random_model import build_checkpoint, shape_config
mode = sys.argv[1]
folder = build_checkpoint("opt-6.7b", "q4", progress=False)
model, tok = mlx_flash.load(folder, mode=mode, memory_budget=None if mode == "dense" else "50%", progress=False,
                            verify="noverify" not in sys.argv[2:], threads=int(sys.argv[3]) if len(sys.argv) > 3 else 32)
rng = np.random.default_rng(0); V = shape_config("opt-6.7b")["vocab_size"]
seq = {}
for name in ("qmm_rows", "qmm_cols"):
    real = getattr(K, name)
    def wrap(*a, real=real, name=name, **k):
        t = time.perf_counter(); r = real(*a, **k); dt = time.perf_counter() - t
        seq.setdefault(name, []).append(dt)
        return r
    setattr(K, name, wrap)
mlx_flash.batch_generate(model, tok, [rng.integers(1, V, 4).tolist() for _ in range(2)], max_tokens=2, stop=False)
seq.clear()
r = mlx_flash.batch_generate(model, tok, [rng.integers(1, V, 4).tolist() for _ in range(16)], max_tokens=4, stop=False)
print("ms/step", 1e3 * r.decode_seconds / r.steps, "steps", r.steps)
for name, ts in seq.items():
    ts = np.array(ts); print(name, len(ts), "even %.2f odd %.2f ms" % (1e3*ts[0::2].mean(), 1e3*ts[1::2].mean()))

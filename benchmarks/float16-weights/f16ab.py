"""A/B: float16 SmolLM2 decode held at float16 with the native 16-bit kernels
against the float32 arena + BLAS they replace (the loader's and the dense store's kernels
switched off for that model alone), and held at float32; alternating rounds in one process."""
import sys, numpy as np
import mlx_flash, mlx.core as mx
from mlx_flash import loader
from mlx_flash.runtime.stores import dense
from mlx_flash.eval.speed import _decode, PROMPT
model_path = sys.argv[1] if len(sys.argv) > 1 else "/work/big/smollm2-f16"
def load(kw, kernels=True):
    saved = loader._half_kernels, dense.cpu_kernels
    if not kernels:
        loader._half_kernels, dense.cpu_kernels = (lambda *a: None), (lambda: None)
    try:
        return mlx_flash.load(model_path, progress=False, **kw)
    finally:
        loader._half_kernels, dense.cpu_kernels = saved
models = {"held at float16, 16-bit kernels": load(dict(mode="dense", resident_dtype="float16")),
          "held at float16, float32 arena + BLAS": load(dict(mode="dense", resident_dtype="float16"), kernels=False),
          "held at float32 (BLAS)": load(dict(mode="dense", resident_dtype="float32"))}
tok = next(iter(models.values()))[1]
prompt = mx.array(tok.encode(PROMPT))
res = {n: [] for n in models}
names = list(models)
for r in range(3):
    for n in names[r % 3:] + names[: r % 3]:
        res[n].append(1e3 * float(np.mean(_decode(models[n][0], prompt, 32))))
print("| held as | ms/token (median of 3) | rounds | weights in DRAM |")
print("| --- | --- | --- | --- |")
for n, v in res.items():
    w = models[n][0].runtime.stats()["summary"].get("weights_in_dram_bytes", 0)
    print(f"| {n} | {np.median(v):.1f} | {' / '.join(f'{x:.1f}' for x in v)} | {w / 1e6:.0f} MB |", flush=True)

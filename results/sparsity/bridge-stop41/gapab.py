"""Ad hoc A/B (stop 41): the reader's bridge rule, one bundle (old) against the reader's gap (new),
alternating within one process on the same loaded models, SmolLM2 4-bit, --memory-budget 22%."""
import sys, numpy as np
import mlx_flash, mlx.core as mx
from mlx_flash.io import reader as R
from mlx_flash.eval.speed import _decode, PROMPT
orig = R.FlashReader.read_bundles
OLD = [False]
def rb(self, f, ids, stride, segs, rows, base=0, gap=None, checks=None):
    if gap is None and OLD[0]:
        gap = min(self.coalesce_gap, stride)
    return orig(self, f, ids, stride, segs, rows, base=base, gap=gap, checks=checks)
R.FlashReader.read_bundles = rb
cfgs = {"calibrated 0.5": dict(sparsity="calibrated", density=0.5), "calibrated 0.7": dict(sparsity="calibrated", density=0.7),
        "calibrated-ca 0.5": dict(sparsity="calibrated-ca", density=0.5), "dip 0.5": dict(sparsity="dip", density=0.5)}
budget = sys.argv[1]
res = {}
for n, kw in cfgs.items():
    m, tok = mlx_flash.load("models/smollm2-135m-instruct", mode="flash", memory_budget=budget, progress=False, **kw)
    prompt = mx.array(tok.encode(PROMPT)); _decode(m, prompt, 4)
    st = m.runtime.store.stats
    for r in range(3):
        for old in ((True, False) if r % 2 == 0 else (False, True)):
            OLD[0] = old
            st.end(); k0 = len(st.rows)
            ms = 1e3 * np.mean(_decode(m, prompt, 32))
            st.end(); rows = [x for x in st.rows[k0:] if x["tokens"] == 1]
            d = res.setdefault((n, old), {"ms": [], "io": [], "MB": [], "reads": []})
            d["ms"].append(ms); d["io"].append(np.mean([x["io_ms"] for x in rows]))
            d["MB"].append(np.mean([x["bytes_read"] for x in rows]) / 1e6); d["reads"].append(np.mean([x["reads"] for x in rows]))
    m.runtime.close()
    for old in (True, False):
        d = res[(n, old)]
        print(f"| {n} | {'one bundle' if old else '16 KiB'} | {np.median(d['ms']):.1f} | {' / '.join(f'{v:.0f}' for v in d['ms'])} | "
              f"{np.median(d['io']):.1f} | {np.median(d['MB']):.1f} | {np.median(d['reads']):.0f} |", flush=True)

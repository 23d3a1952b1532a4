"""Where a dense decode step of the real model goes: each layer's attention and FFN, the output
head, timed inside the real forward (each part evaluated on its own: one synchronisation per
part, so the sum is a little above an unsynchronised step), with each part's weight bytes and
the rate they were read at beside the machine's memory bandwidth (a float32 reduction).

    .venv/bin/python benchmarks/qwen-1.5b/profile.py [--model models/qwen2.5-coder-1.5b-instruct]
"""

import argparse
import time
from collections import defaultdict

import mlx_flash  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def nbytes(module):
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def bandwidth(n=1 << 28):
    a = mx.random.uniform(shape=(n // 4,))
    mx.eval(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(mx.sum(a))
        best = max(best, n / (time.perf_counter() - t) / 1e9)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/qwen2.5-coder-1.5b-instruct")
    p.add_argument("--tokens", type=int, default=12)
    args = p.parse_args()
    model, tok = mlx_flash.load(args.model, mode="dense")
    inner = model.model
    times = defaultdict(float)

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if isinstance(out, mx.array):  # (a host step's parts return NumPy: already computed)
                mx.eval(out)
            times[name] += time.perf_counter() - t
            return out
        return call

    attn_cls, mlp_cls = type(inner.layers[0].self_attn), type(inner.layers[0].mlp)
    # a decode position on the CPU runs the parts' host steps (models/host.py), elsewhere __call__
    saved = [(c, n, getattr(c, n)) for c in (attn_cls, mlp_cls) for n in ("__call__", "host_step")]
    for c, n, fn in saved:
        setattr(c, n, timed("attention" if c is attn_cls else "ffn", fn))
    head = model.lm_head  # (its class also serves the attention's projections: timed apart, below)

    cache = make_prompt_cache(model)
    ids = tok.encode("def quicksort(arr):\n    " * 20)[:150]
    mx.eval(model(mx.array([ids]), cache=cache))
    y = mx.array([[ids[-1]]])
    times.clear()
    t0 = time.perf_counter()
    for _ in range(args.tokens):
        out = model(y, cache=cache)
        y = mx.argmax(out[:, -1, :], axis=-1)[None]
        mx.eval(y)
    total = (time.perf_counter() - t0) / args.tokens
    for c, n, fn in saved:
        setattr(c, n, fn)
    h = mx.random.normal((1, 1, model.args.hidden_size))
    mx.eval(head(h))
    t = time.perf_counter()
    for _ in range(args.tokens):
        mx.eval(head(h))
    times["head"] = time.perf_counter() - t

    from mlx_flash.layout.format import read_manifest

    m = read_manifest(args.model)
    parts = {"attention": sum(nbytes(l.self_attn) for l in inner.layers),
             "ffn": m.layout.bundle_bytes * model.args.intermediate_size * len(inner.layers),
             "head": nbytes(head)}
    head_rate = parts["head"] / (times["head"] / args.tokens)  # what one native 8-bit matvec reaches
    print(f"{args.model}: decode step {total * 1000:.1f} ms (attention and FFN synchronised per layer; "
          f"the head timed alone); a float32 sum reads {bandwidth():.1f} GB/s, the head's matvec "
          f"{head_rate / 1e9:.1f} GB/s")
    print("| part | ms/token | weight MB | GB/s | at the head's rate (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("attention", "ffn", "head"):
        ms = times[name] / args.tokens * 1000
        b = parts[name]
        print(f"| {name} | {ms:.1f} | {b / 1e6:.0f} | {b / 1e9 / (ms / 1000):.1f} | {b / head_rate * 1000:.1f} |")
    rest = total * 1000 - sum(times[n] / args.tokens * 1000 for n in ("attention", "ffn", "head"))
    print(f"| the rest (norms, embedding, sampling, Python) | {rest:.1f} | | | |")
    step, around = around_the_kernels(model, cache, y, args.tokens)
    print(f"unsynchronised step {step:.1f} ms; the same step with every native product returning zeros "
          f"(the runtime around the kernels: the host step's or MLX's small ops, synchronisations, Python) "
          f"{around:.1f} ms; "
          f"so the kernels {step - around:.1f} ms (medians of {ROUNDS} alternating rounds)")


ROUNDS = 7


def around_the_kernels(model, cache, y, tokens):
    """Median ms of a decode step, and of the same step with the native products (the
    quantized matvecs, the FFN's row and column kernels) replaced by zeros, in alternating
    rounds: the time the runtime spends around the kernels."""
    import numpy as np

    import mlx_flash.kernels as kernels
    from mlx_flash.kernels import QuantMatrix

    real = (QuantMatrix.matvec, kernels.qmv_rows, kernels.qaxpy_cols)

    def matvec(self, x, out=None):
        return np.zeros(self.n, np.float32) if out is None else out

    def rows(k, x, buf, sel, *rest):
        return np.zeros(len(sel), np.float32)

    def cols(k, h, buf, sel, trow, tables, spec, out=None):
        return np.zeros(tables[0].shape[1], np.float32) if out is None else out

    got = {True: [], False: []}
    try:
        for _ in range(ROUNDS):
            for stubbed in (False, True):
                QuantMatrix.matvec, kernels.qmv_rows, kernels.qaxpy_cols = (matvec, rows, cols) if stubbed else real
                t = time.perf_counter()
                for _ in range(max(1, tokens // 4)):
                    mx.eval(model(y, cache=cache))
                got[stubbed].append((time.perf_counter() - t) / max(1, tokens // 4) * 1000)
    finally:
        QuantMatrix.matvec, kernels.qmv_rows, kernels.qaxpy_cols = real
    return float(np.median(got[False])), float(np.median(got[True]))


if __name__ == "__main__":
    main()

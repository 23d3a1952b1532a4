"""How many times a decoded token makes the host wait for MLX, per mode.

    .venv/bin/python benchmarks/host-syncs/host_syncs.py                          # SmolLM2, every mode
    .venv/bin/python benchmarks/host-syncs/host_syncs.py --configs "flash dip 0.5" --tokens 16
    .venv/bin/python benchmarks/host-syncs/host_syncs.py --cache-writes staged --resident-dtype float32   # a GPU's path

Counts, while `--tokens` greedy tokens decode after a short prompt, the calls on the
per-token path that wait for MLX's results on the host: mx.eval, np.array / np.asarray
of an MLX array, and the native kernels' host_f32 (a vector handed to C). Each is a
synchronisation: on a GPU the host waits for the device, and on a discrete one the data
crosses. mlx_lm's own generate loop (one eval per token for the sampled id, and its
async_eval) is counted too and shown apart, as the floor every mode shares. The counts
are per token (the prompt's pass is left out) and per layer.

The counting patches mlx.core.eval, numpy.array / numpy.asarray and kernels.host_f32
for the run (module attributes, looked up at each call): nothing in the runtime changes.
"""

import argparse
import sys
from collections import Counter
from contextlib import contextmanager

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import mlx_flash.kernels as kernels

PROMPT = "Explain in a few sentences why the sky is blue."
CONFIGS = {
    "dense": dict(mode="dense"),
    "naive": dict(mode="naive", memory_budget="50%"),
    "hybrid": dict(mode="hybrid", memory_budget="50%"),
    "flash threshold 0.5": dict(mode="flash", sparsity="threshold", density=0.5),
    "flash dip 0.5": dict(mode="flash", sparsity="dip", density=0.5, memory_budget="50%"),
    "flash calibrated 0.5": dict(mode="flash", sparsity="calibrated", density=0.5, memory_budget="50%"),
}


@contextmanager
def counting(counts):
    """Count host synchronisations by kind while the block runs."""
    eval_, array_, asarray_, host_ = mx.eval, np.array, np.asarray, kernels.host_f32
    inside = []  # within host_f32: its own eval and view are that one synchronisation

    def count(kind):
        if not inside:
            counts[kind] += 1

    def ev(*a, **k):
        count("mx.eval")
        return eval_(*a, **k)

    def arr(x, *a, **k):
        if isinstance(x, mx.array):
            count("np.array")
        return array_(x, *a, **k)

    def asarr(x, *a, **k):
        if isinstance(x, mx.array):
            count("np.asarray")
        return asarray_(x, *a, **k)

    def host(x):
        count("host_f32")
        inside.append(1)
        try:
            return host_(x)
        finally:
            inside.pop()

    mx.eval, np.array, np.asarray, kernels.host_f32 = ev, arr, asarr, host
    try:
        yield counts
    finally:
        mx.eval, np.array, np.asarray, kernels.host_f32 = eval_, array_, asarray_, host_


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of: " + ", ".join(CONFIGS))
    p.add_argument("--cache-writes", choices=("host", "staged"), default=None,
                   help="every mode but dense: how rows enter the caches (staged: a GPU's default)")
    p.add_argument("--resident-dtype", default=None,
                   help="float32: attention and embeddings dequantized (no CPU-only native quantized matvec, "
                   "whose every call is a host synchronisation; a GPU uses mx.quantized_matmul)")
    a = p.parse_args(argv)
    print(f"| mode | host syncs / token | of them mlx_lm's loop | per layer (runtime) | by kind |")
    print("| --- | --- | --- | --- | --- |")
    for name in [n.strip() for n in a.configs.split(",")]:
        kw = dict(CONFIGS[name])
        if a.cache_writes and kw["mode"] != "dense":
            kw["cache_writes"] = a.cache_writes
        if a.resident_dtype:
            kw["resident_dtype"] = a.resident_dtype
        model, tok = mlx_flash.load(a.model, **kw)
        n_layers = len(model.layers)
        prompt = mx.array(tok.encode(PROMPT))
        steps = generate_step(prompt, model, max_tokens=a.tokens + 1)
        next(steps)  # the prompt's pass, not counted
        counts = Counter()
        with counting(counts):
            for _ in steps:
                pass
        # mlx_lm's loop: async_eval is not counted; .item() on the token id is one per token
        total = sum(counts.values()) / a.tokens
        loop = 1.0  # y.item() of the sampled token, every step
        kinds = ", ".join(f"{k} {v / a.tokens:.1f}" for k, v in sorted(counts.items()))
        print(f"| {name} | {total + loop:.1f} | {loop:.1f} | {total / n_layers:.2f} | {kinds} |", flush=True)
        model.runtime.close()


if __name__ == "__main__":
    sys.exit(main())

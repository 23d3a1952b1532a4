"""Decode speed of weights held at float32 vs float16 in DRAM (--resident-dtype), in one run.

    python scripts/bench_held.py --rounds 3 --tokens 40
    python scripts/bench_held.py --configs dense:-,dense:-:float16,hybrid:190MB:float16

Each config is `mode:budget[:float16]` (budget `-` for none); rounds alternate the
configs (a shared machine drifts); the median decode tok/s (tokens after the 8th)
of each, and the greedy tokens, which must be equal across configs (exact modes).
Also times MLX's CPU matmul per dtype and the float16 -> float32 converters, which
are why the held path converts before BLAS.
"""

import argparse
import time

import mlx_flash  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np


def decode_speed(model, prompt, tokens):
    from mlx_lm.generate import generate_step

    ts, out, t = [], [], time.perf_counter()
    for tok, _ in generate_step(prompt, model, max_tokens=tokens):
        now = time.perf_counter()
        ts.append(now - t)
        t = now
        out.append(int(tok))
    return 1 / float(np.median(ts[8:])), out


def dtype_matmuls(rows=1536, cols=576, repeat=50):
    x = mx.random.normal((1, cols))
    w = mx.random.normal((rows, cols))
    mx.eval(x, w)
    res = {}
    for name, dt in (("float32", mx.float32), ("float16", mx.float16), ("bfloat16", mx.bfloat16)):
        wd, xd = w.astype(dt), x.astype(dt)
        mx.eval(wd, xd)
        mx.eval(xd @ wd.T)
        t = time.perf_counter()
        for _ in range(repeat):
            mx.eval(xd @ wd.T)
        res[name] = wd.nbytes * repeat / (time.perf_counter() - t) / 1e9
    return res


def converters(n=1 << 22, repeat=10):
    from mlx_flash.io.reader import native_convert

    a = np.random.rand(n).astype(np.float16)
    d = np.empty(n, np.float32)
    m = mx.array(a)
    mx.eval(m)
    conv = native_convert()
    out = {}
    for name, f in (("mlx astype", lambda: mx.eval(m.astype(mx.float32))),
                    ("numpy astype", lambda: a.astype(np.float32)),
                    ("mlx_flash (F16C)", lambda: conv(a, 1, d, 0, n))):
        f()
        t = time.perf_counter()
        for _ in range(repeat):
            f()
        out[name] = n * 4 * repeat / (time.perf_counter() - t) / 1e9
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--configs", default="dense:-,dense:-:float16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=40)
    a = p.parse_args()
    from mlx_flash import load
    from mlx_flash.blas import blas_info

    print(f"BLAS: {blas_info()}")
    print("MLX CPU matvec 1536x576, GB/s of weights:",
          ", ".join(f"{k} {v:.1f}" for k, v in dtype_matmuls().items()))
    print("float16 -> float32, GB/s of float32 out:",
          ", ".join(f"{k} {v:.1f}" for k, v in converters().items()))
    prompt = mx.array(list(range(1000, 1160)))
    configs = [c.split(":") for c in a.configs.split(",")]
    speeds, tokens = {}, {}
    for _ in range(a.rounds):
        for c in configs:
            mode, budget, held = c[0], c[1], c[2] if len(c) > 2 else None
            model, _ = load(a.model, mode=mode, memory_budget=None if budget == "-" else budget,
                            resident_dtype=held)
            s, toks = decode_speed(model, prompt, a.tokens)
            speeds.setdefault(":".join(c), []).append(s)
            tokens[":".join(c)] = toks
            del model
    for k, v in speeds.items():
        print(f"{k:28s} median {np.median(v):5.2f} tok/s (rounds {', '.join(f'{x:.2f}' for x in v)})")
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"greedy tokens equal across configs: {same}")


if __name__ == "__main__":
    main()

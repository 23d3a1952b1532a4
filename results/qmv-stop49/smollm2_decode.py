"""SmolLM2-135M-Instruct at 4 bits (`make model`), --mode dense, greedy decode of 64 tokens after a
short prompt: ms a token before and after stop 49's change to the one-position kernel (the row's
scales read where they lie), each variant in its own process (--old-so: the kernels built from
the commit before, loaded in place of this build's), rounds alternating, medians. Its products
(576 and 1536 wide) are below the pool's sharing size: one thread.

usage: .venv/bin/python results/qmv-stop49/smollm2_decode.py --old-so DIR/_matvec...so [--rounds 4]
"""
import argparse, importlib.util, statistics, subprocess, sys, time


def child(so):
    if so:
        spec = importlib.util.spec_from_file_location("mlx_flash.kernels._matvec", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["mlx_flash.kernels._matvec"] = mod
    import mlx_flash
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = mlx_flash.load("models/smollm2-135m-instruct", mode="dense")
    ids = tok.encode("The history of the sea is")
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([ids]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    for _ in range(8):  # warm-up
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    t = time.perf_counter()
    for _ in range(64):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    print(f"RESULT {(time.perf_counter() - t) / 64 * 1e3:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-so", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child is not None:
        return child(a.child if a.child != "-" else "")
    times = {"old": [], "new": []}
    for r in range(a.rounds):
        for build in (("old", "new") if r % 2 == 0 else ("new", "old")):
            out = subprocess.run([sys.executable, __file__, "--old-so", a.old_so, "--child",
                                  a.old_so if build == "old" else "-"], capture_output=True, text=True, check=True).stdout
            times[build].append(float([l for l in out.splitlines() if l.startswith("RESULT")][0].split()[1]))
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"SmolLM2 4-bit dense decode, {a.rounds} rounds, medians: before {old:.2f} ms a token, after {new:.2f} "
          f"({old / new:.3f}x); all: {times}")


if __name__ == "__main__":
    main()

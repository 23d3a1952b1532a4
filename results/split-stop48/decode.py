"""A decode with the kernels' parts taken from a counter (stop 48) against the fixed shares before
it (the kernels built from commit 6cd7761, --old-so) and one thread alone, alone and beside a
process that spins on one CPU (a busy loop, unpinned). Each variant loads the model in its own
process and decodes `--tokens` tokens after a warm-up; rounds alternate the load and flip the
variants' order; ms a token (the median token of each decode), median of the rounds.

usage: .venv/bin/python results/split-stop48/decode.py MODEL MODE --old-so SO [--memory-budget B]
        [--tokens N] [--rounds R]
"""
import argparse, importlib.util, json, statistics, subprocess, sys, time


def child(a, so, threads):
    if so != "-":  # the older build in place of this one's (before mlx_flash.kernels loads it)
        spec = importlib.util.spec_from_file_location("mlx_flash.kernels._matvec", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["mlx_flash.kernels._matvec"] = mod
    import mlx_flash
    from mlx_flash import load
    from mlx_flash.generate import stream_generate
    from mlx_flash.kernels import kernels_module
    K, _ = kernels_module()
    K.set_threads(int(threads))
    kw = dict(mode=a.mode)
    if a.memory_budget:
        kw["memory_budget"] = a.memory_budget
    model, tok = load(a.model, **kw)

    def run():
        times, last = [], time.perf_counter()
        for _ in stream_generate(model, tok, "The history of the", max_tokens=a.tokens):
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return statistics.median(times[1:]) * 1e3
    run()
    print(json.dumps(run()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model"), ap.add_argument("mode")
    ap.add_argument("--old-so", required=True)
    ap.add_argument("--memory-budget")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        return child(a, *a.child)
    variants = {"fixed shares (6cd7761)": (a.old_so, 2), "parts (this build)": ("-", 2), "one thread": ("-", 1)}
    got = {}
    base = [sys.executable, __file__, a.model, a.mode, "--old-so", a.old_so, "--tokens", str(a.tokens)]
    if a.memory_budget:
        base += ["--memory-budget", a.memory_budget]
    for rnd in range(a.rounds):
        for load in (False, True):
            order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
            for v in order:
                so, threads = variants[v]
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load else None
                try:
                    res = subprocess.run(base + ["--child", so, str(threads)], capture_output=True, text=True,
                                         check=True)
                finally:
                    if hog:
                        hog.kill(), hog.wait()
                ms = json.loads(res.stdout.strip().splitlines()[-1])
                got.setdefault((load, v), []).append(ms)
                print(f"round {rnd} {'busy' if load else 'alone'} {v}: {ms:.1f} ms a token", flush=True)
    print(f"{a.model} --mode {a.mode} budget={a.memory_budget}, {a.tokens} tokens, {a.rounds} rounds")
    for load in (False, True):
        for v in variants:
            ms = got[(load, v)]
            print(f"  {'beside a busy process' if load else 'alone':22s} {v:24s} {statistics.median(ms):7.1f} ms a token"
                  f" (rounds {', '.join(f'{m:.0f}' for m in ms)})")


if __name__ == "__main__":
    main()

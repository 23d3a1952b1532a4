"""mlx_flash.benchmark: measure this machine the way the paper does.

  storage   uncached random-read throughput by chunk size and threads
            (the paper's Figure 2b), FlashReader against fio, and the
            token-like batch; table on stdout, CSV, JSON and a PNG plot.
  paper     the paper's Tables 2 and 3 and Figures 7 and 8 on a random
            checkpoint of a real shape (OPT-6.7B by default), with the
            physical floor of each row; markdown, CSV, JSON and PNGs.
  peers     mlx_flash against mlx_lm and llama.cpp in one run, each system
            in its own process under the same memory cgroup limit; table
            (markdown, CSV, JSON) under --out.
  batch     decode throughput of a batch of prompts against one at a time
            (FlexGen's block schedule) on a random checkpoint of a real shape,
            with the cost model's step beside the measured one.
  profile   this machine's rates for the cost model (disk by read size,
            compute by weight form for one position and for a batch's step,
            per-layer overhead by mode), cached in
            $MLX_FLASH_HOME/profile.json for --mode auto, --explain and --stats.
"""

import argparse
import os
import sys
from pathlib import Path

from . import run, use_device

DEFAULT_FILE = os.path.join("~", ".cache", "mlx_flash", "storage-bench.bin")


def _list(conv):
    return lambda text: [conv(x) for x in text.split(",") if x.strip()]


PAPER_DTYPES = ["float32", "float16", "bfloat16", "q4", "q8"]


def _choices(allowed):
    """A comma-separated list whose every item is one of `allowed` (argparse's error otherwise)."""
    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)} (comma-separated)")
        return items
    return parse


def build_parser():
    from ..bench.storage import DEFAULT_CHUNKS, DEFAULT_THREADS, parse_size

    p = argparse.ArgumentParser(prog="mlx_flash.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("storage", help="uncached random-read throughput (paper Fig. 2b)")
    s.add_argument("--file", default=os.environ.get("MLX_FLASH_BENCH_FILE", DEFAULT_FILE),
                   help="file to read; written once (random bytes) if absent "
                        f"(default $MLX_FLASH_BENCH_FILE or {DEFAULT_FILE})")
    s.add_argument("--size", type=parse_size, default=None,
                   help="size of the file to create (default 2GB; the token-like batch of the "
                        "acceptance test wants 13GB); an existing file must match")
    s.add_argument("--json", default=None, help="write every figure here (JSON)")
    s.add_argument("--out", default="out",
                   help="folder for storage.csv and storage.png (default out/)")
    s.add_argument("--chunks", type=_list(parse_size), default=DEFAULT_CHUNKS,
                   help="chunk sizes, e.g. 4K,16K,32K,1M (default 4 KiB .. 1 MiB)")
    s.add_argument("--threads", type=_list(int), default=DEFAULT_THREADS,
                   help="thread counts (default 1,2,4,8,16,32,64)")
    s.add_argument("--duration", type=float, default=1.0, help="seconds per grid cell")
    s.add_argument("--repeat", type=int, default=5, help="acceptance rounds (alternated)")
    s.add_argument("--acc-duration", type=float, default=2.0,
                   help="seconds per acceptance measurement")
    s.add_argument("--token-reads", type=int, default=12000,
                   help="bundles in the token-like batch (default 12000)")
    s.add_argument("--bundle", type=parse_size, default=16 * 1024, help="bundle size (16K)")
    s.add_argument("--backend", default="auto", choices=["auto", "native", "python"])
    s.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    s.add_argument("--no-grid", action="store_true", help="acceptance rounds only")
    s.add_argument("--no-overhead", action="store_true", help="skip the per-read overhead")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    add_paper_parser(sub)
    add_peers_parser(sub)
    add_moe_parser(sub)
    add_server_parser(sub)
    add_speculative_parser(sub)
    add_profile_parser(sub)
    add_batch_parser(sub)
    return p


def add_paper_parser(sub):
    from ..bench.paper import CONFIGS
    from ..io import READ_THREADS
    from ..convert.random_model import SHAPES

    s = sub.add_parser("paper", help="the paper's Tables 2, 3 and Figures 7, 8 at 7B scale",
                       description="Builds once a flash checkpoint of a real model shape with random "
                                   "weights ($MLX_FLASH_HOME/bench; 13 GB at float16, 27 GB at float32 "
                                   "for OPT-6.7B), then runs naive, hybrid, predictor, predictor + "
                                   "windowing and all (+ bundling) through the real runtime, with "
                                   "sparsity from a trace fitted to the paper (3%% active, 2.4%% new "
                                   "per token at k = 5).")
    s.add_argument("--shape", default="opt-6.7b", choices=sorted(SHAPES))
    s.add_argument("--dtype", default=["float32"], type=_choices(PAPER_DTYPES),
                   help="weights on flash (compute is float32 on the CPU): " + ", ".join(PAPER_DTYPES)
                        + "; q4 / q8: group-wise 4- / 8-bit, group 64, dequantized as they are read; "
                        "several (float16,q4): every row for each, alternating, in one run")
    s.add_argument("--resident-dtype", default=None, choices=["quantized", "float32"],
                   help="q4 / q8: hold attention and embeddings at their bits (default, as under a "
                        "user's budget) or dequantized at float32")
    s.add_argument("--device", default=None,
                   help="cpu | gpu | cpu,gpu: where MLX computes (several: one run each, written to OUT/<device>/, "
                        "their totals side by side); default MLX's default device")
    s.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check the reads' CRC32C (to measure what the checks cost)")
    s.add_argument("--memory-budget", default="50%",
                   help="weights in DRAM: a share of the float32 model or bytes (default 50%%)")
    s.add_argument("--tokens", type=int, default=8, help="measured decode tokens per sparse row "
                   "and round (a quarter for naive / hybrid)")
    s.add_argument("--rounds", type=int, default=2, help="alternating rounds over the rows (medians)")
    s.add_argument("--warmup", type=int, default=6, help="decode tokens before measuring (fill the window)")
    s.add_argument("--configs", type=_list(str), default=list(CONFIGS),
                   help="rows to run (default " + ",".join(CONFIGS) + ")")
    s.add_argument("--windows", type=_list(int), default=[0, 1, 2, 3, 4, 5, 6, 8],
                   help="window sizes of Figure 7 ('' to skip)")
    s.add_argument("--window-tokens", type=int, default=12, help="tokens per window size (Figure 7)")
    s.add_argument("--long-tokens", type=int, default=1000, help="tokens of Figure 8 (0 to skip)")
    s.add_argument("--predictor-rank", type=int, default=128)
    s.add_argument("--active", type=float, default=0.03, help="trace: active share per token")
    s.add_argument("--new", type=float, default=0.024, help="trace: new share per token at window k")
    s.add_argument("--k", type=int, default=5, help="trace: the window the new share is given for")
    s.add_argument("--threads", type=int, default=READ_THREADS, help="reader threads")
    s.add_argument("--json", default=None, help="write every row and figure here (JSON)")
    s.add_argument("--out", default="out", help="folder for the markdown, CSV and PNGs")
    s.add_argument("--quiet", action="store_true", help="no progress bar")


def paper_main(args, argv):
    """One run per --device (cpu,gpu: both, one after the other, each written to OUT/<device>/
    and their totals side by side)."""
    devices = [d.strip() for d in (args.device or "").split(",") if d.strip()] or [None]
    for d in devices:  # every device checked before the first run
        use_device(d)
    if len(devices) == 1:
        _paper_run(args, argv, args.out)
        return
    import mlx.core as mx

    totals = {}
    for d in devices:
        use_device(d)
        print(f"--- device {d} ({mx.default_device()})")
        res = _paper_run(args, argv, str(Path(args.out) / d), json_suffix=f"-{d}")
        totals[d] = {r["config"]: r["total_ms"] for r in res["rows"]}
    configs = list(dict.fromkeys(c for t in totals.values() for c in t))
    print("\n| row | " + " | ".join(f"{d} ms/token" for d in devices) + " |")
    print("| --- |" + " --- |" * len(devices))
    for c in configs:
        print(f"| {c} | " + " | ".join(f"{totals[d][c]:.0f}" if c in totals[d] else "—" for d in devices) + " |")


def _paper_run(args, argv, out, json_suffix=""):
    from ..bench import paper

    res = paper.run(shape=args.shape, dtype=args.dtype, memory_budget=args.memory_budget,
                    tokens=args.tokens, warmup=args.warmup, rounds=args.rounds, configs=args.configs,
                    windows=args.windows, window_tokens=args.window_tokens,
                    long_tokens=args.long_tokens, threads=args.threads,
                    predictor_rank=args.predictor_rank, active=args.active, new=args.new, k=args.k,
                    progress=not args.quiet, verify=args.verify, resident_dtype=args.resident_dtype)
    res["command"] = "mlx_flash.benchmark " + " ".join(argv if argv is not None else sys.argv[1:])
    res["device"] = str(mx_device())
    json_path = args.json
    if json_path and json_suffix:
        p = Path(json_path)
        json_path = str(p.with_name(p.stem + json_suffix + p.suffix))
    md, written = paper.write_outputs(res, out, json_path)
    print()
    print(md)
    print("wrote " + ", ".join(str(w) for w in written + ([json_path] if json_path else [])))
    return res


def mx_device():
    import mlx.core as mx

    return mx.default_device()


def add_profile_parser(sub):
    s = sub.add_parser("profile", help="this machine's rates for the cost model (cached for --explain, --stats)")
    s.add_argument("--file", default=None, help="a large file to read uncached for the disk curve (default: a "
                   "256 MiB probe file of random bytes beside the profile, written once)")
    s.add_argument("--quick", action="store_true", help="shorter runs (what a command does when none is cached)")
    s.add_argument("--out", default=None, help="where to write it (default $MLX_FLASH_HOME/profile.json)")


def add_batch_parser(sub):
    from ..convert.random_model import SHAPES

    s = sub.add_parser("batch", help="batch decode throughput against one at a time (FlexGen §4.2)")
    s.add_argument("--shape", default="opt-6.7b", choices=sorted(SHAPES))
    s.add_argument("--dtype", default="float16", choices=PAPER_DTYPES, help="the checkpoint's weights on flash")
    s.add_argument("--mode", default="hybrid", choices=["hybrid", "naive", "dense"])
    s.add_argument("--memory-budget", default="50%", help="weights in DRAM (the paper's protocol; default 50%%)")
    s.add_argument("--memory-limit", default=None, help="the whole process's memory instead of --memory-budget: "
                   "each batch size planned under it (its KV caches off the limit)")
    s.add_argument("--batch", type=_list(int), default=[1, 16], help="batch sizes (1, one by one, is always run)")
    s.add_argument("--resident-dtype", default=None, choices=["float32", "float16"],
                   help="what a float16 checkpoint's weights are held at in DRAM (mlx_flash.load's resident_dtype; "
                   "default: the loader's, float32 in an exact mode)")
    s.add_argument("--tokens", type=int, default=4, help="decode tokens per sequence")
    s.add_argument("--prompt-tokens", type=int, default=16)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--out", default="out/batch")


def add_moe_parser(sub):
    from ..bench.moe import ROWS
    from ..convert.random_model import MOE_TYPES, SHAPES

    s = sub.add_parser("moe", help="a mixture of experts of a real shape (random 4-bit weights) from flash: "
                       "naive, expert buffer with LRU / LFU / EdgeMoE eviction, + router look-ahead (EdgeMoE)")
    moe = sorted(k for k, v in SHAPES.items() if v["model_type"] in MOE_TYPES)
    s.add_argument("--shape", default="qwen3-30b-a3b", choices=moe)
    s.add_argument("--budgets", type=_list(str), default=["25%", "50%"],
                   help="expert buffers: shares of the model's weights as held (default 25%%,50%%)")
    s.add_argument("--rows", type=_list(str), default=list(ROWS), help=f"of {', '.join(ROWS)}")
    s.add_argument("--tokens", type=int, default=8, help="measured decode tokens per row and round")
    s.add_argument("--warmup", type=int, default=4, help="decode tokens before measuring (fill the buffer)")
    s.add_argument("--rounds", type=int, default=2, help="alternating rounds over the rows (medians)")
    s.add_argument("--routing", default="trace", choices=["trace", "model"],
                   help="trace: a generator with a trained model's skew and correlations (the default: a random "
                   "model's own routers route much alike token after token); model: the random model's routers")
    s.add_argument("--lookahead-width", type=int, default=None,
                   help="--routing trace: experts the path statistics guess for each next layer (default: top-k); "
                   "wider guesses read more ahead, hit more, and cost reads")
    s.add_argument("--out", default="out/moe")
    s.add_argument("--quiet", action="store_true", help="no progress")


def add_server_parser(sub):
    s = sub.add_parser("server", help="mlx_flash.server under concurrent openai clients: every request answered, "
                       "cancelled by its client or refused with a 4xx; RSS before and after")
    s.add_argument("--model", default=None, help="the model the server loads (default: the default model)")
    s.add_argument("--clients", type=int, default=8)
    s.add_argument("--requests", type=int, default=20, help="requests per client")
    s.add_argument("--seed", type=int, default=0, help="fixes the mix of requests")
    s.add_argument("--server-args", default="", help="more flags for the server, one string "
                   "(e.g. \"--memory-limit 1GB\")")
    s.add_argument("--out", default="out/server")


def add_speculative_parser(sub):
    s = sub.add_parser("speculative", help="decoding with a draft model (paper §5.2) against without: identical "
                       "tokens, acceptance, tokens/s, bytes read a token")
    s.add_argument("--model", default=None, help="the model (default: the default model)")
    s.add_argument("--draft-model", default="self:24", help="as generate's (default self:24: a layer-skipping "
                   "self-draft, the only draft of the same tokenizer this machine has for SmolLM2)")
    s.add_argument("--num-draft-tokens", type=_list(int), default=[2, 4], help="rows, comma-separated (default 2,4)")
    s.add_argument("--mode", default=None, help="the model's mode (default: as load chooses)")
    s.add_argument("--memory-limit", default=None)
    s.add_argument("--memory-budget", default=None)
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--out", default="out/speculative")


def speculative_main(args, argv):
    from ..bench import speculative
    from ..errors import FlashError
    from . import check_model_arg, default_model

    if args.tokens < 2 or args.rounds < 1 or any(n < 1 for n in args.num_draft_tokens):
        raise FlashError("--tokens must be at least 2, --rounds and --num-draft-tokens at least 1")
    load = {k: v for k, v in (("mode", args.mode), ("memory_limit", args.memory_limit),
                              ("memory_budget", args.memory_budget)) if v is not None}
    if load.get("memory_limit"):
        load["ctx_size"] = 512
    model = check_model_arg(args.model or default_model())
    res = speculative.run_speculative_bench(model, args.draft_model, args.num_draft_tokens, args.tokens, args.rounds,
                                            load, progress=lambda m: print(m, flush=True))
    res["command"] = "mlx_flash.benchmark speculative " + " ".join(argv if argv is not None else sys.argv[1:])
    path = speculative.write(res, args.out)
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.json')}")


def server_main(args):
    import shlex

    from ..bench.server_load import run_server_bench
    from ..errors import FlashError
    from . import check_model_arg, default_model

    if args.clients < 1 or args.requests < 1:
        raise FlashError("--clients and --requests must be positive")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise FlashError("the server benchmark speaks through the openai package: pip install openai "
                         "(or 'mlx-flash[bench]')") from None
    model = check_model_arg(args.model or default_model())
    res = run_server_bench(model, args.clients, args.requests, extra=shlex.split(args.server_args),
                           seed=args.seed, out=args.out, progress=lambda m: print(m, flush=True))
    path = Path(args.out) / "server-load.md"
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 1 if res["lost"] or not res["alive_after"] else 0


def moe_main(args):
    from ..bench import moe
    from ..errors import FlashError

    bad = [r for r in args.rows if r not in moe.ROWS]
    if bad:
        raise FlashError(f"--rows: unknown {', '.join(bad)} (choose from {', '.join(moe.ROWS)})")
    if args.tokens < 1 or args.rounds < 1 or args.warmup < 0:
        raise FlashError("--tokens and --rounds must be positive, --warmup not negative")
    if args.lookahead_width is not None and (args.routing != "trace" or args.lookahead_width < 1):
        raise FlashError("--lookahead-width: a positive number, with --routing trace (the model's routers' "
                         "look-ahead guesses its top-k)")
    res = moe.run_moe_bench(args.shape, tuple(args.budgets), args.tokens, args.rounds, args.warmup,
                            tuple(args.rows), args.out, progress=not args.quiet, routing=args.routing,
                            lookahead_width=args.lookahead_width)
    path = Path(args.out) / f"moe-{res['shape']}-q4-{res['routing']}.md"
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.json')}")


def batch_main(args, argv):
    from ..bench import batch
    from ..errors import FlashError
    from ..plan.profile import load_profile

    if args.tokens < 1 or args.rounds < 1 or args.prompt_tokens < 1 or any(b < 1 for b in args.batch):
        raise FlashError("--tokens, --rounds, --prompt-tokens and --batch must be positive")
    if args.memory_limit is not None and "--memory-budget" in (argv if argv is not None else sys.argv[1:]):
        raise FlashError("--memory-limit (the whole process) and --memory-budget (weights only): give one")
    if args.resident_dtype == "float16" and args.dtype != "float16":
        raise FlashError(f"--resident-dtype float16 holds a float16 checkpoint as stored: --dtype {args.dtype} "
                         "has none")
    profile = load_profile()
    res = batch.run_batch_bench(args.shape, args.dtype, args.mode, args.memory_budget, tuple(args.batch),
                                args.tokens, args.prompt_tokens, args.rounds, memory_limit=args.memory_limit,
                                profile=profile, resident_dtype=args.resident_dtype)
    res["command"] = "mlx_flash.benchmark batch " + " ".join(argv if argv is not None else sys.argv[1:])
    path = batch.write(res, args.out, profile)
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.json')}")


def profile_main(args):
    from ..plan.measure import measure
    from ..plan.profile import save_profile

    p = measure(quick=args.quick, file=args.file, progress=lambda msg: print(msg, flush=True))
    path = save_profile(p, args.out)
    print("disk GB/s (uncached, %d threads): %s" % (p.threads, ", ".join(
        f"{c // 1024} KiB {v:.2f}" for c, v in sorted(p.disk.items()))))
    for form, rates in p.compute.items():
        print(f"compute GB/s of {form} weights (one decode step), by matrix: " + ", ".join(
            f"{n / 1e6:.1f}M {v:.1f}" for n, v in sorted(rates.items())))
    for form, by_size in p.pass_compute.items():
        print(f"compute GB/s of {form} weights in a batch's decode step, by matrix and sequences: " + "; ".join(
            f"{n / 1e6:.1f}M " + ", ".join(f"{b}: {v:.1f}" for b, v in sorted(r.items()))
            for n, r in sorted(by_size.items())))
    for what, table in (("per layer", p.layer_ms), ("per token", p.token_ms)):
        print(f"cost {what} (ms besides the bytes), by width: " + "; ".join(
            f"{mode} " + ", ".join(f"d{w} {v:.2f}" for w, v in sorted(r.items())) for mode, r in table.items()))
    print(f"prefetch hides {p.overlap:.0%} of min(I/O, compute)")
    print(f"the reader spends {p.convert_ns:.2f} ns a value it dequantizes or converts into float32 rows")
    print(f"a batch of reads costs {p.batch_ms:.2f} ms beyond its bytes (a layer's reads wait that long at least)")
    print(f"reads landing during a layer's compute (prefetch) cost it {p.read_steal:.3f} s a GB, and run at "
          f"{100 * p.read_busy:.0f}% of their rate alone")
    print(f"placing a layer's reads into rows adds {p.place_s:.3f} s a GB to the reads thrown away")
    for note in p.notes:
        print(f"note: {note}")
    print(f"wrote {path}")


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.what == "profile":
        return run(lambda: profile_main(args), "mlx_flash.benchmark")
    if args.what == "peers":
        return run(lambda: peers_main(args, argv), "mlx_flash.benchmark")
    if args.what == "paper":
        return run(lambda: paper_main(args, argv), "mlx_flash.benchmark")
    if args.what == "batch":
        return run(lambda: batch_main(args, argv), "mlx_flash.benchmark")
    if args.what == "moe":
        return run(lambda: moe_main(args), "mlx_flash.benchmark")
    if args.what == "server":
        return run(lambda: server_main(args), "mlx_flash.benchmark")
    if args.what == "speculative":
        return run(lambda: speculative_main(args, argv), "mlx_flash.benchmark")

    def body():
        from ..bench import storage

        path = Path(os.path.expanduser(args.file))
        res = storage.run(
            path, size=args.size, chunks=args.chunks, threads=args.threads,
            duration=args.duration, repeat=args.repeat, acc_duration=args.acc_duration,
            token_reads=args.token_reads, bundle=args.bundle, use_fio=not args.no_fio,
            backend=args.backend, grid=not args.no_grid, overhead=not args.no_overhead,
            progress=not args.quiet,
        )
        res["command"] = "mlx_flash.benchmark storage " + " ".join(argv if argv is not None else sys.argv[1:])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        storage.write_csv(res, out / "storage.csv")
        written = [out / "storage.csv"]
        if res["flashreader"]:
            if storage.write_png(res, out / "storage.png"):
                written.append(out / "storage.png")
            else:
                print("(no PNG: matplotlib is not installed; pip install 'mlx-flash[bench]')")
        if args.json:
            storage.write_json(res, args.json)
            written.append(Path(args.json))
        print("wrote " + ", ".join(str(w) for w in written))

    return run(body, "mlx_flash.benchmark")


# --- peers ---------------------------------------------------------------------


def add_peers_parser(sub):
    from ..bench.peers import DEFAULT_MODEL, DEFAULT_SYSTEMS, SPEC_HELP

    s = sub.add_parser("peers", help="mlx_flash vs mlx_lm vs llama.cpp under one memory cgroup limit",
                       description="Every system in its own process, in a fresh memory cgroup "
                                   "(root), page cache dropped before each run; rounds alternate.")
    s.add_argument("--model", default=DEFAULT_MODEL, help=f"converted flash folder (default {DEFAULT_MODEL})")
    s.add_argument("--limit", default="50%",
                   help="memory limit: N%% = each runtime's baseline RSS + N%% of the model's float32 "
                        "weights (default 50%%), or a size for every system (400MB), or none; "
                        "several, comma-separated (50%%,75%%), run every system at each")
    s.add_argument("--limit-of", default="float32", choices=["float32", "stored"],
                   help="what --limit N%% is a share of: the model's float32 weights (default), or its "
                        "weights as stored (a 4-bit model's own bytes: the protocol for quantized models)")
    s.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated: {SPEC_HELP} "
                   f"(default {DEFAULT_SYSTEMS})")
    s.add_argument("--prompt-tokens", type=int, default=160, help="prompt length in tokens (default 160)")
    s.add_argument("--tokens", type=int, default=128, help="greedy decode tokens (default 128)")
    s.add_argument("--ctx-size", type=int, default=None,
                   help="the context every system holds a KV cache for: llama.cpp's n_ctx, mlx_flash's "
                        "--ctx-size (default: the prompt + the decode tokens + 16)")
    s.add_argument("--rounds", type=int, default=3, help="rounds, alternating the order (default 3)")
    s.add_argument("--reference", default=None,
                   help="system the speeds are compared to (default mlx_flash:dense@none if given, else the first)")
    s.add_argument("--flash-budget", default="limit",
                   help="how mlx_flash fits a limit: limit = its own --memory-limit set to the cgroup's limit "
                        "(it measures and plans what is not weights); or a memory_budget (weights only): auto = the limit minus "
                        "what one unconstrained run of the system needs besides its weights, minus 5%%; "
                        "full = limit - baseline; or N%% of the float32 model, or a size (default limit)")
    s.add_argument("--gguf", default=None, help="source GGUF for the llama.cpp systems "
                   "(default: the one the model was converted from)")
    s.add_argument("--llama-python", default=None,
                   help="interpreter that imports llama_cpp (default .venv-peers/bin/python; `make peers-setup`)")
    s.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    s.add_argument("--warm", action="store_true", help="do not drop the page cache before each run")
    s.add_argument("--json", default=None, help="write every run here (default <out>/peers.json)")
    s.add_argument("--out", default="out", help="folder for peers.md, peers.csv, peers.json")


def peers_main(args, argv):
    from ..bench import peers

    bench = peers.Peers(args.model, args.systems, limit=args.limit, prompt_tokens=args.prompt_tokens,
                        tokens=args.tokens, rounds=args.rounds, gguf=args.gguf,
                        llama_python=args.llama_python, timeout=args.timeout, cold=not args.warm,
                        reference=args.reference, flash_budget=args.flash_budget, limit_of=args.limit_of,
                        ctx_size=args.ctx_size, log=lambda msg: print(msg, flush=True))
    res = bench.run()
    res["info"]["command"] = "mlx_flash.benchmark " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = peers.markdown(res)
    (out / "peers.md").write_text(md)
    peers.write_csv(res, out / "peers.csv")
    js = Path(args.json) if args.json else out / "peers.json"
    peers.write_json(res, js)
    print()
    print(md)
    print(f"wrote {out / 'peers.md'}, {out / 'peers.csv'}, {js}")


if __name__ == "__main__":
    sys.exit(main())

"""mlx_flash.eval: perplexity and zero-shot accuracy of a model, through the real runtime.

  mlx_flash.eval --task wikitext --limit 4096              # perplexity, windows of --context tokens
  mlx_flash.eval --task arc_easy --limit 200               # acc / acc_norm (lm-evaluation-harness style)
  mlx_flash.eval --task hellaswag --mode flash --sparsity dip-ca --density 0.5 --memory-budget 50% --limit 20
  mlx_flash.eval --task notes.txt --json out/notes.json

Tasks: wikitext (WikiText-2 raw test), c4 (2000 C4 validation documents),
arc_easy / arc_challenge (Test split; --split dev), hellaswag (validation), or
a .txt / .jsonl ("text" field) file. --limit caps the tokens scored
(perplexity) or the items (multiple choice, from the start).

--mode dense scores a whole window (or an item's choices) in one forward;
every other mode decodes token by token through a KV cache, as a user does,
because the sparsity sources choose neurons from the state of their caches
(DIP-CA above all). --batch-prefill scores in one pass instead: faster, but
an approximation for cache-aware sources. --token-by-token forces the
incremental path in dense mode too.

  mlx_flash.eval --table out/quality                   # every sparsity source at matched densities
  mlx_flash.eval --table out/quality --resume          # continue: rows already in the JSON are kept

--table OUT runs the quality table (mlx_flash.eval.table): dense, then every
sparsity source at --densities, WikiText-2 perplexity and (at --mc-densities)
ARC-Easy / ARC-Challenge / HellaSwag, the token-by-token checks and the
predictor per layer; writes OUT.md, OUT.csv, OUT_predictor.csv and OUT.json.
It loads its own configurations: of the model options only --model applies.
"""

import argparse
import json
import math
import sys
import time

from ..errors import FlashError
from . import run, use_device
from .generate import add_model_args, load_for_cli


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", help="wikitext | c4 | arc_easy | arc_challenge | hellaswag | PATH (.txt, .jsonl)")
    what.add_argument("--table", metavar="OUT", default=None,
                      help="the quality table of every sparsity source: writes OUT.md, .csv, .json, _predictor.csv")
    p.add_argument("--split", default=None, choices=["test", "dev"], help="ARC split (default test)")
    p.add_argument("--limit", type=int, default=None,
                   help="tokens scored (perplexity) or items (multiple choice); default all")
    p.add_argument("--context", type=int, default=512, help="perplexity window in tokens (default 512)")
    way = p.add_mutually_exclusive_group()
    way.add_argument("--batch-prefill", action="store_true",
                     help="sparse modes: one forward per window / item instead of token by token "
                     "(an approximation for cache-aware sources)")
    way.add_argument("--token-by-token", action="store_true",
                     help="dense mode: score token by token through the KV cache (slow; for checks)")
    p.add_argument("--data-dir", default=None, help="data sets folder (default $MLX_FLASH_DATA, else shared/data in the checkout's parent folder)")
    p.add_argument("--json", default=None, help="write every figure (and per-item scores) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    t = p.add_argument_group("quality table (--table; also --model, --context, --data-dir, --no-progress)")
    t.add_argument("--densities", default=None, help="densities of the sparse rows (default 0.75,0.5,0.25)")
    t.add_argument("--mc-densities", default=None,
                   help="densities that also run the multiple-choice tasks (default 0.5; each costs ~5 min "
                   "per source on SmolLM2)")
    t.add_argument("--budget", default=None, help="dip-ca's memory budget, the checks' and the speed measurement's (default 50%%)")
    t.add_argument("--tokens", type=int, default=None,
                   help="WikiText-2 tokens, dense and batch-prefill rows (default 2048)")
    t.add_argument("--arc-easy", type=int, default=None, help="ARC-Easy test items, from the start (default 100)")
    t.add_argument("--arc-challenge", type=int, default=None,
                   help="ARC-Challenge test items, from the start (default 80)")
    t.add_argument("--hellaswag", type=int, default=None,
                   help="HellaSwag validation items, spread over the split (default 50)")
    t.add_argument("--dip-ca-tokens", type=int, default=None,
                   help="WikiText-2 tokens for dip-ca, token by token (default 512)")
    t.add_argument("--dip-ca-items", type=int, default=None,
                   help="multiple-choice items for dip-ca, token by token (default 0: slow)")
    t.add_argument("--check-tokens", type=int, default=None,
                   help="tokens of the token-by-token checks (predictor and dip at 50%%; default 256); 0: none")
    t.add_argument("--probe-tokens", type=int, default=None,
                   help="WikiText-2 tokens to re-measure the predictor per layer (default 2048); 0: none")
    t.add_argument("--sources", default=None,
                   help="comma-separated sparsity sources of the rows (default: every source of the registry)")
    t.add_argument("--speed-tokens", type=int, default=None,
                   help="also decode every row (and hybrid, the best exact mode) under --budget in flash mode for "
                   "this many tokens, and plot perplexity against tokens/s (OUT.png); default 0: no speed")
    t.add_argument("--speed-rounds", type=int, default=None, help="alternating rounds of the speed measurement (default 3)")
    t.add_argument("--resume", action="store_true", default=None, help="keep the rows already in OUT.json")
    return p


TABLE_OPTIONS = ("densities", "mc_densities", "budget", "tokens", "arc_easy", "arc_challenge", "hellaswag",
                 "dip_ca_tokens", "dip_ca_items", "check_tokens", "probe_tokens", "sources", "speed_tokens",
                 "speed_rounds", "resume")
SHARED_OPTIONS = ("task", "table", "model", "context", "data_dir", "no_progress", "device")


def _flag(parser, dest):
    return next((a.option_strings[0] for a in parser._actions if a.dest == dest), "--" + dest.replace("_", "-"))


def check_options(parser, args):
    """--table's options only with --table; a single evaluation's options (the model
    configuration, --limit, --json, ...) not with it: FlashError naming them."""
    if args.table is None:
        given = [_flag(parser, k) for k in TABLE_OPTIONS if getattr(args, k) is not None]
        if given:
            raise FlashError(f"{', '.join(given)}: only with --table")
        return
    defaults = vars(parser.parse_args(["--table", "-"]))
    stray = [_flag(parser, k) for k, v in vars(args).items()
             if k not in TABLE_OPTIONS + SHARED_OPTIONS and v != defaults[k]]
    if stray:
        raise FlashError(f"{', '.join(stray)}: not an option of --table (it loads its own configurations: "
                         "dense, then every sparsity source at --densities)")


def _floats(text, flag):
    try:
        return [float(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise FlashError(f"{flag}: cannot read {text!r} (a comma-separated list such as 0.75,0.5)")


def table_main(parser, args, argv):
    """--table OUT: mlx_flash.eval.table.quality_table() with the given options; prints the markdown."""
    from ..eval.table import markdown, quality_table
    from . import check_model_arg, default_model

    kw = {k: getattr(args, k) for k in TABLE_OPTIONS if getattr(args, k) is not None}
    for k in ("densities", "mc_densities"):
        if k in kw:
            kw[k] = _floats(kw[k], _flag(parser, k))
    if "sources" in kw:
        kw["sources"] = [x.strip() for x in kw["sources"].split(",") if x.strip()]
    argv = list(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    state = quality_table(check_model_arg(args.model or default_model()), args.table, context=args.context,
                          data_dir=args.data_dir, progress=not args.no_progress,
                          command="mlx_flash.eval" + "".join(  # --resume does not change what the table holds
                              f" {x}" for x in argv if x != "--resume"), **kw)
    print(markdown(state))
    print(f"wrote {args.table}.md/.csv/.json in {time.perf_counter() - t0:.0f} s")


def fmt_metric(value, stderr):
    if stderr is None or (isinstance(stderr, float) and math.isnan(stderr)):
        return f"{value:.4f}"
    return f"{value:.4f} ± {stderr:.4f}"


def summary_lines(res, args, stats):
    m = res["metrics"]
    way = "token by token" if res["incremental"] else "one pass"
    lines = [f"mlx_flash.eval: {res['data']}"]
    if res["kind"] == "perplexity":
        lines.append(f"  perplexity      {fmt_metric(m['perplexity'], m['perplexity_stderr'])}"
                     f"   (mean NLL {m['mean_nll']:.4f} ± {m['mean_nll_stderr']:.4f} nats/token)")
        if "bits_per_byte" in m:
            lines.append(f"  bits per byte   {m['bits_per_byte']:.4f}   word perplexity {m['word_perplexity']:.2f}")
        scope = f"first {res['n']} tokens (--limit)" if args.limit and res["n"] == args.limit \
            else f"{res['n']} tokens, the whole text"
        lines.append(f"  n               {scope}; {res['windows']} windows of {res['context']}, {way}")
    else:
        lines.append(f"  acc             {fmt_metric(m['acc'], m['acc_stderr'])}")
        lines.append(f"  acc_norm        {fmt_metric(m['acc_norm'], m['acc_norm_stderr'])}   (log-likelihood / characters)")
        lines.append(f"  n               {res['n']} items of {res['available']} ({way})")
    budget = stats.get("memory_budget_bytes")
    mode = stats.get("mode", args.mode)  # (what --mode auto chose)
    parts = [f"mode {mode}"]
    if mode == "flash":
        parts.append(f"sparsity {args.sparsity}, density {args.density:g}")
        if args.sparsity == "dip-ca":
            parts.append(f"gamma {args.gamma:g}, eviction {args.eviction}")
        elif args.sparsity != "dip":
            parts.append(f"window {args.window}")
    lines.append("  " + ", ".join(parts) + "; " + (
        f"budget {budget / 1e6:.0f} MB ({args.memory_budget})" if budget and args.memory_budget
        else f"budget {budget / 1e6:.0f} MB (all weights)" if budget else "no budget"))
    speed = f"  {res['seconds']:.1f} s, {res['tokens_forwarded']} tokens forwarded, {res['tokens_per_s']:.1f} tokens/s"
    if res["kind"] == "choice":
        speed += f", {res['items_per_s']:.2f} items/s"
    lines.append(speed)
    dram = f"  weights in DRAM {stats['weights_in_dram_bytes'] / 1e6:.1f} MB (FFN {stats['ffn_dram_bytes'] / 1e6:.1f} MB)"
    if "mean_io_ms" in stats:
        dram += (f"; per token: I/O {stats['mean_io_ms']:.1f} ms, read {stats['mean_bytes_read'] / 1e6:.2f} MB, "
                 f"hit rate {stats['mean_hit_rate']:.2f}")
        if stats.get("mean_ffn_share"):
            dram += f", FFN weights used {100 * stats['mean_ffn_share']:.1f} %"
    lines.append(dram)
    return lines


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    def body():
        from ..eval.harness import evaluate, load_task

        check_options(parser, args)
        use_device(args.device)  # before the data and the model: a missing GPU is the first thing said
        if args.table is not None:
            return table_main(parser, args, argv)
        if args.limit is not None and args.limit <= 0:
            raise FlashError(f"--limit must be positive, not {args.limit}")
        if args.context < 1:
            raise FlashError(f"--context must be at least 1, not {args.context}")
        loaded = load_task(args.task, args.split, args.data_dir)  # data errors before the model loads
        model, tokenizer = load_for_cli(args, ctx_size=args.context)
        if model.runtime.mode == "dense":
            incremental = args.token_by_token
        else:
            incremental = not args.batch_prefill
        if args.kv_bits is not None and not incremental:
            # a whole-window forward runs without a KV cache: nothing would be quantized
            print(f"[mlx_flash] --kv-bits {args.kv_bits}: evaluating token by token, through the quantized KV "
                  "cache (a whole window at once holds no cache)", file=sys.stderr)
            incremental = True
        if args.memory_limit is not None and not incremental:
            # a whole window at once holds its logits (--context x vocabulary floats) and every
            # layer's temporaries for it: more than a --memory-limit plan sets aside
            print("[mlx_flash] --memory-limit: evaluating token by token (a whole window's logits and "
                  "temporaries are not in the plan; --batch-prefill is for runs without a limit)", file=sys.stderr)
            incremental = True
        t0 = time.perf_counter()
        res = evaluate(model, tokenizer, args.task, args.split, args.limit, args.context, incremental,
                       args.data_dir, progress=not args.no_progress, loaded=loaded)
        wall = time.perf_counter() - t0
        stats = model.runtime.stats()["summary"]
        print("\n".join(summary_lines(res, args, stats)))
        if args.json:
            from pathlib import Path

            out = {k: v for k, v in res.items() if k != "nll"}
            config = {"mode": model.runtime.mode, "mode_asked": args.mode}  # (--mode auto: what it chose)
            config.update({k: getattr(args, k) for k in (
                "sparsity", "density", "memory_budget", "window", "gamma", "eviction", "kv_bits", "kv_group_size",
                "dtype", "context", "batch_prefill", "token_by_token", "split", "limit")})
            out.update(model=str(model.runtime.folder), config=config,
                       compute_dtype=model.runtime.compute_dtype, wall_seconds=wall, stats=stats)
            if res["kind"] == "perplexity":
                nll = res["nll"]
                out["window_mean_nll"] = [float(nll[s: s + res["context"]].mean())
                                          for s in range(0, len(nll), res["context"])]
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1, default=_jsonable))

    return run(body, "mlx_flash.eval")


def _jsonable(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


if __name__ == "__main__":
    sys.exit(main())

"""mlx_flash.calibrate: what the sparsity sources need, measured on calibration text.

SwiGLU models: the per-layer thresholds of both FFN sides (for --sparsity calibrated),
and with --recover the recovery adapters trained with that sparsity in the loop;
ReLU-family models (OPT): the low-rank activation predictors and Req_i for the planner
(--sparsity predictor). --what chooses (SwiGLU models can have predictors too)."""

import argparse
import sys
import time
from pathlib import Path

from . import add_device_arg, check_model_arg, default_model, run, use_device


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.calibrate", description=__doc__)
    p.add_argument("--model", default=None, help=f"converted folder (default {default_model()})")
    p.add_argument("--data", default="c4", help="c4 | wikitext (validation) | a .txt or .jsonl file")
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rank", type=int, default=128, help="predictor rank (default 128)")
    p.add_argument("--max-rank", type=int, default=512, help="rank a hard layer may grow to")
    p.add_argument("--recall", type=float, default=0.95, help="target recall of active neurons")
    p.add_argument("--density", type=float, default=None,
                   help="SwiGLU only: the top-k |GLU| fraction to predict (default 0.5)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--what", choices=("auto", "thresholds", "predictors", "both", "recovery", "expert-paths"),
                   default="auto",
                   help="auto (default): thresholds for SwiGLU FFNs, predictors for the others, expert paths for "
                   "mixtures of experts; recovery: only the recovery adapters, on the thresholds the model has")
    p.add_argument("--memory-budget", default=None,
                   help="expert paths: the expert buffer the model runs in while calibrating (default: every "
                   "expert in DRAM)")
    p.add_argument("--search-tokens", type=int, default=2048,
                   help="calibration tokens of the threshold search (default 2048)")
    p.add_argument("--score", choices=("magnitude", "wina"), default="magnitude",
                   help="thresholds: what they compare: |x| and |h~| (magnitude), or each weighed by the norm of "
                   "the weights it multiplies (wina: |x_i| ||(G;U)[:, i]||, |h~_j| ||D[j]||)")
    p.add_argument("--lowest", type=float, default=0.2,
                   help="the lowest average --density the threshold search reaches (default 0.2)")
    p.add_argument("--plot", default=None,
                   help="PNG of the searched densities per layer (default: <model>/calibrated-densities.png)")
    r = p.add_argument_group("recovery adapters (--recover, or --what recovery)")
    r.add_argument("--recover", action="store_true",
                   help="after the thresholds, train a low-rank adapter per layer by distillation with the sparse "
                   "FFN in the loop (resident at run time; ~4 s per step here)")
    r.add_argument("--recover-density", type=float, default=0.5, help="the --density trained at (default 0.5)")
    r.add_argument("--recover-rank", type=int, default=32, help="adapter rank (default 32)")
    r.add_argument("--recover-steps", type=int, default=200, help="training sequences of --seq-len (default 200)")
    r.add_argument("--recover-lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    add_device_arg(p)
    p.add_argument("--quiet", action="store_true")
    return p


def _moe(folder):
    from ..layout.format import read_manifest

    return bool(read_manifest(folder).experts)


def _expert_paths(model, args):
    import mlx_flash
    from ..sparsity.expert_calibration import calibrate_paths
    from ..sparsity.expert_paths import save_paths

    t0 = time.perf_counter()
    m, tok = mlx_flash.load(model, memory_budget=args.memory_budget)
    try:
        predictor, info = calibrate_paths(m, tok, data=args.data, tokens=args.tokens, seq_len=args.seq_len,
                                          log=lambda s: print(f"[calibrate] {s}", file=sys.stderr))
    finally:
        m.runtime.close()
    save_paths(model, predictor, info)
    print(f"expert paths of {info['tokens']} tokens of {info['data']} over {len(info['layers'])} MoE layers written "
          f"to {model}/manifest.json in {time.perf_counter() - t0:.1f} s; on {info['held_out_tokens']} held-out "
          f"tokens their guess of the next layer's experts was right {100 * info['precision']:.0f} % of the time "
          f"(the most used experts: {100 * info['popular_precision']:.0f} %, chance "
          f"{100 * info['chance']:.0f} %); run with --expert-predictor paths")


def _gated(folder):
    from ..layout.format import read_manifest

    return "gate" in read_manifest(folder).layout.kinds


def _thresholds(model, args):
    from ..sparsity.allocation import allocation, calibrate_thresholds, plot

    t0 = time.perf_counter()
    section = calibrate_thresholds(model, data=args.data, tokens=args.search_tokens, seq_len=args.seq_len,
                                   lowest=args.lowest, progress=not args.quiet, score=args.score,
                                   log=lambda m: print(f"[calibrate] {m}", file=sys.stderr))
    shown = [d for d in (0.3, 0.4, 0.5, 0.6, 0.7) if d >= args.lowest - 1e-9]
    allocs = [allocation(section, d) for d in shown]
    print("kept share of each side per layer (in: gate/up columns, out: down rows), by --density:")
    print(f"{'layer':>5} " + " ".join(f"{f'in@{d:g}':>7} {f'out@{d:g}':>7}" for d in shown))
    for i in range(allocs[0].density.shape[0]):
        print(f"{i:>5} " + " ".join(f"{a.density[i, 0]:>7.2f} {a.density[i, 1]:>7.2f}" for a in allocs))
    png = args.plot or str(Path(model) / "calibrated-densities.png")
    try:
        plot(section, shown, png)
        where = f"; plot: {png}"
    except ImportError:
        where = "; no plot: matplotlib is not installed (pip install 'mlx-flash[bench]')"
    print(f"thresholds of {len(section['path'])} search steps on {section['tokens']} tokens of "
          f"{section['data']} written to {model}/manifest.json in {time.perf_counter() - t0:.1f} s{where}; "
          f"run with --mode flash --sparsity calibrated --density D")


def _recovery(model, args):
    from ..sparsity.recovery import train_recovery

    s = train_recovery(model, density=args.recover_density, rank=args.recover_rank, steps=args.recover_steps,
                       seq_len=args.seq_len, lr=args.recover_lr, data=args.data, progress=not args.quiet,
                       log=lambda m: print(f"[calibrate] {m}", file=sys.stderr))
    print(f"recovery adapters (rank {s['rank']}, {s['size'] / 1e6:.2f} MB float16) trained at --density "
          f"{s['density']:g} on {s['tokens']} tokens of {s['data']} in {s['train_s']:.0f} s, written to "
          f"{model}/{s['file']}; --sparsity calibrated adds them (--no-recovery leaves them out)")


def _predictors(model, args):
    from ..sparsity.calibrate import calibrate

    t0 = time.perf_counter()
    cal = calibrate(model, data=args.data, tokens=args.tokens, seq_len=args.seq_len, rank=args.rank,
                    max_rank=args.max_rank, recall=args.recall, density=args.density,
                    epochs=args.epochs, progress=not args.quiet,
                    log=lambda m: print(f"[calibrate] {m}", file=sys.stderr))
    print(f"{'layer':>5} {'rank':>5} {'thr':>5} {'recall':>7} {'FN':>6} {'FP':>6} {'true dens':>9} "
          f"{'pred dens':>9} {'Req(1)':>7} {'Req(4)':>7}")
    req = cal["req"]["per_layer"]
    for i, m in enumerate(cal["metrics"]):
        print(f"{i:>5} {m['rank']:>5} {m['threshold']:>5.2f} {m['recall']:>7.3f} "
              f"{m['false_negative_rate']:>6.3f} {m['false_positive_rate']:>6.3f} "
              f"{m['true_density']:>9.3f} {m['predicted_density']:>9.3f} {req[i][0]:>7} {req[i][3]:>7}")
    print(f"{len(cal['metrics'])} predictors ({cal['predictors']['target']} target) written to "
          f"{model}/{cal['predictors']['file']} in {time.perf_counter() - t0:.1f} s; "
          f"held-out tokens: {cal['held_out_tokens']}")


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        from ..errors import FlashError

        if args.tokens < args.seq_len:
            raise FlashError(f"--tokens {args.tokens} is less than one sequence of --seq-len {args.seq_len}")
        if not 0 < args.recall < 1:
            raise FlashError("--recall must be in (0, 1)")
        model = check_model_arg(args.model or default_model())
        use_device(args.device)
        what = args.what
        if _moe(model) != (what == "expert-paths") and what != "auto":
            raise FlashError(f"--what {what}: " + ("a mixture of experts is calibrated for its expert paths (--what "
                                                   "expert-paths)" if _moe(model) else "the model has no experts"))
        if args.memory_budget is not None and not _moe(model):
            raise FlashError("--memory-budget applies to calibrating a mixture of experts' expert paths")
        if what == "auto" and _moe(model):
            what = "expert-paths"
        if what == "expert-paths":
            return _expert_paths(model, args)
        if what == "auto":
            what = "thresholds" if _gated(model) else "predictors"
            print(f"[calibrate] {what} ({'a SwiGLU' if what == 'thresholds' else 'a ReLU-family'} FFN; "
                  "--what chooses)", file=sys.stderr)
        if args.recover and what not in ("thresholds", "both"):
            raise FlashError("--recover trains on calibrated thresholds: with --what thresholds / both / auto on a "
                             "SwiGLU model (or --what recovery alone)")
        if what in ("thresholds", "both"):
            _thresholds(model, args)
        if what in ("predictors", "both"):
            _predictors(model, args)
        if args.recover or what == "recovery":
            _recovery(model, args)

    return run(body, "mlx_flash.calibrate")


if __name__ == "__main__":
    sys.exit(main())

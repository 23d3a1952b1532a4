"""mlx_flash.calibrate: train the low-rank activation predictors and measure Req_i for the planner."""

import argparse
import sys
import time

from . import check_model_arg, default_model, run


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
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        from ..sparsity.calibrate import calibrate
        from ..errors import FlashError

        if args.tokens < args.seq_len:
            raise FlashError(f"--tokens {args.tokens} is less than one sequence of --seq-len {args.seq_len}")
        if not 0 < args.recall < 1:
            raise FlashError("--recall must be in (0, 1)")
        model = check_model_arg(args.model or default_model())
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

    return run(body, "mlx_flash.calibrate")


if __name__ == "__main__":
    sys.exit(main())

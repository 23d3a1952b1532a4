"""mlx_flash.verify: check every byte of a converted model folder against its checksums."""

import argparse
import sys
import time

from . import run


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.verify", description=__doc__)
    p.add_argument("model", help="a converted mlx_flash folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        from ..layout.verify import verify_folder

        t0 = time.perf_counter()
        damage = verify_folder(args.model, progress=not args.quiet)
        for d in damage[:50]:
            print(f"damaged: {d}")
        if len(damage) > 50:
            print(f"... and {len(damage) - 50} more")
        if damage:
            print(f"{args.model}: {len(damage)} damaged parts; convert the model again", file=sys.stderr)
            return 1
        print(f"{args.model}: every file and bundle matches its checksum ({time.perf_counter() - t0:.1f} s)")

    return run(body, "mlx_flash.verify")


if __name__ == "__main__":
    sys.exit(main())

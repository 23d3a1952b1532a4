"""mlx_flash.benchmark: measure this machine the way the paper does.

  storage   uncached random-read throughput by chunk size and threads
            (the paper's Figure 2b), FlashReader against fio, and the
            token-like batch; table on stdout, CSV, JSON and a PNG plot.
"""

import argparse
import os
import sys
from pathlib import Path

from . import run

DEFAULT_FILE = os.path.join("~", ".cache", "mlx_flash", "storage-bench.bin")


def _list(conv):
    return lambda text: [conv(x) for x in text.split(",") if x.strip()]


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
    s.add_argument("--out", default="results",
                   help="folder for storage.csv and storage.png (default results/)")
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
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())

"""mlx_flash.convert: a Hub repo, HF/mlx-lm folder or GGUF file -> the flash layout."""

import argparse
import sys
import time

from . import run


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.convert", description=__doc__)
    p.add_argument("--model", "--hf-path", dest="model", required=True,
                   help="Hugging Face repo id, local HF or mlx-lm folder, or a .gguf file")
    p.add_argument("--out", "--mlx-path", dest="out", required=True, help="output folder")
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the weights on flash (default float16)")
    p.add_argument("--align", type=int, default=512,
                   help="bundle alignment in bytes, for uncached reads (default 512)")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--dip", action="store_true",
                   help="also write the input orientation for --sparsity dip / dip-ca (+5/3 FFN bytes)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        from ..convert import convert
        from ..layout.format import read_manifest

        if args.align <= 0 or args.align & (args.align - 1):
            from ..errors import FlashError

            raise FlashError(f"--align must be a power of two, got {args.align}")
        t0 = time.perf_counter()
        out = convert(args.model, args.out, dtype=args.dtype, align=args.align,
                      force=args.force, progress=not args.quiet, revision=args.revision, dip=args.dip)
        m = read_manifest(out)
        ffn = sum(f["size"] for f in m.ffn_files)
        print(
            f"{out}: {m.model_type}, {len(m.ffn_files)} layers x {m.layout.n_neurons} neurons, "
            f"bundle {m.layout.bundle_bytes} B (stride {m.layout.stride}), {m.dtype}; "
            f"ffn {ffn / 1e6:.1f} MB on flash, resident {m.resident['size'] / 1e6:.1f} MB "
            f"({time.perf_counter() - t0:.1f} s)"
        )

    return run(body, "mlx_flash.convert")


if __name__ == "__main__":
    sys.exit(main())

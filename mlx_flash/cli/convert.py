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
    q = p.add_argument_group("precision (quantized sources keep their bits unless told otherwise)")
    q.add_argument("-q", "--quantize", action="store_true",
                   help="quantize float weights too (as mlx_lm.convert -q: group-wise affine)")
    q.add_argument("--q-bits", type=int, default=None,
                   help="bits per weight: 2, 3, 4, 5, 6, 8 (default: the source's, or 4)")
    q.add_argument("--q-group-size", type=int, default=None,
                   help="values per scale: 32, 64, 128 (default: the source's, or 64)")
    q.add_argument("--q-keep", default="",
                   help="parts kept float at --dtype, comma-separated: embed, lm_head, attn; attn:A-B "
                        "only in layers A..B (e.g. attn:0-1,attn:30-31)")
    q.add_argument("--dequantize", action="store_true",
                   help="store every weight float at --dtype (4x the bytes of a 4-bit model)")
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
        from ..convert.quantize import QuantOptions

        quant = QuantOptions(args.quantize, args.q_bits, args.q_group_size, args.dequantize,
                             tuple(k.strip() for k in args.q_keep.split(",") if k.strip()))
        t0 = time.perf_counter()
        out = convert(args.model, args.out, dtype=args.dtype, align=args.align,
                      force=args.force, progress=not args.quiet, revision=args.revision, dip=args.dip,
                      quant=quant)
        m = read_manifest(out)
        ffn = sum(f["size"] for f in m.ffn_files)
        q = m.layout.quant
        precision = m.dtype if q is None else f"{q.bits}-bit group {q.group_size} ({q.scale_dtype} scales)"
        if m.experts:  # a mixture of experts
            lay, files = m.experts["layout"], [f for f in m.experts["files"] if f is not None]
            print(f"{out}: {m.model_type}, {len(files)} layers x {lay.n_experts} experts, expert {lay.bundle_bytes / 1e6:.2f} MB "
                  f"(stride {lay.stride} B), {precision}; experts {sum(f['size'] for f in files) / 1e6:.1f} MB on "
                  f"flash, resident {m.resident['size'] / 1e6:.1f} MB ({time.perf_counter() - t0:.1f} s)")
            return
        print(
            f"{out}: {m.model_type}, {len(m.ffn_files)} layers x {m.layout.n_neurons} neurons, "
            f"bundle {m.layout.bundle_bytes} B (stride {m.layout.stride}), {precision}; "
            f"ffn {ffn / 1e6:.1f} MB on flash, resident {m.resident['size'] / 1e6:.1f} MB "
            f"({time.perf_counter() - t0:.1f} s)"
        )

    return run(body, "mlx_flash.convert")


if __name__ == "__main__":
    sys.exit(main())

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
    q.add_argument("--ffn-bits", type=int, default=None, choices=[4, 8],
                   help="the feed-forward weights' one width where the source's differ (a Q4_K_M GGUF: Q4_K "
                        "beside Q6_K). Default: the widest the source stores exactly (Q4_K_M: 4; the Q6_K ones, "
                        "re-quantized anyway, re-quantized to it); 8 there: every value kept, twice the bytes")
    q.add_argument("--q-keep", default="",
                   help="parts kept float at --dtype, comma-separated: embed, lm_head, attn; attn:A-B "
                        "only in layers A..B (e.g. attn:0-1,attn:30-31)")
    q.add_argument("--dequantize", action="store_true",
                   help="store every weight float at --dtype (4x the bytes of a 4-bit model)")
    e = p.add_argument_group("mixtures of experts: each expert at its own bits (EdgeMoE §3.2)")
    e.add_argument("--expert-bits", default=None, metavar="auto|FILE.json",
                   help="auto: choose 2/4/8 bits per expert on calibration text within --max-ppl-loss (holds "
                        "the model in DRAM at float32 while it searches); FILE.json: {\"bits\": [[bits of each "
                        "expert] or null, per layer]} (what auto writes to the folder's expert_bits.json)")
    e.add_argument("--max-ppl-loss", type=float, default=0.05,
                   help="--expert-bits auto: the perplexity rise allowed over float experts (default 0.05)")
    e.add_argument("--expert-importance", default="output", choices=["output", "perplexity"],
                   help="--expert-bits auto: how an expert's importance is measured: output (the error its low "
                        "bits add to its layer's output, one pass) or perplexity (EdgeMoE's: one evaluation per "
                        "expert, hours for hundreds of experts)")
    e.add_argument("--calibration-data", default="c4", help="--expert-bits auto: c4 | wikitext (validation) | "
                                                            "a .txt or .jsonl file (default c4)")
    e.add_argument("--calibration-tokens", type=int, default=2048,
                   help="--expert-bits auto: tokens of calibration text (default 2048)")
    p.add_argument("--force", action="store_true",
                   help="replace a converted model (or an unfinished conversion) at --out; any other folder "
                        "is refused, untouched")
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
                             tuple(k.strip() for k in args.q_keep.split(",") if k.strip()), ffn_bits=args.ffn_bits)
        t0 = time.perf_counter()
        choice = None
        if args.expert_bits == "auto":
            from pathlib import Path

            from ..convert.expert_bits import auto_expert_bits

            choice, quant = auto_expert_bits(args.model, Path(args.out).expanduser().resolve(), quant,
                                             args.max_ppl_loss, args.calibration_data, args.calibration_tokens,
                                             args.expert_importance, progress=not args.quiet, revision=args.revision)
            print(choice.summary(), file=sys.stderr)
        elif args.expert_bits is not None:
            from dataclasses import replace

            from ..convert.expert_bits import read_expert_bits

            quant = replace(quant, expert_bits=read_expert_bits(args.expert_bits))
        out = convert(args.model, args.out, dtype=args.dtype, align=args.align,
                      force=args.force, progress=not args.quiet, revision=args.revision, dip=args.dip,
                      quant=quant)
        if choice is not None:
            import json

            (out / "expert_bits.json").write_text(json.dumps(choice.as_dict(), indent=1))
        m = read_manifest(out)
        ffn = sum(f["size"] for f in m.ffn_files)
        q = m.layout.quant
        precision = m.dtype if q is None else f"{q.bits}-bit group {q.group_size} ({q.scale_dtype} scales)"
        if m.experts:  # a mixture of experts
            import numpy as np

            from ..layout.experts import expert_bits, expert_files

            lay, layers = m.experts["layout"], sum(f is not None for f in m.experts["files"])
            size = sum(f["size"] for f in expert_files(m.experts))
            bits = expert_bits(m.experts)
            if bits is not None:  # --expert-bits: how many experts at each width
                counts = np.unique([b for layer in bits if layer for b in layer], return_counts=True)
                precision = ", ".join(f"{n} experts at {b}-bit" for b, n in zip(*counts)) + \
                    f" (group {lay.quant.group_size}; held at {lay.quant.bits}-bit in DRAM)"
            print(f"{out}: {m.model_type}, {layers} layers x {lay.n_experts} experts, expert {lay.bundle_bytes / 1e6:.2f} "
                  f"MB (stride {lay.stride} B), {precision}; experts {size / 1e6:.1f} MB on flash, resident "
                  f"{m.resident['size'] / 1e6:.1f} MB ({time.perf_counter() - t0:.1f} s)")
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

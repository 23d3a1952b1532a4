"""A random Llama-2-7B-shaped GGUF at Q4_1 or Q4_0, for `benchmark peers` at 7B where the
weights, not the runtime, fill the memory (issue 11's peer row).

    .venv/bin/python scripts/random_llama_gguf.py OUT.gguf [--type q4_1] [--layers 32]

The shape is Llama-2-7B's (d_model 4096, 32 layers, 32 heads, FFN 11008, SwiGLU, RMSNorm,
RoPE) with one change: the vocabulary and tokenizer are SmolLM2's (49152 tokens, copied
from the default GGUF's metadata) because llama.cpp needs a real tokenizer and none of
Llama 2's is on this machine; the embeddings are tied (no output.weight), as SmolLM2's.
Weights: normal, std 0.02 (norms 1), seeded; each tensor quantized by gguf-py (the
reference Q4_x code) and written as it is made: ~4 GB on disk, ~200 MB of memory.
Then `mlx_flash.convert OUT.gguf FOLDER` keeps the same 4-bit values bit-exact, and
`mlx_flash.benchmark peers --model FOLDER --gguf OUT.gguf --systems ...,llama.cpp-q4_1`
runs both on them.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = dict(d_model=4096, n_layers=32, n_heads=32, n_ff=11008, context=4096, eps=1e-5)


def copy_tokenizer(w, src):
    """The tokenizer metadata of GGUFReader `src`, as it is, into GGUFWriter `w`."""
    import gguf

    for f in src.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)


def write_tensors(w, tensors, make, progress=True):
    """[(name, shape, "f32" | a GGMLQuantizationType)] into GGUFWriter `w`: their sizes first (the
    header), then each one's data as make(name, shape) makes it (F32 values, or the type's raw bytes),
    one at a time. -> bytes written."""
    import gguf

    for name, shape, qtype in tensors:
        if qtype == "f32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            nbytes = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(name, nbytes, np.dtype(np.uint8), int(np.prod(nbytes)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for i, (name, shape, _) in enumerate(tensors):
        t = make(name, shape)
        w.write_tensor_data(t)
        total += t.nbytes
        if progress:
            print(f"\r{i + 1}/{len(tensors)} tensors, {total / 1e9:.2f} GB", end="", flush=True)
    w.close()
    return total


def main():
    import gguf
    from gguf import quants

    from mlx_flash.bench.peers.files import DEFAULT_GGUF

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--type", default="q4_1", choices=["q4_1", "q4_0"])
    ap.add_argument("--layers", type=int, default=SHAPE["n_layers"], help="fewer for a quick try")
    ap.add_argument("--tokenizer-from", default=DEFAULT_GGUF, help="GGUF whose tokenizer metadata is copied")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    qtype = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_0": gguf.GGMLQuantizationType.Q4_0}[a.type]
    ftype = {"q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[a.type]
    src = gguf.GGUFReader(a.tokenizer_from)
    if src.fields["general.architecture"].contents() != "llama":
        sys.exit(f"{a.tokenizer_from}: not a llama GGUF")
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    d, nl, nh, nff = SHAPE["d_model"], a.layers, SHAPE["n_heads"], SHAPE["n_ff"]

    out = Path(a.out)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch="llama")
    w.add_name(f"random-llama-2-7b-shape-{a.type}")
    w.add_context_length(SHAPE["context"])
    w.add_embedding_length(d)
    w.add_block_count(nl)
    w.add_feed_forward_length(nff)
    w.add_head_count(nh)
    w.add_head_count_kv(nh)
    w.add_rope_dimension_count(d // nh)
    w.add_layer_norm_rms_eps(SHAPE["eps"])
    w.add_rope_freq_base(10000.0)
    w.add_file_type(int(ftype))
    copy_tokenizer(w, src)

    tensors = [("token_embd.weight", (vocab, d)), ("output_norm.weight", (d,))]
    for i in range(nl):
        tensors += [(f"blk.{i}.attn_norm.weight", (d,)), (f"blk.{i}.ffn_norm.weight", (d,))]
        tensors += [(f"blk.{i}.attn_{k}.weight", (d, d)) for k in ("q", "k", "v", "output")]
        tensors += [(f"blk.{i}.ffn_gate.weight", (nff, d)), (f"blk.{i}.ffn_up.weight", (nff, d)),
                    (f"blk.{i}.ffn_down.weight", (d, nff))]
    rng = np.random.default_rng(a.seed)

    def make(name, shape):
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        return quants.quantize((rng.standard_normal(shape, dtype=np.float32) * 0.02), qtype)

    total = write_tensors(w, [(n, s, "f32" if len(s) == 1 else qtype) for n, s in tensors], make)
    tmp.rename(out)
    print(f"\n{out}: {total / 1e9:.2f} GB, Llama-2-7B shape ({nl} layers), {a.type}, vocabulary {vocab}")


if __name__ == "__main__":
    main()

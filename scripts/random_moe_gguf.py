"""A random Qwen3-30B-A3B-shaped GGUF (qwen3moe) at Q4_1, for `benchmark peers` on a mixture of
experts (issue 12's peer row): llama.cpp reads it, and `mlx_flash.convert` keeps its values.

    .venv/bin/python scripts/random_moe_gguf.py OUT.gguf [--layers 48] [--experts 128]

The shape is Qwen3-30B-A3B's (d_model 2048, 48 layers, 32 query / 4 KV heads of 128, 128
experts of 768, top 8, RMSNorm, RoPE 1e6) with SmolLM2's vocabulary and tokenizer (49152
tokens, copied from the default GGUF's metadata: llama.cpp needs a real tokenizer, and no
Qwen3 one is on this machine). Every matrix is random Q4_1 blocks (4-bit values drawn
uniformly, one scale and minimum spreading them over about +-2.5 x 0.02), written as they
are made: ~17 GB on disk, ~300 MB of memory; the routers (ffn_gate_inp) and norms are F32.
Q4_1 is MLX's affine form at group 32, so `mlx_flash.convert OUT.gguf FOLDER` holds the
same values bit for bit, and both peers compute on the same weights.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = dict(d_model=2048, n_layers=48, n_heads=32, n_kv=4, head_dim=128, n_ff=6144, expert_ff=768,
             experts=128, top_k=8, context=4096, eps=1e-6, theta=1e6)
STD = 0.02


def q4_1_blocks(shape, rng):
    """Random Q4_1 bytes of a tensor of `shape` (the last axis in blocks of 32 values)."""
    n_blocks = int(np.prod(shape)) // 32
    out = np.empty((n_blocks, 20), dtype=np.uint8)
    out[:, :2] = np.frombuffer(np.float16(5 * STD / 15).tobytes(), dtype=np.uint8)
    out[:, 2:4] = np.frombuffer(np.float16(-2.5 * STD).tobytes(), dtype=np.uint8)
    out[:, 4:] = np.frombuffer(rng.bytes(n_blocks * 16), dtype=np.uint8).reshape(n_blocks, 16)
    return out.reshape(*shape[:-1], shape[-1] // 32 * 20)


def q4_k_blocks(shape, rng):
    """Random Q4_K bytes of a tensor of `shape` (super-blocks of 256 values: d, dmin, 12 bytes of 6-bit
    scales and mins, 128 bytes of 4-bit values): a K-quant, which has no exact MLX form."""
    n_blocks = int(np.prod(shape)) // 256
    out = np.empty((n_blocks, 144), dtype=np.uint8)
    out[:, :2] = np.frombuffer(np.float16(5 * STD / 15 / 32).tobytes(), dtype=np.uint8)
    out[:, 2:4] = np.frombuffer(np.float16(2.5 * STD / 32).tobytes(), dtype=np.uint8)
    out[:, 4:] = np.frombuffer(rng.bytes(n_blocks * 140), dtype=np.uint8).reshape(n_blocks, 140)
    return out.reshape(*shape[:-1], shape[-1] // 256 * 144)


def main():
    from mlx_flash.bench.peers.files import DEFAULT_GGUF

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=SHAPE["n_layers"], help="fewer for a quick try")
    ap.add_argument("--experts", type=int, default=SHAPE["experts"])
    ap.add_argument("--tokenizer-from", default=DEFAULT_GGUF, help="GGUF whose tokenizer metadata is copied")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write_random_moe_gguf(a.out, dict(SHAPE, n_layers=a.layers, experts=a.experts), a.tokenizer_from, a.seed)


def write_random_moe_gguf(out, shape, tokenizer_from, seed=0, progress=True, expert_type="q4_1"):
    """A random qwen3moe GGUF of `shape` (SHAPE's keys) with the tokenizer of `tokenizer_from`; its
    merged experts at Q4_1, or Q4_K (expert_type "q4_k": sizes multiples of 256)."""
    import gguf

    from random_llama_gguf import copy_tokenizer, write_tensors

    qtype = gguf.GGMLQuantizationType.Q4_1
    src = gguf.GGUFReader(tokenizer_from)
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    d, nl, e, f = shape["d_model"], shape["n_layers"], shape["experts"], shape["expert_ff"]
    q, kv = shape["n_heads"] * shape["head_dim"], shape["n_kv"] * shape["head_dim"]
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch="qwen3moe")
    w.add_name("random-qwen3-30b-a3b-shape-q4_1")
    w.add_context_length(shape["context"])
    w.add_embedding_length(d)
    w.add_block_count(nl)
    w.add_feed_forward_length(shape["n_ff"])
    w.add_expert_feed_forward_length(f)
    w.add_expert_count(e)
    w.add_expert_used_count(shape["top_k"])
    w.add_head_count(shape["n_heads"])
    w.add_head_count_kv(shape["n_kv"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_layer_norm_rms_eps(shape["eps"])
    w.add_rope_freq_base(shape["theta"])
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    copy_tokenizer(w, src)

    tensors = [("token_embd.weight", (vocab, d)), ("output_norm.weight", (d,)), ("output.weight", (vocab, d))]
    for i in range(nl):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d,)), (b + "ffn_norm.weight", (d,)),
                    (b + "attn_q_norm.weight", (shape["head_dim"],)), (b + "attn_k_norm.weight", (shape["head_dim"],)),
                    (b + "attn_q.weight", (q, d)), (b + "attn_k.weight", (kv, d)), (b + "attn_v.weight", (kv, d)),
                    (b + "attn_output.weight", (d, q)), (b + "ffn_gate_inp.weight", (e, d)),
                    (b + "ffn_gate_exps.weight", (e, f, d)), (b + "ffn_up_exps.weight", (e, f, d)),
                    (b + "ffn_down_exps.weight", (e, d, f))]
    rng = np.random.default_rng(seed)

    def f32(name, shape):  # norms, and the routers (ffn_gate_inp: F32, as llama.cpp's converter writes them)
        return len(shape) == 1 or name.endswith("ffn_gate_inp.weight")

    def make(name, shape):
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        if f32(name, shape):
            return rng.standard_normal(shape, dtype=np.float32) * STD
        return q4_k_blocks(shape, rng) if k_quant(name) else q4_1_blocks(shape, rng)

    def k_quant(name):
        return expert_type == "q4_k" and name.endswith("_exps.weight")

    total = write_tensors(w, [(n, s, "f32" if f32(n, s) else gguf.GGMLQuantizationType.Q4_K if k_quant(n) else qtype)
                              for n, s in tensors], make, progress)
    tmp.rename(out)
    if progress:
        print(f"\n{out}: {total / 1e9:.2f} GB, Qwen3-30B-A3B shape ({nl} layers, {e} experts), q4_1, vocabulary {vocab}")
    return out


if __name__ == "__main__":
    main()

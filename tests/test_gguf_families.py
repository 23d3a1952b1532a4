"""Granite and Phi-3 GGUFs, written from the same random weights as a Hugging Face folder the way
llama.cpp's convert_hf_to_gguf.py writes them (Granite: a llama's q/k rows permuted, its
multipliers as *_scale keys; Phi-3: q/k/v in attn_qkv, gate and up in ffn_up, the rotated
dimensions and LongRoPE's factors as tensors), convert to the folder's logits."""

import gguf
import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from helpers import make_llama_folder
from test_gemma import spm_vocab
from test_gguf import permute
from test_parity import TOKENS

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf_of(path, arch, cfg, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * cfg["partial_rotary_factor"]))
        scaling = cfg.get("rope_scaling")
        if scaling:
            w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
            w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    tokens, types, scores = spm_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    for hf, x in tensors.items():
        if hf == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf == "model.norm.weight":
            name = "output_norm.weight"
        elif hf == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, layer, rest = hf.split(".", 3)
            base = rest.rsplit(".", 1)[0]
            name = f"blk.{layer}.{NAMES[base]}.weight"
            if arch == "granite" and base in ("self_attn.q_proj", "self_attn.k_proj"):
                x = permute(x, heads if base == "self_attn.q_proj" else kv_heads)
        w.add_tensor(name, x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(4)],
            "long_factor": [2.0 + i / 4 for i in range(4)]}


@pytest.mark.parametrize("variant,overrides", [
    ("granite", {}),
    ("phi3", {}),
    ("phi3", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 4, "max_position_embeddings": 64}),
])
def test_gguf_converts_to_the_folders_logits(tmp_path, variant, overrides):
    src, cfg, tensors = make_llama_folder(tmp_path / "hf", variant, vocab_size=272, **overrides)
    # (make_llama_folder's Phi-3 tensors are fused already, as its checkpoints are)
    write_gguf_of(tmp_path / "m.gguf", variant, cfg, tensors)
    ours, _ = mlx_flash.load(convert(tmp_path / "m.gguf", tmp_path / "from-gguf", dtype="float32", progress=False))
    ref, _ = mlx_flash.load(convert(src, tmp_path / "from-hf", dtype="float32", progress=False))
    x = mx.array([TOKENS])
    assert mx.abs(ours(x) - ref(x)).max().item() < 1e-4

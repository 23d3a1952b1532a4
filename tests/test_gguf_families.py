"""Granite, Phi-3 and Phi-2 GGUFs, written from the same random weights as a Hugging Face folder the way
llama.cpp's convert_hf_to_gguf.py writes them (Granite: a llama's q/k rows permuted, its
multipliers as *_scale keys; Phi-3: q/k/v in attn_qkv, gate and up in ffn_up, the rotated
dimensions and LongRoPE's factors as tensors), convert to the folder's logits."""

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from helpers import gguf_finish, gguf_name, gguf_writer, make_llama_folder, make_phi_folder
from test_gguf import permute
from test_parity import TOKENS

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf_of(path, arch, cfg, tensors):
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    w = gguf_writer(path, arch, cfg, head_dim)
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
    for hf, x in tensors.items():
        if arch == "granite" and (".q_proj." in hf or ".k_proj." in hf):
            x = permute(x, heads if ".q_proj." in hf else kv_heads)
        w.add_tensor(gguf_name(hf, NAMES), x.astype(np.float32))
    gguf_finish(w)


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


PHI2_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.dense": "attn_output", "mlp.fc1": "ffn_up",
              "mlp.fc2": "ffn_down"}


def test_phi2_gguf_converts_to_the_folders_logits(tmp_path):
    """llama.cpp's phi2: LayerNorms and every projection with biases, the rotated dimensions as
    rope.dimension_count, the final norm as output_norm."""
    src, cfg, tensors = make_phi_folder(tmp_path / "hf", vocab_size=272)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf_writer(tmp_path / "m.gguf", "phi2", cfg, head_dim)
    w.add_rope_dimension_count(int(head_dim * cfg["partial_rotary_factor"]))
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    for hf, x in tensors.items():
        w.add_tensor(gguf_name(hf, PHI2_NAMES, {"model.final_layernorm": "output_norm"}), x.astype(np.float32))
    gguf_finish(w)
    ours, _ = mlx_flash.load(convert(tmp_path / "m.gguf", tmp_path / "from-gguf", dtype="float32", progress=False))
    ref, _ = mlx_flash.load(convert(src, tmp_path / "from-hf", dtype="float32", progress=False))
    x = mx.array([TOKENS])
    assert mx.abs(ours(x) - ref(x)).max().item() < 1e-4

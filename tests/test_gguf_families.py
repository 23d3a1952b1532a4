"""Granite, Phi-3, Phi-2, Persimmon and Falcon GGUFs, written from the same random weights as a Hugging Face folder the way
llama.cpp's convert_hf_to_gguf.py writes them (Granite: a llama's q/k rows permuted, its
multipliers as *_scale keys; Phi-3: q/k/v in attn_qkv, gate and up in ffn_up, the rotated
dimensions and LongRoPE's factors as tensors; Falcon: q/k/v regrouped as all q, all k, all v), convert
to the folder's logits."""

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from helpers import (gguf_finish, gguf_name, gguf_writer, make_falcon_folder, make_llama_folder, make_moe_folder,
                     make_persimmon_folder,
                     make_phi_folder)
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
        if cfg.get("sliding_window"):
            w.add_sliding_window(cfg["sliding_window"])
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
    ("phi3", {"sliding_window": 3}),  # (every layer's window, as from the folder)
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


PERSIMMON_NAMES = {"input_layernorm": "attn_norm", "self_attn.query_key_value": "attn_qkv",
                   "self_attn.dense": "attn_output", "self_attn.q_layernorm": "attn_q_norm",
                   "self_attn.k_layernorm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                   "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}


def _neox_gguf(path, arch, cfg, tensors, n_kv):
    """A Persimmon / Falcon GGUF as convert_hf_to_gguf.py writes one: gguf-py's own tensor names
    for the architecture; Falcon's query_key_value regrouped (its modify_tensors)."""
    import gguf

    n, d = cfg["num_attention_heads"], cfg["hidden_size"]
    hd = d // n
    common = {"num_key_value_heads": n_kv, "intermediate_size": cfg.get("intermediate_size", 4 * d),
              "rope_theta": cfg.get("rope_theta", 10000.0), **cfg}
    w = gguf_writer(path, arch, common, hd)
    w.add_layer_norm_eps(cfg.get("layer_norm_eps", cfg.get("layer_norm_epsilon")))
    if arch == "persimmon":
        w.add_rope_dimension_count(hd // 2)
    else:
        w.add_tensor_data_layout("jploski")
    if arch == "falcon":
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON, cfg["num_hidden_layers"])
        name = lambda hf: names.get_name(hf, try_suffixes=(".weight", ".bias"))  # noqa: E731
    else:  # (gguf-py no longer lists persimmon; these are the names its tensor map gave)
        name = lambda hf: gguf_name(hf, PERSIMMON_NAMES, {"model.final_layernorm": "output_norm"})  # noqa: E731
    for hf, x in tensors.items():
        if arch == "falcon" and "query_key_value" in hf:
            g = x.reshape(n_kv, n // n_kv + 2, hd, -1)
            x = np.concatenate([g[:, :-2].reshape(n * hd, -1), g[:, -2].reshape(n_kv * hd, -1),
                                g[:, -1].reshape(n_kv * hd, -1)]).reshape(x.shape)
        w.add_tensor(name(hf), x.astype(np.float32))
    gguf_finish(w)


@pytest.mark.parametrize("family, n_kv", [("persimmon", 4), ("falcon-7b", 1), ("falcon-40b", 2), ("falcon-11b", 2)])
def test_persimmon_and_falcon_ggufs_convert_to_the_folders_logits(tmp_path, family, n_kv):
    if family == "persimmon":
        src, cfg, tensors = make_persimmon_folder(tmp_path / "hf", vocab_size=272)
    else:
        src, cfg, tensors = make_falcon_folder(tmp_path / "hf", family.split("-")[1], vocab_size=272)
    _neox_gguf(tmp_path / "m.gguf", family.split("-")[0], cfg, tensors, n_kv)
    ours, _ = mlx_flash.load(convert(tmp_path / "m.gguf", tmp_path / "from-gguf", dtype="float32", progress=False))
    ref, _ = mlx_flash.load(convert(src, tmp_path / "from-hf", dtype="float32", progress=False))
    x = mx.array([TOKENS])
    assert mx.abs(ours(x) - ref(x)).max().item() < 1e-4


def test_falcons_pre_tokenizer_splits_punctuation_runs_and_digits_in_threes():
    """Falcon's tokenizer.json: punctuation runs apart, then GPT-2's byte-level split, then digits
    in runs of three (llama.cpp's "falcon" pre-tokenizer)."""
    from mlx_flash.convert.gguf_tokenizer import bytes_to_unicode, byte_level_bpe

    chars = list(bytes_to_unicode().values())
    tk = byte_level_bpe(chars, [1] * len(chars), [], "falcon", None)
    pieces = [p for p, _ in tk.pre_tokenizer.pre_tokenize_str("a+=b 1234567")]
    assert pieces == ["a", "+=", "b", "Ġ", "123", "456", "7"], pieces


@pytest.mark.parametrize("variant", ["mixtral", "olmoe"])
def test_mixtral_and_olmoe_ggufs_convert_to_the_folders_logits(tmp_path, variant):
    """llama.cpp's mixtures: Mixtral as a llama GGUF with experts (q/k permuted), OLMoE as olmoe (q/k
    norms over the whole projection); each layer's experts merged in ffn_*_exps, the router
    ffn_gate_inp."""
    src, cfg, tensors = make_moe_folder(tmp_path / "hf", variant, vocab_size=272)
    arch = {"mixtral": "llama", "olmoe": "olmoe"}[variant]
    heads, kv_heads, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts_per_tok"]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w = gguf_writer(tmp_path / "m.gguf", arch, cfg, cfg["hidden_size"] // heads)
    w.add_expert_count(experts)
    w.add_expert_used_count(n)
    block = "block_sparse_moe" if variant == "mixtral" else "mlp"
    own = {"mixtral": ("w1", "w3", "w2"), "olmoe": ("gate_proj", "up_proj", "down_proj")}[variant]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.{block}."
        for hf, kind in zip(own, ("gate", "up", "down")):
            stacked = np.stack([tensors.pop(f"{p}experts.{e}.{hf}.weight") for e in range(experts)])
            w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", stacked.astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", tensors.pop(f"{p}gate.weight").astype(np.float32))
    for hf, x in tensors.items():
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            x = permute(x, heads if ".q_proj." in hf else kv_heads)
        w.add_tensor(gguf_name(hf, {**NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}),
                     x.astype(np.float32))
    gguf_finish(w)
    ours, _ = mlx_flash.load(convert(tmp_path / "m.gguf", tmp_path / "from-gguf", dtype="float32", progress=False))
    ref, _ = mlx_flash.load(convert(src, tmp_path / "from-hf", dtype="float32", progress=False))
    assert ours.args.model_type == variant
    x = mx.array([TOKENS])
    assert mx.abs(ours(x) - ref(x)).max().item() < 1e-4

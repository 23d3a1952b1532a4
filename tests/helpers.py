"""Builders for tiny real model folders on disk (random weights, real formats)."""

import json
from pathlib import Path

import numpy as np

from mlx_flash.layout.safetensors_io import SafetensorsWriter

VOCAB = 256 + 8


def write_tokenizer(folder):
    """A real byte-level BPE tokenizer (tokenizers), with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog " * 5, "hello world, paris is the capital"]
    tok.train_from_iterator(text, trainer)
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            }
        )
    )
    return tok.get_vocab_size()


LLAMA_BASE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
)

VARIANTS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama-tied": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True),
    "llama-relu": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="relu"),
    # biases in every projection (attention_bias: q, k, v, o; mlp_bias: gate, up, down)
    "llama-bias": dict(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=True, mlp_bias=True),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"]),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
    # Phi-3: q/k/v and gate/up fused in the checkpoint (make_llama_folder fuses them), half the
    # head rotated (Phi-4-mini's partial_rotary_factor is 0.75)
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.5, pad_token_id=0),
    # Granite: the embeddings, each block's branches, the attention scores and the logits scaled
    "granite": dict(model_type="granite", architectures=["GraniteForCausalLM"], embedding_multiplier=6.0,
                    attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=4.0,
                    attention_bias=False, mlp_bias=False),
}


def llama_tensors(cfg, rng):
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    v = cfg["vocab_size"]
    s = 0.08

    def w(*shape):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": 1 + w(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attention_tensors(t, p, cfg, w)
        t[p + "mlp.gate_proj.weight"] = w(f, d)
        t[p + "mlp.up_proj.weight"] = w(f, d)
        t[p + "mlp.down_proj.weight"] = w(d, f)
        if cfg.get("mlp_bias"):
            t[p + "mlp.gate_proj.bias"], t[p + "mlp.up_proj.bias"], t[p + "mlp.down_proj.bias"] = w(f), w(f), w(d)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    return t


def attention_tensors(t, p, cfg, w):
    """A llama-family block's norms and attention (layer prefix p) into t; w(*shape) draws weights.
    Qwen2 and Qwen2-MoE: q/k/v biases; Qwen3 and Qwen3-MoE: per-head q/k norms; OLMoE: q/k
    norms over the whole projection."""
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // h
    kind = cfg["model_type"]
    t[p + "input_layernorm.weight"] = 1 + w(d)
    t[p + "post_attention_layernorm.weight"] = 1 + w(d)
    t[p + "self_attn.q_proj.weight"] = w(h * hd, d)
    t[p + "self_attn.k_proj.weight"] = w(kv * hd, d)
    t[p + "self_attn.v_proj.weight"] = w(kv * hd, d)
    t[p + "self_attn.o_proj.weight"] = w(d, h * hd)
    if kind in ("qwen2", "qwen2_moe") or cfg.get("attention_bias"):
        t[p + "self_attn.q_proj.bias"] = w(h * hd)
        t[p + "self_attn.k_proj.bias"] = w(kv * hd)
        t[p + "self_attn.v_proj.bias"] = w(kv * hd)
    if cfg.get("attention_bias"):
        t[p + "self_attn.o_proj.bias"] = w(d)
    if kind in ("qwen3", "qwen3_moe"):
        t[p + "self_attn.q_norm.weight"] = 1 + w(hd)
        t[p + "self_attn.k_norm.weight"] = 1 + w(hd)
    if kind == "olmoe":
        t[p + "self_attn.q_norm.weight"] = 1 + w(h * hd)
        t[p + "self_attn.k_norm.weight"] = 1 + w(kv * hd)


def write_safetensors(path, tensors, dtype="float32"):
    wr = SafetensorsWriter(path, [(k, v.shape, dtype) for k, v in tensors.items()])
    for k, v in tensors.items():
        wr.write(k, v)
    wr.close()


def hf_folder(folder, config, tensors_of, seed=0, dtype="float32"):
    """A Hugging Face-style folder: a tokenizer (write_tokenizer), config.json (`config`, with the
    tokenizer's vocabulary size unless it gives one), model.safetensors of tensors_of(config, rng)
    -> (folder, config, tensors)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"vocab_size": write_tokenizer(folder), **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = tensors_of(cfg, np.random.default_rng(seed))
    write_safetensors(folder / "model.safetensors", tensors, dtype)
    return folder, cfg, tensors


def mlx_lm_4bit(src, q):
    """mlx_lm's 4-bit (group 32, float16) folder `q` of the folder `src` -> (q, mlx_lm's model of it
    computing in float32: the reference for our conversion of q)."""
    import mlx.core as mx
    from mlx_lm import convert as mlx_lm_convert
    from mlx_lm.utils import load_model

    mlx_lm_convert(str(src), str(q), quantize=True, q_bits=4, q_group_size=32, dtype="float16")
    ref, _ = load_model(q)
    ref.set_dtype(mx.float32)
    return q, ref


def mlx_quantized_folders(src, tensors, out, bits=4, group_size=32):
    """For families mlx_lm lacks: an mlx_lm-style quantized copy of the folder `src` (every 2-D
    weight whose rows split into groups as packed words with float16 scales and biases, as
    mlx_lm's convert writes them at float16) and a float32 folder of the same weights dequantized,
    for an independent reference -> (quantized folder, dequantized folder)."""
    import shutil

    import mlx.core as mx

    out = Path(out)
    packed, plain = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and name.endswith(".weight") and w.shape[1] % group_size == 0:
            wq, s, b = mx.quantize(mx.array(w.astype(np.float16)), group_size=group_size, bits=bits)
            stem = name[: -len("weight")]
            packed[name], packed[stem + "scales"], packed[stem + "biases"] = np.array(wq), np.array(s), np.array(b)
            # (in float32: q * scale + bias unrounded, as a float32 product of the packed rows is)
            plain[name] = np.array(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                                                 group_size=group_size, bits=bits))
        else:
            packed[name] = plain[name] = w
    config = json.loads((Path(src) / "config.json").read_text())
    folders = []
    for sub, ts, cfg in (("mlx-q", packed, {**config, "quantization": {"group_size": group_size, "bits": bits}}),
                         ("dequantized", plain, config)):
        folder = out / sub
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        (folder / "config.json").write_text(json.dumps(cfg))
        wr = SafetensorsWriter(folder / "model.safetensors", [(k, v.shape, str(v.dtype)) for k, v in ts.items()])
        for k, v in ts.items():
            wr.write(k, v)
        wr.close()
        folders.append(folder)
    return tuple(folders)


def make_llama_folder(folder, variant="llama", seed=0, dtype="float32", **overrides):
    """A Hugging Face-style Llama-family folder: config.json, model.safetensors, tokenizer."""
    def checkpoint(cfg, rng):
        t = llama_tensors(cfg, rng)
        return fuse_phi3(t, cfg["num_hidden_layers"]) if cfg["model_type"] == "phi3" else t

    return hf_folder(folder, {**LLAMA_BASE, **VARIANTS[variant], **overrides}, checkpoint, seed, dtype)


def fuse_phi3(tensors, n_layers):
    """Phi-3's checkpoint names: self_attn.qkv_proj = [q; k; v], mlp.gate_up_proj = [gate; up]."""
    t = dict(tensors)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        parts = [t.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        t[p + "self_attn.qkv_proj.weight"] = np.concatenate(parts)
        parts = [t.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
        t[p + "mlp.gate_up_proj.weight"] = np.concatenate(parts)
    return t


OPT_BASE = dict(
    model_type="opt",
    architectures=["OPTForCausalLM"],
    hidden_size=64,
    ffn_dim=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    activation_function="relu",
    do_layer_norm_before=True,
    word_embed_proj_dim=64,
    enable_bias=True,
    layer_norm_elementwise_affine=True,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

OPT_VARIANTS = {
    # opt-125m style: pre-LN, final layer norm, no projections
    "opt": dict(),
    # opt-350m style: post-LN, no final layer norm, project_in/project_out
    "opt-350m": dict(do_layer_norm_before=False, word_embed_proj_dim=32),
}


def opt_tensors(cfg, rng, prefix="model.", lm_head=False):
    d, f, e = cfg["hidden_size"], cfg["ffn_dim"], cfg["word_embed_proj_dim"]
    v, n_pos = cfg["vocab_size"], cfg["max_position_embeddings"] + 2
    s = 0.08

    def w(*shape):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    p = prefix + "decoder."
    t = {p + "embed_tokens.weight": w(v, e), p + "embed_positions.weight": w(n_pos, d)}
    if e != d:
        t[p + "project_in.weight"] = w(d, e)
        t[p + "project_out.weight"] = w(e, d)
    if cfg["do_layer_norm_before"]:
        t[p + "final_layer_norm.weight"] = 1 + w(d)
        t[p + "final_layer_norm.bias"] = w(d)
    for i in range(cfg["num_hidden_layers"]):
        q = f"{p}layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            t[q + f"self_attn.{name}.weight"] = w(d, d)
            t[q + f"self_attn.{name}.bias"] = w(d)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            t[q + ln + ".weight"] = 1 + w(d)
            t[q + ln + ".bias"] = w(d)
        t[q + "fc1.weight"] = w(f, d)
        t[q + "fc1.bias"] = w(f)
        t[q + "fc2.weight"] = w(d, f)
        t[q + "fc2.bias"] = w(d)
    if lm_head:
        t["lm_head.weight"] = t[p + "embed_tokens.weight"].copy()
    return t


def make_opt_folder(folder, variant="opt", seed=0, dtype="float32", lm_head=False, **overrides):
    """A Hugging Face-style OPTForCausalLM folder: config.json, model.safetensors, tokenizer.

    lm_head: also store `lm_head.weight` (a copy of the tied embeddings), as some checkpoints do.
    """
    return hf_folder(folder, {**OPT_BASE, **OPT_VARIANTS[variant], **overrides},
                     lambda cfg, rng: opt_tensors(cfg, rng, lm_head=lm_head), seed, dtype)


GEMMA_BASE = dict(LLAMA_BASE, num_hidden_layers=4, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24)
GEMMA_VARIANTS = {
    # windows shorter than the tests' prompts, so that the sliding layers' masks matter
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=4,
                   sliding_window_pattern=2, rope_theta=1000000.0, rope_local_base_freq=10000.0),
    # (mlx_lm's Gemma 2 ignores the window: at 64 it does not apply to the tests' prompts)
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], sliding_window=64,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
}


def gemma_tensors(cfg, rng):
    """A Gemma 2 / 3 checkpoint's tensors: norms stored as weight - 1, as Gemma's are."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(*shape, s=0.08):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d, s=0.5), "model.norm.weight": w(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[p + norm + ".weight"] = w(d)
        t[p + "self_attn.q_proj.weight"] = w(h * hd, d)
        t[p + "self_attn.k_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.v_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.o_proj.weight"] = w(d, h * hd)
        if cfg["model_type"] == "gemma3_text":
            t[p + "self_attn.q_norm.weight"] = w(hd)
            t[p + "self_attn.k_norm.weight"] = w(hd)
        t[p + "mlp.gate_proj.weight"] = w(f, d)
        t[p + "mlp.up_proj.weight"] = w(f, d)
        t[p + "mlp.down_proj.weight"] = w(d, f)
    return t


def make_gemma_folder(folder, variant="gemma3", seed=0, dtype="float32", **overrides):
    """A Hugging Face-style Gemma 2 / Gemma 3 text folder: config.json, model.safetensors, tokenizer."""
    return hf_folder(folder, {**GEMMA_BASE, **GEMMA_VARIANTS[variant], **overrides}, gemma_tensors, seed, dtype)


def make_gemma3_multimodal_folder(folder, seed=0, dtype="float32"):
    """A Gemma 3 multimodal folder as the Hub's (Gemma3ForConditionalGeneration): config.json's
    text model in text_config (heads left to the defaults: 8 and 4), its tensors under
    language_model.model, a vision tower and projector beside them -> (folder, the text model's
    config, the text model's tensors)."""
    text = {**GEMMA_BASE, **GEMMA_VARIANTS["gemma3"], "num_attention_heads": 8, "num_key_value_heads": 4}
    keep = {k: v for k, v in text.items() if k not in ("num_attention_heads", "num_key_value_heads", "architectures",
                                                        "bos_token_id", "eos_token_id")}
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": keep,
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16}, "bos_token_id": 1,
              "eos_token_id": 2}

    def tensors(cfg, rng):
        t = gemma_tensors({**text, "vocab_size": cfg["vocab_size"]}, rng)
        out = {"language_model." + k: v for k, v in t.items()}
        out["vision_tower.vision_model.embeddings.patch_embedding.weight"] = rng.standard_normal(
            (16, 3, 4, 4)).astype(np.float32)
        out["multi_modal_projector.mm_input_projection_weight"] = rng.standard_normal((16, 64)).astype(np.float32)
        return out

    folder, cfg, t = hf_folder(folder, config, tensors, seed, dtype)
    return folder, {**text, "vocab_size": cfg["vocab_size"]}, {k[len("language_model."):]: v for k, v in t.items()
                                                                if k.startswith("language_model.")}


PHI_BASE = dict(model_type="phi", architectures=["PhiForCausalLM"], hidden_size=64, intermediate_size=192,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, partial_rotary_factor=0.5,
                layer_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, hidden_act="gelu_new",
                qk_layernorm=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def make_phi_folder(folder, seed=0, dtype="float32", **overrides):
    """A Hugging Face-style Phi-2 folder (PhiForCausalLM: a parallel block, biases everywhere)."""
    return hf_folder(folder, {**PHI_BASE, **overrides}, phi_tensors, seed, dtype)


def phi_tensors(cfg, rng):
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]

    def w(*shape, s=0.08):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d, s=0.5), "model.final_layernorm.weight": 1 + w(d),
         "model.final_layernorm.bias": w(d), "lm_head.weight": w(v, d), "lm_head.bias": w(v)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"], t[p + "input_layernorm.bias"] = 1 + w(d), w(d)
        for name, shape in (("q_proj", (d, d)), ("k_proj", (d, d)), ("v_proj", (d, d)), ("dense", (d, d))):
            t[p + f"self_attn.{name}.weight"], t[p + f"self_attn.{name}.bias"] = w(*shape), w(shape[0])
        if cfg["qk_layernorm"]:
            for name in ("q_layernorm", "k_layernorm"):
                t[p + f"self_attn.{name}.weight"], t[p + f"self_attn.{name}.bias"] = 1 + w(hd), w(hd)
        t[p + "mlp.fc1.weight"], t[p + "mlp.fc1.bias"] = w(f, d), w(f)
        t[p + "mlp.fc2.weight"], t[p + "mlp.fc2.bias"] = w(d, f), w(d)
    return t


PERSIMMON_BASE = dict(model_type="persimmon", architectures=["PersimmonForCausalLM"], hidden_size=64,
                      intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.5,
                      layer_norm_eps=1e-5, rope_theta=25000.0, max_position_embeddings=256, hidden_act="relu2",
                      qk_layernorm=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# Falcon-7B's shape in small: multi-query, a parallel block with one LayerNorm, no biases, tied head
FALCON_BASE = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                   bias=False, alibi=False, layer_norm_epsilon=1e-5, max_position_embeddings=256,
                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
FALCON_VARIANTS = {
    "7b": {},
    # Falcon-40B / 180B: grouped attention, an attention and an FFN LayerNorm side by side, untied head
    "40b": dict(new_decoder_architecture=True, num_kv_heads=2, tie_word_embeddings=False),
    # Falcon 2 11B: grouped, one LayerNorm
    "11b": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    # a sequential block, a head of keys and values a query head, biases, ReLU (the paper's ReLU-fied)
    "sequential": dict(multi_query=False, parallel_attn=False, bias=True, activation="relu", ffn_hidden_size=160),
}


def make_persimmon_folder(folder, seed=0, dtype="float32", **overrides):
    """A Hugging Face-style Persimmon folder (a sequential block, q/k/v fused head by head)."""
    return hf_folder(folder, {**PERSIMMON_BASE, **overrides}, persimmon_tensors, seed, dtype)


def make_falcon_folder(folder, variant="7b", seed=0, dtype="float32", **overrides):
    """A Hugging Face-style Falcon folder (transformer.h.N..., q/k/v fused in query_key_value)."""
    return hf_folder(folder, {**FALCON_BASE, **FALCON_VARIANTS[variant], **overrides}, falcon_tensors, seed, dtype)


def _normal(rng):
    def w(*shape, s=0.08):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    return w


def persimmon_tensors(cfg, rng):
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    w = _normal(rng)
    t = {"model.embed_tokens.weight": w(v, d, s=0.5), "model.final_layernorm.weight": 1 + w(d),
         "model.final_layernorm.bias": w(d), "lm_head.weight": w(v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[p + norm + ".weight"], t[p + norm + ".bias"] = 1 + w(d), w(d)
        t[p + "self_attn.query_key_value.weight"], t[p + "self_attn.query_key_value.bias"] = w(3 * d, d), w(3 * d)
        t[p + "self_attn.dense.weight"], t[p + "self_attn.dense.bias"] = w(d, d), w(d)
        for norm in ("q_layernorm", "k_layernorm"):
            t[p + f"self_attn.{norm}.weight"], t[p + f"self_attn.{norm}.bias"] = 1 + w(hd), w(hd)
        t[p + "mlp.dense_h_to_4h.weight"], t[p + "mlp.dense_h_to_4h.bias"] = w(f, d), w(f)
        t[p + "mlp.dense_4h_to_h.weight"], t[p + "mlp.dense_4h_to_h.bias"] = w(d, f), w(d)
    return t


def falcon_tensors(cfg, rng):
    d, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    f = cfg.get("ffn_hidden_size") or 4 * d
    hd, new = d // n, cfg.get("new_decoder_architecture")
    kv = cfg.get("num_kv_heads", n) if new else (1 if cfg.get("multi_query", True) else n)
    bias = cfg.get("bias")
    w = _normal(rng)
    t = {"transformer.word_embeddings.weight": w(v, d, s=0.5), "transformer.ln_f.weight": 1 + w(d),
         "transformer.ln_f.bias": w(d)}
    if not cfg.get("tie_word_embeddings", True):
        t["lm_head.weight"] = w(v, d)
    if new and cfg.get("num_ln_in_parallel_attn", 2) == 2:
        norms = ("ln_attn", "ln_mlp")
    else:
        norms = ("input_layernorm",) if new or cfg.get("parallel_attn", True) else ("input_layernorm",
                                                                                     "post_attention_layernorm")
    for i in range(cfg["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        for norm in norms:
            t[p + norm + ".weight"], t[p + norm + ".bias"] = 1 + w(d), w(d)
        linears = (("self_attention.query_key_value", ((n + 2 * kv) * hd, d)), ("self_attention.dense", (d, d)),
                   ("mlp.dense_h_to_4h", (f, d)), ("mlp.dense_4h_to_h", (d, f)))
        for name, shape in linears:
            t[p + name + ".weight"] = w(*shape)
            if bias:
                t[p + name + ".bias"] = w(shape[0])
    return t


def thresholded_ffn(tensors, layer, x, t_in, t_out, wina=False):
    """A SwiGLU layer's FFN of one token vector x in NumPy, both sides thresholded as the
    `calibrated` sources do: the input dims with |x| >= t_in, then the neurons with |h~| >= t_out
    (wina: |x_i| ||(G; U)[:, i]|| >= t_in, |h~_j| ||D[:, j]|| >= t_out, D as stored [d, d_ff])."""
    p = f"model.layers.{layer}.mlp."
    G, U, D = tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"], tensors[p + "down_proj.weight"]
    n_in = np.sqrt((G ** 2).sum(0) + (U ** 2).sum(0)) if wina else 1.0
    n_out = np.sqrt((D ** 2).sum(0)) if wina else 1.0
    xm = np.where(np.abs(x) * n_in >= t_in, x, 0)
    g, u = G @ xm, U @ xm
    h = g / (1 + np.exp(-g)) * u
    return D @ np.where(np.abs(h) * n_out >= t_out, h, 0)


MOE_BASE = dict(LLAMA_BASE, intermediate_size=96, num_experts_per_tok=2)

MOE_VARIANTS = {
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=4,
                      moe_intermediate_size=64, shared_expert_intermediate_size=128),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=6,
                      num_experts_per_tok=3, moe_intermediate_size=64, head_dim=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3),
    "olmoe": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], num_experts=4, intermediate_size=64,
                  norm_topk_prob=False),
}


def moe_tensors(cfg, rng):
    """Hugging Face tensors of a tiny MoE model of cfg's family (one tensor per expert)."""
    from mlx_flash.models.moe import ModelArgs, expert_tensors

    args = ModelArgs.from_dict(cfg)
    d, v, t_ = cfg["hidden_size"], cfg["vocab_size"], cfg["model_type"]
    s = 0.08

    def w(*shape):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": 1 + w(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attention_tensors(t, p, cfg, w)
        experts = expert_tensors(args, i)
        if experts is None:  # a dense layer
            f = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = w(f, d)
            t[p + "mlp.up_proj.weight"] = w(f, d)
            t[p + "mlp.down_proj.weight"] = w(d, f)
            continue
        block = "block_sparse_moe" if t_ == "mixtral" else "mlp"
        t[p + f"{block}.gate.weight"] = w(args.n_experts, d) * 4  # routers that prefer some experts
        for kind, (_, names) in experts.items():
            for name in names:
                t[name] = w(d, args.d_expert) if kind == "down" else w(args.d_expert, d)
        if cfg.get("shared_expert_intermediate_size"):
            f = cfg["shared_expert_intermediate_size"]
            t[p + "mlp.shared_expert.gate_proj.weight"] = w(f, d)
            t[p + "mlp.shared_expert.up_proj.weight"] = w(f, d)
            t[p + "mlp.shared_expert.down_proj.weight"] = w(d, f)
            t[p + "mlp.shared_expert_gate.weight"] = w(1, d)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    return t


def make_moe_folder(folder, variant="mixtral", seed=0, dtype="float32", **overrides):
    """A Hugging Face-style MoE folder: config.json, model.safetensors, tokenizer."""
    return hf_folder(folder, {**MOE_BASE, **MOE_VARIANTS[variant], **overrides}, moe_tensors, seed, dtype)


def flip_bit(path, at, bit=0x10):
    """Damage one byte of a file in place: the byte at offset `at` (negative: from the end) with
    `bit` flipped."""
    with open(path, "r+b") as f:
        f.seek(at, 0 if at >= 0 else 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ bit]))


# --- GGUFs of these folders' weights, written with gguf-py as llama.cpp's convert_hf_to_gguf.py writes them

SPM_NORMAL = ["▁", "t", "h", "e", "▁t", "he", "▁the"]  # (scores: the earlier, the higher)
SPM_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def spm_vocab(size):
    """A SentencePiece vocabulary as Gemma's, Llama 2's and Phi-3's GGUFs list one: control
    tokens, 256 byte tokens, scored pieces; `size` tokens in all (the embedding's rows)."""
    tokens = SPM_SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + SPM_NORMAL
    assert len(tokens) <= size
    tokens += [f"▁w{i}" for i in range(size - len(tokens))]
    types = [3] * 4 + [6] * 256 + [1] * (size - 260)
    scores = [-1000.0] * 4 + [0.0] * 256 + [-float(i) for i in range(size - 260)]
    return tokens, types, scores


def gguf_writer(path, arch, cfg, head_dim):
    """A gguf.GGUFWriter holding a model's common keys and the spm_vocab of its vocabulary size."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    if "rms_norm_eps" in cfg:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tokens, types, scores = spm_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    return w


def gguf_name(hf, layer_names, global_names=None):
    """A Hugging Face tensor name -> llama.cpp's; layer_names: {HF module in a layer: llama.cpp's
    base}; global_names: {HF module outside the layers: llama.cpp's}, beside the usual three."""
    stem, suffix = hf.rsplit(".", 1)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             **(global_names or {})}
    if stem in names:
        return f"{names[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{layer_names[rest]}.{suffix}"


def gguf_finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

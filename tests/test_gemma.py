"""Gemma 2 and Gemma 3 text models: with every FFN row in DRAM or streamed, the logits are mlx_lm's
(and transformers'), in float32 and at 4 bits."""

import json

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm import convert as mlx_lm_convert
from mlx_lm.utils import load_model

import mlx_flash
from mlx_flash.convert import convert
from helpers import gguf_finish, gguf_name, gguf_writer, make_gemma3_multimodal_folder, make_gemma_folder, spm_vocab
from reference import reference_logits
from test_parity import TOKENS, greedy
from test_quant import EXACT_MODES, assert_logits_in_modes


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def gemma(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    src, cfg, tensors = make_gemma_folder(d / "hf", request.param)
    return request.param, src, d


@pytest.mark.parametrize("mode", ["dense", "naive"])
def test_gemma_matches_mlx_lm(gemma, mode):
    variant, src, d = gemma
    out = convert(src, d / f"flash-{mode}", dtype="float32", progress=False)
    model, _ = mlx_flash.load(out, mode=mode)
    ref, _ = load_model(src)
    x = mx.array([TOKENS])
    diff = mx.abs(model(x) - ref(x)).max().item()
    assert diff < 1e-4, f"{variant} {mode}: max |logit diff| {diff}"
    assert greedy(model, TOKENS, 16) == greedy(ref, TOKENS, 16)


def test_gemma_4bit_matches_mlx_lm_on_the_same_weights(gemma):
    """An mlx_lm 4-bit folder of the model, converted, against mlx_lm's model of it (float32
    compute), in every exact mode and in flash mode through the DIP store at density 1."""
    variant, src, d = gemma
    q = d / "mlx-q4"
    if not q.exists():
        mlx_lm_convert(str(src), str(q), quantize=True, q_bits=4, q_group_size=32, dtype="float16")
    out = convert(q, d / "flash-q4", progress=False, dip=True)
    ref, _ = load_model(q)
    ref.set_dtype(mx.float32)
    x = mx.array([TOKENS])
    assert_logits_in_modes(out, x, ref(x), EXACT_MODES + [dict(mode="flash", sparsity="dip", density=1.0)],
                           f"{variant} 4-bit")


@pytest.mark.slow  # (test_sliding_layers_keep_their_window checks transformers' windows too, in CI)
def test_gemma_matches_transformers(gemma):
    """transformers' own Gemma (eager attention, its sliding windows) on the same folder."""
    variant, src, d = gemma
    model, _ = mlx_flash.load(convert(src, d / "flash-ref", dtype="float32", progress=False))
    want = reference_logits(src, TOKENS)
    got = np.array(model(mx.array([TOKENS]))[0])
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_sliding_layers_keep_their_window(tmp_path, variant):
    """Past the window, a sliding layer attends to the last `sliding_window` positions only (mlx_lm's
    Gemma 2 attends to all of them): transformers is the reference, for a prompt and a position at a
    time, through this model's caches (rotating on sliding layers) and a memory plan's (full
    caches, windowed masks)."""
    from mlx_flash.runtime.memory import kv_caches

    src, _, _ = make_gemma_folder(tmp_path / "hf", variant, sliding_window=3, sliding_window_pattern=2)
    model, _ = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False))
    want = reference_logits(src, TOKENS)
    got = np.array(model(mx.array([TOKENS]))[0])
    assert np.abs(got - want).max() < 1e-4
    for cache in (model.make_cache(), kv_caches(len(model.layers), context=32)):
        first = np.array(model(mx.array([TOKENS[:5]]), cache=cache)[0])
        steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in TOKENS[5:]]
        assert np.abs(np.concatenate([first, np.stack(steps)]) - want).max() < 1e-4


# --- the same weights through a GGUF, written as llama.cpp's convert_hf_to_gguf.py writes Gemma

GEMMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def write_gemma_gguf(path, cfg, tensors):
    arch = {"gemma3_text": "gemma3", "gemma2": "gemma2"}[cfg["model_type"]]
    w = gguf_writer(path, arch, cfg, cfg["head_dim"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
    w.add_add_space_prefix(False)
    for hf, x in tensors.items():
        if hf.endswith("norm.weight"):
            x = x + 1  # (convert_hf_to_gguf.py: llama.cpp's RMS norm multiplies by w, Gemma's by 1 + w)
        w.add_tensor(gguf_name(hf, GEMMA_NAMES), x.astype(np.float32))
    gguf_finish(w)


@pytest.mark.parametrize("variant", ["gemma3", "gemma2"])
def test_gemma_gguf_converts_to_the_same_logits(tmp_path, variant):
    # (what llama.cpp's Gemma takes from its own code, not the file: every sixth layer of a
    # Gemma 3 a global one; attention scaled by head_dim^-1/2 but in the 27B models)
    src, cfg, tensors = make_gemma_folder(tmp_path / "hf", variant, max_position_embeddings=256,
                                          num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32,
                                          vocab_size=272)
    write_gemma_gguf(tmp_path / "m.gguf", cfg, tensors)
    ours, tok = mlx_flash.load(convert(tmp_path / "m.gguf", tmp_path / "from-gguf", dtype="float32", progress=False))
    ref, _ = mlx_flash.load(convert(src, tmp_path / "from-hf", dtype="float32", progress=False))
    assert ours.args.layer_types == ref.args.layer_types and ours.args.embed_scale == ref.args.embed_scale
    x = mx.array([TOKENS])
    assert mx.abs(ours(x) - ref(x)).max().item() < 1e-4


def test_sentencepiece_gguf_tokenizer(tmp_path):
    """The highest-scored join first, spaces as "▁", bytes for what no piece holds, a BOS first,
    no space prefix (Gemma's add_space_prefix = false); decoding gives the text back."""
    src, cfg, tensors = make_gemma_folder(tmp_path / "hf", "gemma3", max_position_embeddings=256, vocab_size=272)
    write_gemma_gguf(tmp_path / "m.gguf", cfg, tensors)
    _, tok = mlx_flash.load(convert(tmp_path / "m.gguf", tmp_path / "flash", dtype="float32", progress=False))
    tokens, _, _ = spm_vocab(cfg["vocab_size"])
    ids = tok.encode("the the\n")
    assert [tokens[i] for i in ids] == ["<bos>", "t", "he", "▁the", "<0x0A>"]
    assert tok.decode(ids, skip_special_tokens=True) == "the the\n"
    assert tok.decode(tok.encode("Ünï 日本 🎉 <eos>"), skip_special_tokens=False) == "<bos>Ünï 日本 🎉 <eos>"


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_decode_steps_on_the_host_equal_mlx(tmp_path, variant, monkeypatch):
    """A position at a time through models/host.py (soft-caps, (1 + w) norms, the two rotary
    bases, windows over full caches) against the MLX path, 8-bit weights through the kernels."""
    from mlx_flash.convert.quantize import QuantOptions
    from mlx_flash.models import gemma, host
    from mlx_flash.runtime.memory import kv_caches

    src, _, _ = make_gemma_folder(tmp_path / "hf", variant, sliding_window=3, sliding_window_pattern=2)
    out = convert(src, tmp_path / "q8", dtype="float32", progress=False,
                  quant=QuantOptions(quantize=True, bits=8, group_size=32))
    model, _ = mlx_flash.load(out, mode="naive")
    calls = []
    real = gemma.GemmaModel._host_step
    monkeypatch.setattr(gemma.GemmaModel, "_host_step", lambda self, h, c: calls.append(1) or real(self, h, c))
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(host, "HOST_STEP", on)
        for name, cache in (("own", model.make_cache()), ("plan", kv_caches(len(model.layers), context=32))):
            model(mx.array([TOKENS[:3]]), cache=cache)
            runs[on, name] = np.stack([np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in TOKENS[3:]])
    assert len(calls) == 2 * len(TOKENS[3:])  # (the host path taken when allowed, not otherwise)
    for name in ("own", "plan"):
        assert np.abs(runs[True, name] - runs[False, name]).max() < 1e-4


def test_calibration_says_it_takes_llama_blocks_only(gemma):
    """Gemma's block has the names a Llama block has, not its sums: refused, not miscalibrated."""
    from mlx_flash.errors import FlashError
    from mlx_flash.sparsity.allocation import calibrate_thresholds

    variant, src, d = gemma
    out = convert(src, d / "flash-cal", dtype="float32", progress=False)
    with pytest.raises(FlashError, match="Llama-family blocks"):
        calibrate_thresholds(out, data="wikitext", tokens=64, seq_len=32, progress=False, log=lambda *a: None)


def test_a_gemma3_multimodal_checkpoint_converts_its_text_model(tmp_path):
    """The Hub's Gemma 3 checkpoints (4B and up) are multimodal: the text model's config in
    text_config (transformers' defaults for what it leaves out), its tensors under language_model;
    the folder holds the text model alone, with mlx_lm's logits (its gemma3 drops the vision tower
    too)."""
    src, text, _ = make_gemma3_multimodal_folder(tmp_path / "hf")
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["num_attention_heads"] == 8
    assert "vision" not in " ".join(mx.load(str(out / "resident.safetensors")))
    model, _ = mlx_flash.load(out, mode="naive")
    ref, _ = load_model(src)
    x = mx.array([TOKENS])
    assert mx.abs(model(x) - ref(x)).max().item() < 1e-4
    assert greedy(model, TOKENS) == greedy(ref, TOKENS)

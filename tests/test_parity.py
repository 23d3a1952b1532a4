"""With every FFN row in DRAM, mlx_flash is exact: it matches mlx_lm (and transformers)."""

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from helpers import make_llama_folder, mlx_lm_4bit
from reference import reference_logits

TOKENS = [1, 5, 9, 33, 70, 12, 4, 100, 7, 250, 3]


def greedy(model, prompt, n=12):
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "llama-bias", "mistral", "qwen2", "qwen3", "phi3", "granite"])
def test_llama_family_matches_mlx_lm(tmp_path, variant):
    src, cfg, _ = make_llama_folder(tmp_path / "hf", variant)
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    model, tok = mlx_flash.load(out)
    ref, _ = load_model(src)
    x = mx.array([TOKENS])
    diff = mx.abs(model(x) - ref(x)).max().item()
    assert diff < 1e-4, f"{variant}: max |logit diff| {diff}"
    assert greedy(model, TOKENS) == greedy(ref, TOKENS)


@pytest.mark.parametrize("variant", ["phi3", "granite", "llama-bias"])
def test_phi3_and_granite_match_transformers(tmp_path, variant):
    """Phi-3's fused checkpoint split at conversion, Granite's multipliers, a Llama with biases in
    every projection: transformers' own models."""
    src, cfg, _ = make_llama_folder(tmp_path / "hf", variant)
    model, _ = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False))
    want = reference_logits(src, TOKENS)
    got = np.array(model(mx.array([TOKENS]))[0])
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("variant", ["mistral", "phi3"])
def test_a_sliding_window_is_kept_as_transformers_keeps_it(tmp_path, variant):
    """Mistral v0.1 and Phi-3 give every layer a window (mlx_lm attends to every position): past
    it, transformers' logits, for a prompt and a position at a time through full caches."""
    from mlx_flash.runtime.memory import kv_caches

    src, cfg, _ = make_llama_folder(tmp_path / "hf", variant, sliding_window=3)
    model, _ = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False))
    want = reference_logits(src, TOKENS)
    assert np.abs(np.array(model(mx.array([TOKENS]))[0]) - want).max() < 1e-4
    cache = kv_caches(len(model.layers), context=32)
    first = np.array(model(mx.array([TOKENS[:4]]), cache=cache)[0])
    steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in TOKENS[4:]]
    assert np.abs(np.concatenate([first, np.stack(steps)]) - want).max() < 1e-4


def test_qwen_windows_in_some_layers_are_refused(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "qwen2", sliding_window=3, use_sliding_window=True)
    with pytest.raises(FlashError, match="use_sliding_window"):
        convert(src, tmp_path / "flash", dtype="float32", progress=False)


def test_float16_flash_is_exact_float16_weights(tmp_path):
    """Converting to float16 rounds each weight once; compute stays float32 on the CPU."""
    src, cfg, tensors = make_llama_folder(tmp_path / "hf", "llama")
    rounded = tmp_path / "hf16"
    make_llama_folder(rounded, "llama", dtype="float16")  # same seed: same weights, rounded
    out = convert(src, tmp_path / "flash", dtype="float16", progress=False)
    model, _ = mlx_flash.load(out)
    assert model.runtime.compute_dtype == "float32"
    ref, _ = load_model(rounded)
    ref.set_dtype(mx.float32)
    x = mx.array([TOKENS])
    assert mx.abs(model(x) - ref(x)).max().item() < 1e-4


@pytest.mark.parametrize("act", ["relu", "relu2"])
def test_relu_llama_matches_transformers(tmp_path, act):
    """mlx_lm ignores hidden_act (always SwiGLU); we honour it, checked against transformers."""
    src, cfg, _ = make_llama_folder(tmp_path / "hf", "llama", hidden_act=act)
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    model, _ = mlx_flash.load(out)
    want = reference_logits(src, TOKENS)
    got = np.array(model(mx.array([TOKENS]))[0])
    assert np.abs(got - want).max() < 1e-4


def test_fatrelu_ffn_matches_numpy(tmp_path):
    """FATReLU (paper App. C.5): the gate keeps x >= T, zeroes the rest."""
    T = 0.05
    src, cfg, tensors = make_llama_folder(tmp_path / "hf", "llama", hidden_act="fatrelu",
                                          fatrelu_threshold=T)
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    model, _ = mlx_flash.load(out)
    x = np.random.default_rng(1).standard_normal((3, cfg["hidden_size"])).astype(np.float32)
    got = np.array(model.layers[1].mlp(mx.array(x)))
    g = x @ tensors["model.layers.1.mlp.gate_proj.weight"].T
    u = x @ tensors["model.layers.1.mlp.up_proj.weight"].T
    h = np.where(g >= T, g, 0) * u
    want = h @ tensors["model.layers.1.mlp.down_proj.weight"].T
    assert (g < T).mean() > 0.3  # the threshold really prunes
    assert np.abs(got - want).max() < 1e-5


def test_generate_api_shapes(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    model, tok = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False))
    text = mlx_flash.generate(model, tok, "hello world", max_tokens=5)
    assert isinstance(text, str)
    resps = list(mlx_flash.stream_generate(model, tok, "hello", max_tokens=4, temp=0.7, top_p=0.9))
    assert len(resps) == 4 and resps[-1].generation_tokens == 4
    assert model(mx.array([TOKENS])).shape == (1, len(TOKENS), cfg_vocab(model))


def cfg_vocab(model):
    return model.args.vocab_size


def test_a_llama_with_ffn_biases_gives_its_logits_in_every_exact_mode_at_4_bits(tmp_path):
    """mlp_bias: the gate's, up's and down's biases resident beside the rows read from flash, in the
    MLX and the native products; sources that have no biases in their sums are refused."""
    from test_quant import EXACT_MODES, assert_logits_in_modes

    src, _, _ = make_llama_folder(tmp_path / "hf", "llama-bias")
    q, ref = mlx_lm_4bit(src, tmp_path / "mlx-q4")
    out = convert(q, tmp_path / "flash", progress=False)
    x = mx.array([TOKENS])
    assert_logits_in_modes(out, x, ref(x), EXACT_MODES, "llama-bias 4-bit")
    with pytest.raises(FlashError, match="without biases"):
        mlx_flash.load(out, mode="flash", sparsity="dip", density=0.5)

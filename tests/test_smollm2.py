"""The default model, SmolLM2-135M-Instruct, from its GGUF: imported right, exact, coherent."""

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.layout.export import export_hf
from reference import reference_logits

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_gguf, tmp_path_factory):
    """The GGUF converted at float32: the dequantized weights, unrounded."""
    return convert(smollm2_gguf, tmp_path_factory.mktemp("s") / "flash32", dtype="float32", progress=False)


def greedy(model, tokens, n=16):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


@pytest.mark.slow  # (35-40 s: transformers dequantizes the GGUF; test_quant.py holds the same import to mlx_lm)
def test_gguf_import_matches_transformers_gguf_loader(smollm2_gguf, smollm2_f32):
    """transformers dequantizes and un-permutes the same GGUF its own way."""
    model, tok = mlx_flash.load(smollm2_f32)
    tokens = tok.encode(PROMPT)
    want = reference_logits(smollm2_gguf.parent, tokens, gguf_file=smollm2_gguf.name)
    got = np.array(model(mx.array([tokens]))[0])
    diff = np.abs(got - want).max()
    print(f"SmolLM2 GGUF: max |logit - transformers| = {diff:.2e}")
    assert diff < 1e-4, diff
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_default_model_matches_mlx_lm_on_the_same_weights(smollm2, tmp_path):
    model, tok = mlx_flash.load(smollm2)
    ref, _ = load_model(export_hf(smollm2, tmp_path / "hf", dtype="float32"))
    tokens = tok.encode(PROMPT)
    diff = mx.abs(model(mx.array([tokens])) - ref(mx.array([tokens]))).max().item()
    print(f"SmolLM2: max |logit - mlx_lm| = {diff:.2e}")
    assert diff < 1e-4, diff
    assert greedy(model, tokens, 24) == greedy(ref, tokens, 24)


def test_default_model_is_coherent(smollm2):
    model, tok = mlx_flash.load(smollm2)
    text = mlx_flash.generate(model, tok, PROMPT, max_tokens=12)
    assert "Paris" in text, text

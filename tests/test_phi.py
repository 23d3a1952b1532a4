"""Phi-1 / 1.5 / 2 (`phi`): a parallel block, biases everywhere, partial rotary, a non-gated FFN
streamed from flash; logits against mlx_lm (and transformers, q/k LayerNorms too), float32 and
4 bits, in every exact mode."""

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.utils import load_model

import mlx_flash
from mlx_flash.convert import convert
from helpers import make_phi_folder, mlx_lm_4bit
from reference import reference_logits
from test_parity import TOKENS, greedy
from test_quant import EXACT_MODES, assert_logits_in_modes


@pytest.mark.parametrize("mode", ["dense", "naive", "hybrid"])
def test_phi_matches_mlx_lm(tmp_path, mode):
    src, _, _ = make_phi_folder(tmp_path / "hf")
    model, _ = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False), mode=mode)
    ref, _ = load_model(src)
    x = mx.array([TOKENS])
    assert mx.abs(model(x) - ref(x)).max().item() < 1e-4
    assert greedy(model, TOKENS) == greedy(ref, TOKENS)


@pytest.mark.parametrize("overrides", [{}, {"qk_layernorm": True}, {"hidden_act": "relu"}])
def test_phi_matches_transformers(tmp_path, overrides):
    """q/k LayerNorms (mlx_lm has none), and a ReLU-fied Phi-2 (the paper's): the activation honoured."""
    src, _, _ = make_phi_folder(tmp_path / "hf", **overrides)
    model, _ = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False))
    want = reference_logits(src, TOKENS)
    assert np.abs(np.array(model(mx.array([TOKENS]))[0]) - want).max() < 1e-4


def test_phi_4bit_matches_mlx_lm_on_the_same_weights(tmp_path):
    src, _, _ = make_phi_folder(tmp_path / "hf")
    q, ref = mlx_lm_4bit(src, tmp_path / "mlx-q4")
    out = convert(q, tmp_path / "flash", progress=False)
    x = mx.array([TOKENS])
    assert_logits_in_modes(out, x, ref(x), EXACT_MODES)

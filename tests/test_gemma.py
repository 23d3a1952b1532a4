"""Gemma 2 and Gemma 3 text models: with every FFN row in DRAM or streamed, the logits are mlx_lm's
(and transformers'), in float32 and at 4 bits."""

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm import convert as mlx_lm_convert
from mlx_lm.utils import load_model

import mlx_flash
from mlx_flash.convert import convert
from helpers import make_gemma_folder
from reference import reference_logits
from test_parity import TOKENS, greedy
from test_quant import EXACT_MODES


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
    want = ref(x)
    for options in EXACT_MODES + [dict(mode="flash", sparsity="dip", density=1.0)]:
        model, _ = mlx_flash.load(out, **options)
        diff = mx.abs(model(x) - want).max().item()
        assert diff < 1e-4, f"{variant} 4-bit {options}: max |logit diff| {diff}"
        model.runtime.close()


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

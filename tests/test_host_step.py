"""A decode position on the host (models/host.py) gives the MLX path's values, for every rope
form, attention variant and mode it takes, and is the path a CPU decode step takes."""

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

import mlx_flash
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.models import host
from test_parity import TOKENS

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def decode(model, prompt, steps, host_step, cache=None):
    """The logits of `steps` greedy decode positions after `prompt`, with the host path on or off."""
    was = host.HOST_STEP
    host.HOST_STEP = host_step
    try:
        cache = cache or make_prompt_cache(model)
        logits = model(mx.array([prompt]), cache=cache)
        out = []
        for _ in range(steps):
            y = mx.argmax(logits[0, -1]).reshape(1, 1)
            logits = model(y, cache=cache)
            out.append(np.array(logits[0, -1]))
        return np.stack(out)
    finally:
        host.HOST_STEP = was


@pytest.mark.parametrize("variant,overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("qwen3", {}),  # q/k norms, head_dim 32
    ("mistral", {"num_key_value_heads": 2}),  # grouped queries
    ("llama", {"rope_traditional": True}),
    ("llama", {"rope_scaling": LLAMA3_SCALING}),
    ("phi3", {}),  # half of each head rotated
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(4)],
                               "long_factor": [2.0 + i / 4 for i in range(4)]},
              "original_max_position_embeddings": 4, "max_position_embeddings": 64}),  # LongRoPE, past its length
    ("granite", {}),  # the multipliers
])
def test_host_step_matches_the_mlx_path(tiny_llama, variant, overrides):
    m = tiny_llama(f"host-{variant}", "float32", variant=variant, **overrides)
    model, _ = mlx_flash.load(m.flash)
    want = decode(model, TOKENS, 6, host_step=False)
    got = decode(model, TOKENS, 6, host_step=True)
    assert np.abs(got - want).max() < 1e-5
    model.runtime.close()


@pytest.mark.parametrize("options", [dict(mode="dense"), dict(mode="naive"), dict(mode="hybrid"),
                                     dict(mode="flash", sparsity="oracle", density=1.0)])
def test_host_step_matches_at_4_bits_in_every_exact_mode(tmp_path, options):
    from helpers import make_llama_folder
    from mlx_flash.convert import convert

    src, _, _ = make_llama_folder(tmp_path / "hf", "qwen2", intermediate_size=128)
    out = convert(src, tmp_path / "flash", progress=False, quant=QuantOptions(quantize=True, bits=4, group_size=32))
    model, _ = mlx_flash.load(out, **options)
    want = decode(model, TOKENS, 5, host_step=False)
    got = decode(model, TOKENS, 5, host_step=True)
    assert np.abs(got - want).max() < 1e-5, options
    model.runtime.close()


def test_a_rotating_cache_takes_the_host_path(tiny_llama):
    m = tiny_llama("host-rotating", "float32")
    model, _ = mlx_flash.load(m.flash)
    caches = lambda: [RotatingKVCache(max_size=8, keep=0) for _ in model.layers]  # noqa: E731
    want = decode(model, TOKENS[:6], 6, host_step=False, cache=caches())
    got = decode(model, TOKENS[:6], 6, host_step=True, cache=caches())
    assert np.abs(got - want).max() < 1e-5
    model.runtime.close()


def test_a_cpu_decode_step_goes_through_the_host_and_a_prompt_does_not(tiny_llama, monkeypatch):
    m = tiny_llama("host-taken", "float32")
    model, _ = mlx_flash.load(m.flash)
    calls = []
    step = type(model.model)._host_step
    monkeypatch.setattr(type(model.model), "_host_step", lambda self, h, c: calls.append(1) or step(self, h, c))
    cache = [KVCache() for _ in model.layers]
    model(mx.array([TOKENS]), cache=cache)
    assert calls == []
    model(mx.array([[5]]), cache=cache)
    assert calls == [1]
    model(mx.array([[5], [6]]))  # two sequences, no cache
    assert calls == [1]
    model.runtime.close()

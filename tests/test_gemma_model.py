"""The real Gemma 3 270M (Q4_K_M GGUF, the Gemma licence), built by `make model-gemma`.

Slow (~20 s on a 2-core CPU) and skipped when the model is not built; run it with
`pytest -m slow tests/test_gemma_model.py`. benchmarks/gemma-3-270m compares it with llama.cpp.
"""

from pathlib import Path

import pytest

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_flash

MODEL = Path(__file__).resolve().parent.parent / "models" / "gemma-3-270m"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    if not (MODEL / "manifest.json").exists():
        pytest.skip("Gemma 3 270M is not built (make model-gemma)")
    return MODEL


def greedy(model, tokens, n=12):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


def test_the_real_gemma_3_says_the_same_in_every_exact_mode_and_under_a_limit(gemma):
    model, tok = mlx_flash.load(gemma, mode="dense")
    prompt = tok.encode("The largest planet in the solar system is")
    assert prompt[0] == tok.bos_token_id
    want = greedy(model, prompt)
    assert "Jupiter" in tok.decode(want)
    del model
    for options in (dict(mode="naive"), dict(mode="hybrid", memory_budget="50%"), dict(memory_limit="600MB")):
        model, _ = mlx_flash.load(gemma, **options)
        assert greedy(model, prompt) == want, options
        model.runtime.close()

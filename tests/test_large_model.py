"""The real 1.5B: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), built by `make model-large`.

Slow (about a minute on a 2-core CPU: one dense and one naive pass of 16 greedy tokens) and
skipped when the model is not built; run it with `pytest -m slow tests/test_large_model.py`.
"""

from pathlib import Path

import pytest

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_flash

LARGE_MODEL = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-1.5b-instruct"
QUESTION = "Write a Python function that reverses a string."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def large_model():
    if not (LARGE_MODEL / "manifest.json").exists():
        pytest.skip("the 1.5B model is not built (make model-large)")
    return LARGE_MODEL


def greedy(model, tokens, n=16):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


@pytest.fixture(scope="module")
def dense(large_model):
    """(prompt tokens, the dense model's 16 greedy tokens, tokenizer)."""
    model, tok = mlx_flash.load(large_model, mode="dense")
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    out = greedy(model, prompt)
    del model
    return prompt, out, tok


def test_large_model_dense_writes_code(dense):
    _, out, tok = dense
    text = tok.decode(out)
    print(f"Qwen2.5-Coder-1.5B (dense): {text!r}")
    assert len(out) == 16
    assert "def " in text, text


def test_large_model_naive_matches_dense(large_model, dense):
    """--mode naive (every FFN row read from flash each token) gives dense's greedy tokens."""
    prompt, want, tok = dense
    model, _ = mlx_flash.load(large_model, mode="naive")
    got = greedy(model, prompt)
    assert model.runtime.stats()["summary"]["mode"] == "naive"
    assert got == want, (tok.decode(got), tok.decode(want))

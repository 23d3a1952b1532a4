"""The real Gemma 3 270M (Q4_K_M GGUF, the Gemma licence), built by `make model-gemma`.

Slow (~40 s on a 2-core CPU) and skipped when the model is not built; run it with
`pytest -m slow tests/test_gemma_model.py`. benchmarks/gemma-3-270m compares it with llama.cpp.
"""

import subprocess
import sys
from pathlib import Path

import pytest

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_flash

MODEL = Path(__file__).resolve().parent.parent / "models" / "gemma-3-270m"
PROMPT = "Water is made of hydrogen and"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    if not (MODEL / "manifest.json").exists():
        pytest.skip("Gemma 3 270M is not built (make model-gemma)")
    return MODEL


def greedy(model, tokens, n=12):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


def generate_cli(gemma, limit):
    return subprocess.run([sys.executable, "-m", "mlx_flash", "generate", "--model", str(gemma), "--prompt", PROMPT,
                           "--max-tokens", "12", "--memory-limit", limit], capture_output=True, text=True, timeout=300)


def test_the_real_gemma_3_says_the_same_in_every_exact_mode_and_under_a_limit(gemma):
    model, tok = mlx_flash.load(gemma, mode="dense")
    prompt = tok.encode(PROMPT)
    assert prompt[0] == tok.bos_token_id
    want = greedy(model, prompt)
    text = tok.decode(want)
    assert "oxygen" in text
    del model
    for options in (dict(mode="naive"), dict(mode="hybrid", memory_budget="50%")):
        model, _ = mlx_flash.load(gemma, **options)
        assert greedy(model, prompt) == want, options
        model.runtime.close()
        del model
    r = generate_cli(gemma, "900MB")
    assert r.returncode == 0 and text in r.stdout, r.stderr[-2000:]
    # its 262,144-token vocabulary: the tokenizer's load alone peaks ~730 MB above the imports
    r = generate_cli(gemma, "600MB")
    assert r.returncode != 0 and "loading the tokenizer" in r.stderr, r.stderr[-2000:]

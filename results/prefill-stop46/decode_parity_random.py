"""Decode steps (one token at a time, the one-position kernels) of the 4-bit SmolLM2 against mlx_lm's
on the same weights, for prompts of 20 random ids (or, with `text`, three real text prompts):
the largest logit difference over the steps (the distance the product's decode already had
from mlx_lm).

usage: .venv/bin/python results/prefill-stop46/decode_parity_random.py [text]
"""
import sys
import mlx_flash, numpy as np, mlx.core as mx, tempfile
from pathlib import Path
from mlx_lm.utils import load_model
from mlx_lm.models.cache import make_prompt_cache
from mlx_flash import kernels as K
from mlx_flash.layout.export import export_hf
module, _ = K.kernels_module()
model, tok = mlx_flash.load("models/smollm2-135m-instruct", progress=False)
ref, _ = load_model(export_hf("models/smollm2-135m-instruct", Path(tempfile.mkdtemp()) / "hf", dtype="float32"))
rng = np.random.default_rng(7)
for trial in range(3):
    ids = rng.integers(1, 49000, 20).tolist() if "text" not in sys.argv[1:] else tok.encode([
        "The quick brown fox jumps over the lazy dog. The dog sleeps.",
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital",
        "In 1905 Albert Einstein published four papers that changed physics"][trial])
    # decode token by token through both
    cm, cr = make_prompt_cache(model), make_prompt_cache(ref)
    worst = 0
    for t in ids:
        a = model(mx.array([[t]]), cache=cm); b = ref(mx.array([[t]]), cache=cr)
        worst = max(worst, mx.abs(a - b).max().item())
    print(f"trial {trial}: one token at a time (qmv kernels vs mlx_lm): max diff {worst:.2e}")

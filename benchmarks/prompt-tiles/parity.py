"""Prompt logits of the 4-bit SmolLM2 (the default model, Q4_1 kept at its bits) against mlx_lm on
the same weights exported at float32, for real text prompts: through the pass kernels' tiles
(kernels.PROMPT_PASS = 256, off by default) and through dequantized chunks + BLAS
(PROMPT_PASS = 0, the default); and one
token at a time after each prompt (the decode's qmv kernels) for scale: max |logit diff|.

usage: .venv/bin/python benchmarks/prompt-tiles/parity.py
"""
import tempfile
from pathlib import Path
import mlx_flash
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from mlx_flash.kernels import passes as K  # (the pass kernels' caps: BATCH_PASS, PROMPT_PASS, SMALL_PASS)
from mlx_flash.layout.export import export_hf

model, tok = mlx_flash.load("models/smollm2-135m-instruct", progress=False)
ref, _ = load_model(export_hf("models/smollm2-135m-instruct", Path(tempfile.mkdtemp()) / "hf", dtype="float32"))
texts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
         "The quick brown fox jumps over the lazy dog. " * 3,
         "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, on "
         "Brownian motion, on special relativity, and on the equivalence of mass and energy. Each of them",
         open("README.md").read()[:1500]]
tiles = K.BATCH_PASS  # (PROMPT_PASS: 0 by default)
for t in texts:
    ids = mx.array([tok.encode(t)[:256]])
    r = ref(ids)
    out = []
    for cap in (tiles, 0):
        K.PROMPT_PASS = cap
        out.append(mx.abs(model(ids) - r).max().item())
    K.PROMPT_PASS = 0
    # one token at a time over the same ids (each position a decode step), against the reference's
    cache = make_prompt_cache(model)
    steps = mx.concatenate([model(ids[:, i:i + 1], cache=cache) for i in range(ids.shape[1])], axis=1)
    print(f"{ids.shape[1]:3d} tokens: tiles {out[0]:.2e}  BLAS {out[1]:.2e}  one token at a time "
          f"{mx.abs(steps - r).max().item():.2e}")

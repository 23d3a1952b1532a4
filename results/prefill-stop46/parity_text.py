"""Prompt logits of the 4-bit SmolLM2 against mlx_lm on the same weights (float32 export), for
real text prompts: through the pass kernels' tiles (kernels.pass_kernels patched as in
prefill_tiles.py to take a prompt chunk) and through dequantized chunks + BLAS (as the product
runs prompts).

usage: .venv/bin/python results/prefill-stop46/parity_text.py
"""
import mlx_flash, numpy as np, mlx.core as mx, tempfile
from pathlib import Path
from mlx_lm.utils import load_model
from mlx_flash import kernels as K
from mlx_flash.layout.export import export_hf
import mlx_flash.models.half as H

module, _ = K.kernels_module()
orig = K.pass_kernels


def prompts_too(module, x):
    positions = x.size // x.shape[-1]
    return (K.SMALL_PASS < positions <= K.BATCH_PASS and K.batched(module)) or orig(module, x)
model, tok = mlx_flash.load("models/smollm2-135m-instruct", progress=False)
ref, _ = load_model(export_hf("models/smollm2-135m-instruct", Path(tempfile.mkdtemp()) / "hf", dtype="float32"))
texts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
         "The quick brown fox jumps over the lazy dog. " * 3,
         "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, on Brownian motion, on special relativity, and on the equivalence of mass and energy. Each of them",
         open("README.md").read()[:1500]]
for t in texts:
    ids = mx.array([tok.encode(t)[:256]])
    r = ref(ids)
    out = []
    for patched in (prompts_too, orig):
        K.pass_kernels = H.pass_kernels = patched
        out.append(mx.abs(model(ids) - r).max().item())
    K.pass_kernels = H.pass_kernels = orig
    print(f"{ids.shape[1]} tokens: tiles {out[0]:.2e} BLAS {out[1]:.2e}")

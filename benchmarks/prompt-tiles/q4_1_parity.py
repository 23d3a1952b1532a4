"""The Q4_1 SmolLM2 GGUF (make model) converted at its bits, against tests/test_quant.py's
reference (mlx_lm's llama holding the values MLX's GGUF reader gives, dequantized to float32:
test_smollm2_q4_1_gguf_matches_mlx_lm_on_its_own_values), over test_parity.TOKENS: max |logit
diff| of MLX's own quantized kernel (the reference before dequantizing), of our held-quantized
model's prompt through the pass kernels' tiles (kernels.PROMPT_PASS = 256) and through dequantized
chunks + BLAS (0, the default), and of the same ids one token at a time (the decode's kernels);
with the max a position.

usage: .venv/bin/python benchmarks/prompt-tiles/q4_1_parity.py
"""
import sys, json, tempfile
sys.path.insert(0, "tests")
from pathlib import Path
import mlx_flash
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_flash.kernels import passes as K  # (the pass kernels' caps: BATCH_PASS, PROMPT_PASS, SMALL_PASS)
from mlx_flash.convert import convert
from mlx_flash.models.quantized import dequantize_modules
from test_quant import _reference_from_gguf
from test_parity import TOKENS
src = "models/download/SmolLM2-135M-Instruct.Q4_1.gguf"
out = convert(src, Path(tempfile.mkdtemp()) / "q4", progress=False)
config = json.loads((out / "config.json").read_text())
ref = _reference_from_gguf(src, config)
x = mx.array([TOKENS])
want_q = ref(x)
dequantize_modules(ref, mx.float32)
want = ref(x)
print("noise (MLX quantized vs dequantized)", mx.abs(want_q - want).max().item())
model, _ = mlx_flash.load(out, resident_dtype="quantized")
for cap in (K.BATCH_PASS, 0):
    K.PROMPT_PASS = cap
    print("prompt, PROMPT_PASS", cap, mx.abs(model(x) - want).max().item(), mx.abs(model(x) - want).max(axis=-1))
cache = make_prompt_cache(model)
steps = mx.concatenate([model(x[:, i:i + 1], cache=cache) for i in range(x.shape[1])], axis=1)
print("one at a time", mx.abs(steps - want).max().item(), mx.abs(steps - want).max(axis=-1))
K.PROMPT_PASS = 0

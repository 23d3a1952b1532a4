"""One FFN-sized matrix (8960 x 1536, group 32) through the native kernels and through
mx.quantized_matmul, at 4 and 8 bits; the real model's head and one attention projection.
What the FFN and attention of a decode step would cost at the kernels' own speed.

    .venv/bin/python benchmarks/qwen-1.5b/kernels.py
"""
import time, mlx_flash, mlx.core as mx, mlx.nn as nn
from mlx_flash.models.quantized import NativeQuantizedLinear
model, tok = mlx_flash.load("models/qwen2.5-coder-1.5b-instruct", mode="dense")
head = model.lm_head
def rate(m, shape_in, n=30):
    x = mx.random.normal((1, 1, shape_in)); mx.eval(m(x))
    t = time.perf_counter()
    for _ in range(n): mx.eval(m(x))
    dt = (time.perf_counter() - t) / n
    b = m.weight.nbytes + m.scales.nbytes + m.biases.nbytes
    return dt * 1000, b / dt / 1e9
for bits in (4, 8):
    lin = nn.QuantizedLinear(1536, 8960, bias=False, group_size=32, bits=bits)
    mx.eval(lin.parameters())
    nq = NativeQuantizedLinear(lin, head._q.kernels if hasattr(head._q,'kernels') else head._q._kernels, head._arena)
    print(bits, "bit 8960x1536 native: %.2f ms, %.1f GB/s" % rate(nq, 1536))
    print(bits, "bit 8960x1536 mx.quantized_matmul: %.2f ms, %.1f GB/s" % rate(lin, 1536))
print("head: %.2f ms, %.1f GB/s" % rate(head, 1536, 10))
o = model.model.layers[0].self_attn.o_proj
print(type(o).__name__, "o_proj: %.3f ms, %.1f GB/s" % rate(o, 1536, 100))

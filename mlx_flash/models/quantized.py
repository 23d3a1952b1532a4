"""Resident quantized weights (embeddings, attention, lm_head): held at their bits by MLX's
quantized modules, or dequantized once at load.

On the CPU MLX's quantized matmul has no BLAS behind it: measured here (scripts/bench_qmm.py) (MLX 0.32.4,
OpenBLAS, 2 cores, 4096 x 4096, 4-bit group 64) one token takes 14.7 ms against
6.4 ms in float32, and a 64-token prompt chunk 970 ms against 19 ms. Holding at 4
bits costs 1/8 of the DRAM; dequantizing is what a prompt-heavy CPU run wants.
"""

import mlx.core as mx
import mlx.nn as nn


def quantized_modules(model):
    return [(path, m) for path, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def dequantize_modules(model, dtype):
    """Swap every quantized Linear / Embedding for a float one holding the same values
    (scale * q + bias, at `dtype`): exact in float32."""
    swaps = []
    for path, m in quantized_modules(model):
        w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits).astype(dtype)
        if isinstance(m, nn.QuantizedLinear):
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            new.weight = w
            if "bias" in m:
                new.bias = m.bias.astype(dtype)
        else:
            new = nn.Embedding(w.shape[0], w.shape[1])
            new.weight = w
        mx.eval(new.parameters())
        swaps.append((path, new))
    if swaps:
        model.update_modules(_tree(swaps))
    return len(swaps)


def _tree(swaps):
    """[(dotted path, module)] -> the nested dict/list structure update_modules wants."""
    root = {}
    for path, module in swaps:
        parts = path.split(".")
        node = root
        for i, p in enumerate(parts[:-1]):
            nxt = parts[i + 1]
            key = int(p) if p.isdigit() else p
            if isinstance(node, list):
                while len(node) <= key:
                    node.append({})
                if not node[key]:
                    node[key] = [] if nxt.isdigit() else {}
                node = node[key]
            else:
                node = node.setdefault(key, [] if nxt.isdigit() else {})
        last = parts[-1]
        if isinstance(node, list):
            while len(node) <= int(last):
                node.append({})
            node[int(last)] = module
        else:
            node[last] = module
    return root

"""Resident quantized weights (embeddings, attention, lm_head; a dense model's FFN):
held at their bits, or dequantized once at load.

On the GPU MLX's quantized modules compute them. On the CPU MLX's own quantized
matmul has no BLAS behind it: measured here (benchmarks/cpu-kernels/bench_qmm.py; MLX 0.32.4,
OpenBLAS, 2 cores, 4096 x 4096, 4-bit group 64) one token takes ~15 ms against
~7 ms in float32, and a 64-token prompt chunk 970 ms against 19 ms. So on the
CPU the held modules are swapped for NativeQuantizedLinear / -Embedding
(use_native_kernels): one position (a decode token) goes through the native
matvec (kernels/_matvec.c: the packed words streamed once, ~1 ms for that matrix),
several positions (a prompt) are dequantized in row chunks into a float32 arena
and multiplied there by BLAS, as models/half.py does for 16-bit weights.
"""

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from ..kernels import QuantMatrix
from .half import ARENA_VALUES, Arena, head_product, native_product


def quantized_modules(model):
    return [(path, m) for path, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def native_modules(model):
    return [m for _, m in model.named_modules() if isinstance(m, _NativeQuantized)]


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


class _NativeQuantized(nn.Module):
    """A weight held at its bits, its QuantMatrix for the kernels, and the arena of prompts."""

    def __init__(self, m, kernels, arena):
        super().__init__()
        self.weight, self.scales, self.biases = m.weight, _held_scales(m.scales), _held_scales(m.biases)
        self.group_size, self.bits = m.group_size, m.bits
        self._q = QuantMatrix(kernels, self.weight, self.scales, self.biases, self.bits, self.group_size)
        self._arena = arena

    def _product(self, x, bias=None):
        return native_product(self._q, self._arena, x, bias)

    def _head_product(self, x, bias=None):
        """An lm_head's product (a tied one's too): models/half.py head_product, eager through
        the kernels or the arena, a prompt chunk's lazy."""
        return head_product(x, self._product, self._q.n, self._q.k, self._arena,
                            lambda i, j: self._values(self.weight[i:j], self.scales[i:j],
                                                      self.biases[i:j]).astype(x.dtype), bias)

    def _values(self, w, s, b):
        # float32 scales: s * q + b computed in float32, as the kernels do (MLX computes
        # in the scales' dtype, and a float16 result would round the values)
        return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=self.group_size,
                             bits=self.bits)


class StreamedQuantizedLinear(nn.Module):
    """A quantized Linear whose weight is not held: at every call it asks its store for the
    matrix (a view of rows the store read from flash this token: runtime/stores/attention.py)
    and multiplies by the native kernels, like NativeQuantizedLinear. Holds only its bias.
    The store and the prompts' arena are attached by the runtime (models never open files)."""

    def __init__(self, m, layer, name):
        super().__init__()
        self.layer, self.name = layer, name
        self.group_size, self.bits = m.group_size, m.bits
        self.n_out, self.n_in = m.weight.shape[0], m.weight.shape[1] * 32 // m.bits
        if "bias" in m:
            self.bias = m.bias
        self._store = self._arena = None

    def attach(self, store, arena):
        self._store, self._arena = store, arena

    def __call__(self, x):
        if self._store is None:
            raise RuntimeError(f"layer {self.layer} {self.name}: streamed weights without a store "
                               "(the model's runtime was closed)")
        q = self._store.matrix(self.layer, self.name)
        return native_product(q, self._arena, x, self.bias if "bias" in self else None)


def stream_modules(model, names):
    """Swap the quantized Linears `names` ({layer: [path in the block, "self_attn.q_proj"]}) of the
    transformer blocks for StreamedQuantizedLinear, before the weights load."""
    swaps = []
    for i, paths in names.items():
        block = model.layers[i]
        prefix = _path_of(model, block)
        found = dict(block.named_modules())
        for name in paths:
            m = found.get(name)
            if not isinstance(m, nn.QuantizedLinear):
                raise ValueError(f"layer {i}: {name} is not a quantized Linear of the model")
            swaps.append((f"{prefix}.{name}", StreamedQuantizedLinear(m, i, name)))
    if swaps:
        model.update_modules(_tree(swaps))


def streamed_modules(model):
    """{layer: {name: StreamedQuantizedLinear}} of a model stream_modules changed."""
    out = {}
    for _, m in model.named_modules():
        if isinstance(m, StreamedQuantizedLinear):
            out.setdefault(m.layer, {})[m.name] = m
    return dict(sorted(out.items()))


class StreamedEmbedding(nn.Module):
    """An input embedding whose table is not held: at every call it asks its store for the rows
    of the distinct token ids it is given (read from flash: runtime/stores/embedding.py), at
    the compute dtype as the held table would give them, and gathers them in the ids' order.
    Holds no weights; never a tied output head (as_linear multiplies by every row: the runtime
    streams only a table the head does not share). The store is attached by the runtime."""

    def __init__(self, n_rows, dims):
        super().__init__()
        self.n_rows, self.dims = n_rows, dims
        self._store = None

    def attach(self, store, arena=None):  # (StreamedQuantizedLinear's call: no arena here)
        self._store = store

    def __call__(self, x):
        if self._store is None:
            raise RuntimeError("the input embedding is read from flash without a store (the model's runtime "
                               "was closed)")
        ids = np.asarray(x).astype(np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_rows):
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise ValueError(f"token id {bad} is outside the embedding table's {self.n_rows} rows")
        distinct, where = np.unique(ids, return_inverse=True)
        rows = self._store.rows(distinct)
        return rows[mx.array(where.reshape(-1).astype(np.int32))].reshape(*x.shape, self.dims)


def stream_embedding(model, path, n_rows, dims):
    """Swap the model's input embedding (its path, "model.embed_tokens") for a StreamedEmbedding,
    before the weights load."""
    m = dict(model.named_modules()).get(path)
    if not isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
        raise ValueError(f"{path} is not an embedding of the model")
    model.update_modules(_tree([(path, StreamedEmbedding(n_rows, dims))]))


def streamed_embedding(model):
    """The StreamedEmbedding of a model stream_embedding changed, or None."""
    return next((m for _, m in model.named_modules() if isinstance(m, StreamedEmbedding)), None)


class StreamedHead(nn.Module):
    """An output head (an untied, quantized lm_head) whose weight is not held: each pass asks its
    store for the products with every row (read from flash chunk by chunk and multiplied by the
    native kernels: runtime/stores/head.py). Eager, like the held head's decode step. `last_only`
    (set by generate for mlx_lm's loop, which keeps a prompt chunk's last logits alone): a pass of
    more than kernels.SMALL_PASS positions multiplies its last position only, and its logits are
    that position's ([..., 1, vocabulary]). The store is attached by the runtime."""

    def __init__(self, n_rows, dims):
        super().__init__()
        self.n_rows, self.dims = n_rows, dims
        self.last_only = False
        self._store = None

    def attach(self, store, arena=None):  # (StreamedQuantizedLinear's call: no arena here)
        self._store = store

    def __call__(self, x):
        from ..kernels import SMALL_PASS, host_f32

        if self._store is None:
            raise RuntimeError("the output head is read from flash without a store (the model's runtime was "
                               "closed)")
        if self.last_only and x.ndim == 3 and x.shape[1] > SMALL_PASS:
            x = x[:, -1:, :]
        out = self._store.products(host_f32(x).reshape(-1, self.dims))
        return mx.array(out).reshape(*x.shape[:-1], self.n_rows).astype(x.dtype)


def stream_head(model, n_rows, dims):
    """Swap the model's lm_head for a StreamedHead, before the weights load."""
    if not isinstance(dict(model.named_modules()).get("lm_head"), (nn.Linear, nn.QuantizedLinear)):
        raise ValueError("the model has no lm_head of its own (a tied output head stays whole)")
    model.update_modules(_tree([("lm_head", StreamedHead(n_rows, dims))]))


def streamed_head(model):
    """The StreamedHead of a model stream_head changed, or None."""
    return next((m for _, m in model.named_modules() if isinstance(m, StreamedHead)), None)


def _path_of(model, block):
    for path, m in model.named_modules():
        if m is block:
            return path
    raise ValueError("block not in the model")


class NativeQuantizedLinear(_NativeQuantized):
    """nn.QuantizedLinear computed by the native kernels (same values, float32 sums)."""

    def __init__(self, m, kernels, arena, head=False):
        super().__init__(m, kernels, arena)
        if "bias" in m:
            self.bias = m.bias
        self._head = head  # the lm_head: a prompt chunk's product is lazy (_head_product)

    def __call__(self, x):
        bias = self.bias if "bias" in self else None
        return self._head_product(x, bias) if self._head else self._product(x, bias)


class NativeQuantizedEmbedding(_NativeQuantized):
    """nn.QuantizedEmbedding: lookups dequantize their rows; as_linear (a tied lm_head) goes
    through the kernels for one position."""

    def __init__(self, m, kernels, arena, dtype):
        super().__init__(m, kernels, arena)
        self._dtype = dtype

    def __call__(self, x):
        return self._values(self.weight[x], self.scales[x], self.biases[x]).astype(self._dtype)

    def as_linear(self, x):
        return self._head_product(x)



def _held_scales(a):
    """Scales / biases at float16 when that holds them exactly (the loader widened a
    float16 model's to float32 for MLX's modules): half their DRAM, the same values."""
    if a.dtype == mx.float32:
        h = a.astype(mx.float16)
        if mx.array_equal(h.astype(mx.float32), a).item():
            return h
    return a


def use_native_kernels(model, kernels, dtype=mx.float32):
    """Swap every quantized Linear / Embedding of `model` for its native-kernel version
    (CPU). -> the arena they share (None if there was nothing to swap)."""
    found = quantized_modules(model)
    if not found:
        return None
    arena = Arena(arena_values([(m.weight.shape[0], m.weight.shape[1] * 32 // m.bits) for _, m in found]))
    swaps = [(path, NativeQuantizedLinear(m, kernels, arena, head=path == "lm_head")  # (the untied output head)
              if isinstance(m, nn.QuantizedLinear) else NativeQuantizedEmbedding(m, kernels, arena, dtype))
             for path, m in found]
    model.update_modules(_tree(swaps))
    mx.eval(model.parameters())
    return arena


QUANT_ARENA_VALUES = 3 * ARENA_VALUES  # a prompt chunk's gate, up and down rows side by side (FlashFFN)


def arena_values(shapes):
    """The float32 values of the arena use_native_kernels makes for quantized weights of these
    [out, in] shapes: QUANT_ARENA_VALUES (12 MiB: also where a prompt chunk's packed FFN rows
    are dequantized, three kinds of ARENA_VALUES: against fresh buffers 84 against 116 ms a 7B
    layer at 8 positions, 118 against 158 at 32), or the largest weight when smaller (at least
    a row)."""
    return max(max(k for _, k in shapes), min(QUANT_ARENA_VALUES, max(n * k for n, k in shapes)))


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

"""Weights held in DRAM at 16 bits, computed on at float32.

On the CPU only float32 matmuls use BLAS (MLX's CPU backend: float16 / bfloat16 / 4- and
8-bit matmuls run at ~1 GB/s, MLX's own float16 -> float32 `astype` at 1.4 GB/s).
A model converted at float16 can still be held at float16, half the DRAM of
float32, and stay exact:
- a decode step (up to kernels.SMALL_PASS positions) multiplies the 16-bit rows
  as they are: the native kernels' gather_mv converts each value in registers
  (F16C / a shift) and sums as over the float32 rows (kernels/_matvec.c). Float16
  SmolLM2 held at float16 decodes in 35.9 ms a token here, against 62.1 through
  the arena below and 57.7 held at float32 (benchmarks/float16-weights/);
- a batch's decode step (more than SMALL_PASS sequences, one position each) goes
  through the pass kernels' tiles (gather_mm): each 16-bit row converted once into
  a small float32 tile and multiplied into every sequence's position. A step of 16
  sequences over a 16,384 x 4,096 float16 matrix: 16 ms here, against 49-104 ms
  through the arena below and BLAS (benchmarks/batch/tiles/kernel16.py);
- a prompt, or a CPU without the kernels: just before a weight is used, a chunk
  of its rows is converted (F16C, in C, ~15 GB/s of float32 out here) into a small
  float32 arena and multiplied there by BLAS while the chunk is still in the CPU's
  caches.

The arena is one preallocated MLX float32 array written through a NumPy view,
like the neuron caches. Each use evaluates its input first (which finishes
every earlier computation that read the arena: they are its ancestors), fills
the arena, and evaluates its own result before the next chunk overwrites it.
So a HalfLinear is eager where nn.Linear is lazy: an eval per chunk (~100 us on
MLX's CPU stream).
"""

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..io.native import native_convert
from ..kernels import SMALL_PASS, gather_mm, host_f32, pass_kernels

HELD_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}
_CODES = {mx.float16: 1, mx.bfloat16: 2}  # the native converter's dtype codes
ARENA_VALUES = 1 << 20  # float32 values of one chunk (4 MiB: lm_head 19 ms per token; 1 MiB 30, 8 MiB 17)


class Arena:
    """A float32 scratch that 16-bit weights are converted into just before use."""

    def __init__(self, values=ARENA_VALUES):
        self.convert = native_convert()
        self.values = values
        self.array = mx.zeros((values,), dtype=mx.float32)
        mx.eval(self.array)
        self.view = np.array(self.array, copy=False)
        assert self.view.flags.writeable

    @property
    def nbytes(self):
        return self.array.nbytes

    def fill_rows(self, matrices, code=1):
        """{kind: 16-bit numpy [n, d]} -> {kind: MLX float32 [n, d]}, side by side in the arena.

        The caller evaluated its input first, and its result reads these rows:
        nothing converted here may be overwritten before that result is evaluated."""
        return self.views(self.put(matrices, code))

    def put(self, matrices, code=1):
        """The conversion half of fill_rows: NumPy and C only, so a worker thread may run it
        (while the main thread computes on another arena); -> the layout for views().
        code: the converter's source dtype (1 float16, 2 bfloat16 as uint16)."""
        layout, off = [], 0
        for k, m in matrices.items():
            self.convert(m, code, self.view[off:], 0, m.size)
            layout.append((k, off, m.shape))
            off += m.size
        return layout

    def views(self, layout):
        """MLX float32 views of what put() converted (main thread)."""
        return {k: self.array[off : off + shape[0] * shape[1]].reshape(shape) for k, off, shape in layout}


def _uint16_view(w):
    mx.eval(w)
    return np.array(w.view(mx.uint16), copy=False)


def chunked_matmul(x, n_out, d, fill, arena, bias=None):
    """x @ W.T for a weight W [n_out, d] that fill(start, stop, out) writes, rows start ..
    stop-1 as float32, into the NumPy buffer `out`: in row chunks through the arena; eager."""
    mx.eval(x)
    step = max(1, arena.values // d)
    parts = []
    for start in range(0, n_out, step):
        stop = min(n_out, start + step)
        size = (stop - start) * d
        fill(start, stop, arena.view[:size])
        y = x @ arena.array[:size].reshape(stop - start, d).T
        if bias is not None:
            y = y + bias[start:stop]
        mx.eval(y)
        parts.append(y)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def head_product(x, eager, n, k, arena, rows, bias=None):
    """An lm_head's x @ W.T (+ bias), W [n, k]: a decode step (a batch's too) or a verify pass (up
    to SMALL_PASS positions a sequence) eager(x, bias); a prompt chunk's lazily, rows i .. j-1 as
    rows(i, j) gives them (MLX arrays at x's dtype) an arena's worth at a time, so that a caller
    that drops these logits (mlx_lm's prefill keeps only the KV cache) never computes them nor
    holds [positions, n] floats. (MLX converts each chunk itself: slower than the arena, which
    must be used eagerly.)"""
    if x.ndim == 1 or x.shape[-2] <= SMALL_PASS:
        return eager(x, bias)
    step = max(1, arena.values // k)
    y = mx.concatenate([x @ rows(i, min(i + step, n)).T for i in range(0, n, step)], axis=-1)
    return y if bias is None else y + bias


def native_product(q, arena, x, bias=None):
    """x @ W.T (+ bias) of a matrix the kernels multiply (a QuantMatrix, a 16-bit _Held: its n,
    k, matvec(v, out) and dequantize(start, stop, out)): the native matvec for each position of
    a pass of up to kernels.SMALL_PASS positions; a batch's decode step or a prompt's chunk through
    W's matmul where it has one and kernels.pass_kernels takes x (each row dequantized once for
    every position); else dequantized chunks + BLAS. Eager: W's memory is not read once this returns."""
    positions = x.size // x.shape[-1]
    if positions > SMALL_PASS and not (hasattr(q, "matmul") and pass_kernels(q.kernels, x)):
        return chunked_matmul(x, q.n, q.k, q.dequantize, arena, bias)
    v = host_f32(x).reshape(positions, q.k)
    if positions > SMALL_PASS:
        out = q.matmul(v)
    else:
        out = np.empty((positions, q.n), dtype=np.float32)
        for i in range(positions):
            q.matvec(v[i], out[i])
    y = mx.array(out).reshape(*x.shape[:-1], q.n).astype(x.dtype)
    return y if bias is None else y + bias


class _Held(nn.Module):
    """A 16-bit weight, its uint16 view for the converter, and the arena it is used through;
    with the native kernels (CPU, float32 compute), a pass of up to kernels.SMALL_PASS positions
    multiplies the 16-bit rows directly (gather_mv over all rows), converting them in registers,
    and a batch's decode step the pass kernels take through their tiles (gather_mm)."""

    def __init__(self, weight, arena, kernels=None, head=False):
        super().__init__()
        self.weight = weight
        self._head = head  # the lm_head: a prompt's pass is lazy (_matmul)
        self._arena = arena
        self._rows16 = _uint16_view(weight)
        self._code = _CODES[weight.dtype]
        self._kernels = kernels
        self.n, self.k = self._rows16.shape
        self._all = np.arange(self.n, dtype=np.int64)  # (the kernel's rows: all of them)

    def dequantize(self, start, stop, out):
        """Rows start .. stop-1 as float32 into `out` (native_product's name for it)."""
        self._arena.convert(self._rows16[start:stop], self._code, out, 0, out.size)

    @property
    def kernels(self):
        return self._kernels

    def matvec(self, v, out):
        self._kernels.gather_mv(v, self._rows16, self._all, out, self.k, False, self._code)

    def matmul(self, v):
        """A batch's decode step, v [positions, k] -> [positions, n]: each 16-bit row converted
        once, into the pass kernels' tile, for every position (native_product's, where
        kernels.pass_kernels takes the step)."""
        return gather_mm(self._kernels, v, self._rows16, self._all, self._code)  # (uint16 bits: its code)

    def _matmul(self, x, bias=None):
        if self._head:
            return head_product(x, self._product, self.n, self.k, self._arena,
                                lambda i, j: self.weight[i:j].astype(x.dtype), bias)
        return self._product(x, bias)

    def _product(self, x, bias=None):
        """Eager: the kernels' matvec for a pass of up to SMALL_PASS positions, their tiles for
        a batch's decode step they take (matmul), else the arena."""
        if self._kernels is None:
            return chunked_matmul(x, self.n, self.k, self.dequantize, self._arena, bias)
        return native_product(self, self._arena, x, bias)


class HalfLinear(_Held):
    """nn.Linear whose weight stays at 16 bits in DRAM (exact: float16 -> float32 is lossless)."""

    def __init__(self, weight, bias, arena, kernels=None, head=False):
        super().__init__(weight, arena, kernels, head)
        if bias is not None:
            self.bias = bias

    def __call__(self, x):
        return self._matmul(x, self.bias if "bias" in self else None)


class HalfEmbedding(_Held):
    """nn.Embedding at 16 bits: lookups convert their rows; as_linear (a tied lm_head) is a
    HalfLinear lm_head's product: a decode step's eager, a prompt chunk's lazy."""

    def __init__(self, weight, arena, dtype=mx.float32, kernels=None):
        super().__init__(weight, arena, kernels, head=True)
        self._dtype = dtype

    def __call__(self, x):
        return self.weight[x].astype(self._dtype)

    def as_linear(self, x):
        return self._matmul(x)


def _is_head(model, parent, key):
    """The model's own lm_head (an untied output head: a prompt's pass computed lazily)."""
    return parent is model and key[0] == "lm_head"


def hold_at_16_bits(model, held, compute, skip=(), kernels=None):
    """Swap every nn.Linear / nn.Embedding of `model` (outside modules of the types
    `skip`) for its 16-bit held version; every other parameter goes to `compute`.
    kernels: the native module (CPU, float32 compute), whose gather_mv then multiplies a
    decode step's 16-bit rows directly (gather_mm a batch's step). Returns the arena they
    share: ARENA_VALUES, or the largest weight if smaller.

    The weights must already be at `held` (the flash dtype): nothing is rounded here."""
    found = []  # (parent, (name, index in a list or None), module)

    def walk(module):
        for name, child in module.children().items():
            for i, c in enumerate(child if isinstance(child, list) else [child]):
                if not isinstance(c, nn.Module) or isinstance(c, skip):
                    continue
                key = (name, i if isinstance(child, list) else None)
                if isinstance(c, (nn.Linear, nn.Embedding)) and c.weight.dtype == held:
                    found.append((module, key, c))
                else:
                    walk(c)

    walk(model)
    weights = [c.weight for _, _, c in found] or [mx.zeros((1, 1))]
    arena = Arena(max(max(w.shape[1] for w in weights), min(ARENA_VALUES, max(w.size for w in weights))))
    swaps = [(parent, key, HalfLinear(c.weight, c.get("bias"), arena, kernels, head=_is_head(model, parent, key))
              if isinstance(c, nn.Linear) else HalfEmbedding(c.weight, arena, compute, kernels))
             for parent, key, c in found]
    for parent, (name, i), new in swaps:
        if "bias" in new:
            new.bias = new.bias.astype(compute)
        if i is None:
            setattr(parent, name, new)
        else:
            parent[name][i] = new
    # norms, biases, scales, anything not swapped: the compute dtype (packed quantized words stay)
    held_ids = {id(new.weight) for _, _, new in swaps}
    params = tree_flatten(model.parameters())
    model.update(tree_unflatten(
        [(k, v if id(v) in held_ids or v.dtype == compute or not mx.issubdtype(v.dtype, mx.floating)
          else v.astype(compute)) for k, v in params]))
    mx.eval(model.parameters())
    return arena

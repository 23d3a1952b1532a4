"""One decode position of a Llama-family block on the host (NumPy), between the native kernels.

On the CPU a decode step's products already run in the native kernels over NumPy views; what
is left between them (two RMS norms, the rotary embedding of q and k, attention over the KV
cache, the residual adds) is a few thousand values a layer. Through MLX each of those small
operations costs ~13 us of scheduling on a 2-core VM (the rotary embedding ~190 us, an RMS
norm ~80, attention ~180: their CPU forms are compositions of small operations), ~40 ms of a
1.5B model's 28-layer token; in NumPy they cost a few microseconds each. The values are the
same float32 formulas: x * rsqrt(mean(x^2) + eps) * w, the rotation each rope module defines
(read from the module itself, below), softmax(q k^T * scale) v.

Used only for one position of one sequence on the CPU at float32 with a cache that appends
one key at a time (mlx_lm's KVCache or RotatingKVCache, updated through its own
update_and_fetch); anything else (prompts, batches, the KV cache on flash, the GPU) takes the
MLX path. `HOST_STEP = False` turns it off (tests compare the two paths).
"""

from contextlib import contextmanager

import numpy as np

import mlx.core as mx

from .. import kernels as _kernels

HOST_STEP = True
# A pass of several positions (a prompt's chunk) on the CPU at float32 computes its FFN activation
# and a causal attention's softmax in NumPy between MLX's products (ffn.FlashFFN._activated,
# attention.host_causal_attention): MLX's CPU exp is ~8x slower. NumPy is outside MLX's graph:
# whoever differentiates the model turns this off (mlx_only()).
PASSES = True
HOST_CACHES = ("KVCache", "RotatingKVCache")  # caches whose update_and_fetch returns arrays of every key


@contextmanager
def mlx_only():
    """Every operation through MLX (no NumPy between the products, no host step) while the block
    runs: for a caller that differentiates the model (mx.vjp, mx.grad), which sees only MLX's graph."""
    global HOST_STEP, PASSES
    saved = HOST_STEP, PASSES
    HOST_STEP = PASSES = False
    try:
        yield
    finally:
        HOST_STEP, PASSES = saved


def eligible(model, inputs, cache, input_embeddings=None, one_rope=True):
    """Whether `model` (a LlamaModel, or another whose layers have a host_step) may take this call
    on the host. one_rope: every layer's attention has the same rotary settings (rope_of)."""
    if not HOST_STEP or mx.default_device() != mx.cpu or cache is None or cache[0] is None:
        return False
    shape = input_embeddings.shape[:2] if input_embeddings is not None else inputs.shape
    if tuple(shape) != (1, 1):
        return False
    if any(type(c).__name__ not in HOST_CACHES for c in cache):
        return False
    if any(not hasattr(layer, "host_step") for layer in model.layers):
        return False
    return rope_of(model) is not None if one_rope else all(
        _rope_dims(layer.self_attn.rope) is not None for layer in model.layers)


def rope_of(model):
    """The one rope module every layer's attention shares the settings of (checked once), or None."""
    found = getattr(model, "_host_rope", False)
    if found is not False:
        return found
    ropes = [getattr(getattr(layer, "self_attn", None), "rope", None) for layer in model.layers]
    first = ropes[0]
    ok = first is not None and _rope_dims(first) is not None and all(_same_rope(first, r) for r in ropes[1:])
    model._host_rope = first if ok else None
    return model._host_rope


def _rope_dims(rope):
    return getattr(rope, "dims", getattr(rope, "dim", None))


def _same_rope(a, b):
    if type(a) is not type(b):
        return False
    va, vb = vars(a), vars(b)
    if va.keys() != vb.keys():
        return False
    for k, x in va.items():
        y = vb[k]
        if isinstance(x, mx.array):
            if not isinstance(y, mx.array) or x.shape != y.shape or not mx.array_equal(x, y).item():
                return False
        elif isinstance(x, (int, float, str, bool, type(None))) and x != y:
            return False
    return True


class Rotation:
    """The rotary embedding of one position as y = x * a + x[..., partner] * b, read from the rope
    module itself (any of mlx_lm's: its frequencies, scalings and pass-through dimensions): the
    module applied to two basis vectors gives, for each dimension, the coefficient of its own
    value and of its pair's. One MLX call a token, shared by every layer."""

    def __init__(self, rope, head_dim, offset):
        dims = _rope_dims(rope)
        half = dims // 2
        first = np.arange(0, dims, 2) if getattr(rope, "traditional", False) else np.arange(half)
        second = first + 1 if getattr(rope, "traditional", False) else first + half
        e = np.zeros((1, 2, 1, head_dim), np.float32)
        e[0, 0, 0, first] = 1
        e[0, 0, 0, dims:] = 1  # dimensions past `dims` pass through
        e[0, 1, 0, second] = 1
        out = np.array(rope(mx.array(e), offset=offset)[0, :, 0].astype(mx.float32))
        a, b = out[0].copy(), np.zeros(head_dim, np.float32)
        a[second] = out[1, second]
        b[first], b[second] = out[1, first], out[0, second]
        partner = np.arange(head_dim)
        partner[first], partner[second] = second, first
        self.a, self.b, self.partner = a, b, partner

    def __call__(self, x):
        """x [heads, head_dim] float32 -> rotated."""
        return x * self.a + x[:, self.partner] * self.b


def rms_norm(x, norm):
    """An RMS norm module's value of a float32 vector (or rows): scaled by `norm.host_scale()` where
    the module has one (Gemma's 1 + w), else by its weight."""
    w = norm.host_scale() if hasattr(norm, "host_scale") else np.array(norm.weight, copy=False)
    return x * (1 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + norm.eps)) * w


def product(module, v):
    """module(v) of one position's float32 vector v [K] -> [N] float32: the native kernels' matvec
    where the module has one (held at its bits, streamed from flash, held at 16 bits), else the
    module through MLX."""
    q = _matrix(module)
    if q is None:
        out = module(mx.array(v)[None])
        return _kernels.host_f32(out)
    y = np.empty(q.n, np.float32)
    q.matvec(v, y)
    if "bias" in module:
        y += np.array(module.bias, copy=False)
    return y


def _matrix(module):
    from .half import _Held
    from .quantized import NativeQuantizedLinear, StreamedQuantizedLinear

    if isinstance(module, NativeQuantizedLinear) and not module._head:
        return module._q
    if isinstance(module, StreamedQuantizedLinear) and module._store is not None:
        return module._store.matrix(module.layer, module.name)
    if isinstance(module, _Held) and module.kernels is not None and not module._head:
        return module
    return None


def attention(q, keys, values, scale, softcap=None):
    """softmax(q k^T * scale) v for one position: q [heads, D]; keys, values [kv heads, T, D]
    (NumPy views of the cache) -> [heads * D]. softcap c: the scores s as tanh(s / c) * c first
    (Gemma 2)."""
    hkv, d = keys.shape[0], q.shape[-1]
    qg = (q * scale).reshape(hkv, -1, d)
    s = np.matmul(qg, keys.transpose(0, 2, 1))
    if softcap is not None:
        s = np.tanh(s / np.float32(softcap)) * np.float32(softcap)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, values).reshape(-1)

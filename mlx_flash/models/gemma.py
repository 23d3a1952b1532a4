"""Gemma family: Gemma 2 and Gemma 3 text models (gemma2, gemma3_text).

As mlx_lm's gemma2.py / gemma3_text.py (and Hugging Face transformers), with the FFN read
from the flash layout:

- RMS norms scale by (1 + weight) (the checkpoints store weight - 1), four a block: before
  and after attention, before and after the FFN;
- GeGLU FFN (tanh-approximated GELU of the gate times up), as the Llama family's SwiGLU;
- the input embeddings scaled by sqrt(hidden_size) (Gemma 3: that factor rounded to
  bfloat16, as mlx_lm and transformers' bfloat16 checkpoints do), the output head tied;
- attention scaled by query_pre_attn_scalar^-1/2, not head_dim^-1/2; Gemma 3: per-head
  q/k norms and two rotary bases, rope_local_base_freq on sliding layers and rope_theta
  (with rope_scaling) on global ones; Gemma 2: scores soft-capped (tanh(s / c) * c) and the
  logits too;
- sliding-window layers: Gemma 3 every layer but each sliding_window_pattern-th, Gemma 2
  every other one (or `layer_types` where config.json lists them). A sliding layer attends
  to the last `sliding_window` positions: mlx_lm's RotatingKVCache where this model makes its
  caches, a windowed mask over a full cache where a memory plan makes them. mlx_lm's Gemma 2
  ignores the window (its logits differ past 4,096 positions); this one keeps it, as
  transformers does.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import FlashError
from ..kernels import host_f32
from . import host
from .attention import attend
from .ffn import FlashFFN, activation
from .llama import ffn_kinds, ffn_tensors  # noqa: F401  (the converter asks this module for them)

MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")  # (gemma3: the multimodal checkpoints' text model)
DEFAULT = "default"  # a soft-capping config.json does not give (null there means none)
# transformers' Gemma3TextConfig defaults (a multimodal config's text_config lists only the others)
GEMMA3_TEXT = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=4096,
                   max_position_embeddings=131_072, rms_norm_eps=1e-6)
# what a multimodal checkpoint holds besides its text model, and where it keeps that model
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."))


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    head_dim: int = 256
    num_key_value_heads: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_local_base_freq: Optional[float] = None
    rope_scaling: Optional[Dict] = None
    query_pre_attn_scalar: Optional[float] = None
    sliding_window: Optional[int] = None
    sliding_window_pattern: Optional[int] = None
    layer_types: Optional[List[str]] = None
    attn_logit_softcapping: Optional[float] = DEFAULT
    final_logit_softcapping: Optional[float] = DEFAULT
    max_position_embeddings: int = 8192
    hidden_activation: Optional[str] = None
    hidden_act: Optional[str] = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, params):
        if params.get("model_type") == "gemma3":
            params = source_config(params)
        elif params.get("model_type") == "gemma3_text":
            params = {**GEMMA3_TEXT, **params}
        return super().from_dict(params)

    def __post_init__(self):
        gemma2 = self.model_type == "gemma2"
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = self.head_dim
        if self.sliding_window is None:
            self.sliding_window = 4096
        if self.rope_local_base_freq is None:
            self.rope_local_base_freq = self.rope_theta if gemma2 else 10000.0
        if self.attn_logit_softcapping == DEFAULT:  # (transformers' defaults: Gemma 2 caps, Gemma 3 not)
            self.attn_logit_softcapping = 50.0 if gemma2 else None
        if self.final_logit_softcapping == DEFAULT:
            self.final_logit_softcapping = 30.0 if gemma2 else None
        self.act = self.hidden_activation or self.hidden_act or "gelu_pytorch_tanh"
        if self.layer_types is None:
            if gemma2:
                self.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                    for i in range(self.num_hidden_layers)]
            else:
                n = self.sliding_window_pattern or 6
                self.layer_types = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                                    for i in range(self.num_hidden_layers)]
        self.embed_scale = self.hidden_size**0.5
        if not gemma2:  # Gemma 3's scale is a bfloat16 number (mlx_lm; transformers in bfloat16)
            self.embed_scale = mx.array(self.embed_scale, mx.bfloat16).item()


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight)."""

    def __init__(self, dims, eps):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)

    def host_scale(self):
        """1 + weight as float32 NumPy for the host step (models/host.py), made once per weight array
        (kept outside the module's parameters)."""
        held = self.__dict__.get("_host_scale")
        if held is None or held[0] is not self.weight:
            held = self.__dict__["_host_scale"] = (self.weight, np.array(self.weight, copy=False) + np.float32(1))
        return held[1]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        self.softcap = args.attn_logit_softcapping
        self.sliding = args.layer_types[layer] == "sliding_attention"
        self.window = args.sliding_window if self.sliding else None
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias)
        if args.model_type == "gemma3_text":
            self.q_norm = RMSNorm(head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, args.rms_norm_eps)
        if self.sliding:
            self.rope = initialize_rope(head_dim, args.rope_local_base_freq, False)
        else:
            self.rope = initialize_rope(head_dim, args.rope_theta, False, args.rope_scaling,
                                        args.max_position_embeddings)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None and hasattr(cache, "parts"):
            if self.softcap is not None or (self.window is not None and offset + L > self.window):
                raise FlashError("the KV cache on flash does not take Gemma's soft-capped or sliding-window "
                                 "attention past its window yet; run without --kv-cache flash")
        if self.softcap is None:
            out = attend(q, k, v, cache, self.scale, mask)
        else:
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
            out = _softcapped(q, k, v, self.scale, self.softcap, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def host_step(self, x, cache, rotation):
        """__call__ for one position on the host (models/host.py): x [dim] float32 -> [dim]."""
        q, k, v = (host.product(p, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q.reshape(self.n_heads, -1), k.reshape(self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = host.rms_norm(q, self.q_norm), host.rms_norm(k, self.k_norm)
        q, k = rotation(q), rotation(k)
        keys, values = cache.update_and_fetch(mx.array(k.reshape(1, self.n_kv_heads, 1, -1)),
                                             mx.array(v.reshape(1, self.n_kv_heads, 1, -1)))
        mx.eval(keys, values)
        keys, values = np.array(keys, copy=False)[0], np.array(values, copy=False)[0]
        if self.window is not None:  # (a rotating cache holds no more; a plan's full cache does)
            keys, values = keys[:, -self.window:], values[:, -self.window:]
        out = host.attention(q, keys, values, self.scale, self.softcap)
        return host.product(self.o_proj, out)


def _softcapped(q, k, v, scale, cap, mask):
    """Gemma 2's attention: softmax(tanh(q k^T * scale / cap) * cap + mask) v, as mlx_lm's."""
    B, H, L, D = q.shape
    hkv = k.shape[1]
    q = (q * scale).reshape(B, hkv, H // hkv, L, D)
    s = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    s = mx.tanh(s / cap) * cap
    if isinstance(mask, str):  # "causal"
        mask = mx.arange(k.shape[2] - L, k.shape[2])[:, None] >= mx.arange(k.shape[2])[None]
    if mask is not None:
        s = mx.where(mask, s, mx.array(mx.finfo(s.dtype).min, s.dtype)) if mask.dtype == mx.bool_ else s + mask
    p = mx.softmax(s, axis=-1, precise=True)
    return (p @ mx.expand_dims(v, 2)).reshape(B, H, L, -1)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = FlashFFN(layer, args.hidden_size, args.intermediate_size, activation(args.act), gated=True)
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def host_step(self, x, cache, rotation):
        """__call__ for one position on the host: x [dim] float32 -> [dim]."""
        r = self.self_attn.host_step(host.rms_norm(x, self.input_layernorm), cache, rotation)
        h = x + host.rms_norm(r, self.post_attention_layernorm)
        r = self.mlp.host_step(host.rms_norm(h, self.pre_feedforward_layernorm))
        return h + host.rms_norm(r, self.post_feedforward_layernorm)


class GemmaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        h = h * mx.array(self.args.embed_scale, h.dtype)
        if h.dtype == mx.float32 and host.eligible(self, inputs, cache, input_embeddings, one_rope=False):
            return self._host_step(h, cache)
        if cache is None:
            cache = [None] * len(self.layers)
        masks = {}
        for layer, c in zip(self.layers, cache):
            window = layer.self_attn.window
            if window not in masks:  # (each kind's mask from its first layer's cache, as mlx_lm)
                masks[window] = create_attention_mask(h, c, window_size=window)
            h = layer(h, masks[window], c)
        return self.norm(h)

    def _host_step(self, h, cache):
        """One position of one sequence on the host (models/host.py): the loop above's values
        without MLX's per-operation cost between the native products. Sliding and global layers
        rotate by their own bases: one Rotation of each a token."""
        x = host_f32(h)
        rotations = {}
        for layer, c in zip(self.layers, cache):
            attn = layer.self_attn
            key = (attn.sliding, c.offset)
            if key not in rotations:
                rotations[key] = host.Rotation(attn.rope, attn.head_dim, c.offset)
            x = layer.host_step(x, c, rotations[key])
        return mx.array(host.rms_norm(x, self.norm)).reshape(1, 1, -1)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GemmaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        out = self.model(inputs, cache, input_embeddings)
        out = self.lm_head(out) if "lm_head" in self else self.model.embed_tokens.as_linear(out)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            out = mx.tanh(out / cap) * cap
        return out

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        """mlx_lm's caches: a rotating one of the window's size for each sliding layer."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        return [RotatingKVCache(max_size=layer.self_attn.window) if layer.self_attn.sliding else KVCache()
                for layer in self.layers]


# --- how a Hugging Face checkpoint maps onto this model (used by the converter): the FFN's tensors
# are named as the Llama family's


def source_config(config):
    """A Gemma 3 multimodal config.json (`gemma3`) -> its text model's (`gemma3_text`: what a
    converted folder holds, the vision tower dropped), transformers' defaults filled in; any
    other config -> None (kept as it is)."""
    if config.get("model_type") != "gemma3":
        return None
    text = config.get("text_config") or {}
    vocab = text.get("vocab_size") or config.get("vocab_size") or GEMMA3_TEXT["vocab_size"]
    tokens = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    return {**GEMMA3_TEXT, **tokens, **text, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "vocab_size": vocab, "tie_word_embeddings": config.get("tie_word_embeddings", True)}


def source_name(args: ModelArgs, hf_name: str):
    """A multimodal checkpoint's text tensors (language_model.model.N..., or transformers 5's
    model.language_model.N...) -> the text model's names."""
    for old, new in TEXT_PREFIXES:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return hf_name


def resident_name(args: ModelArgs, hf_name: str):
    """HF tensor name -> this model's parameter name, or None to drop it (the vision tower)."""
    if (hf_name == "lm_head.weight" and args.tie_word_embeddings) or hf_name.startswith(VISION):
        return None
    return hf_name


def check_supported(args: ModelArgs):
    activation(args.act)
    if len(args.layer_types) != args.num_hidden_layers or not set(args.layer_types) <= {
            "sliding_attention", "full_attention"}:
        raise FlashError(f"{args.model_type}: config.json's layer_types should list 'sliding_attention' or "
                         f"'full_attention' for each of the {args.num_hidden_layers} layers")

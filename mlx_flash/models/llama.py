"""Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2, Phi-3 / Phi-4
(q/k/v and gate/up fused in the checkpoint, split at conversion: fused_tensors; partial and
LongRoPE rotary embeddings), Granite (its embedding, residual, attention and logits multipliers).

Attention follows mlx_lm's llama.py so that, with every FFN row in DRAM, the
logits match mlx_lm. Unlike mlx_lm, the FFN honours `hidden_act` (silu, relu,
relu2, fatrelu), so ReLU-fied Llamas run as trained.
"""

import re
from dataclasses import dataclass
from typing import Dict, Optional, Union

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

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm2", "phi3", "granite")
FFN_KINDS = ("gate", "up", "down")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"
    fatrelu_threshold: Optional[float] = None
    partial_rotary_factor: float = 1.0  # (Phi-3 / Phi-4: the rotated share of each head)
    original_max_position_embeddings: Optional[int] = None  # (Phi-3's LongRoPE)
    embedding_multiplier: float = 1.0  # Granite's four multipliers
    attention_multiplier: Optional[float] = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    sliding_window: Optional[int] = None  # Mistral v0.1, Phi-3: every layer attends to the last N positions
    use_sliding_window: bool = False  # (Qwen2 / Qwen3: their window applies only where this is true)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        # Qwen2 always has q/k/v biases (its config does not say so).
        self.qkv_bias = self.attention_bias or self.model_type == "qwen2"
        # transformers applies a window for Mistral and Phi-3 where config.json gives one (mlx_lm never)
        self.window = self.sliding_window if self.model_type in ("mistral", "phi3") else None
        self.qk_norm = self.model_type == "qwen3"


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim or dim // n_heads
        self.scale = head_dim**-0.5 if args.attention_multiplier is None else args.attention_multiplier
        self.window = args.window
        bias = args.qkv_bias
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=args.attention_bias)
        # qk_norm: True (Qwen3: per head) or "full" (OLMoE: over the whole projection, before the split)
        self.qk_norm_full = args.qk_norm == "full"
        if args.qk_norm:
            q_dim, k_dim = (n_heads * head_dim, n_kv_heads * head_dim) if self.qk_norm_full else (head_dim, head_dim)
            self.q_norm = nn.RMSNorm(q_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(k_dim, eps=args.rms_norm_eps)
        if args.model_type == "phi3":
            self.rope = phi3_rope(args, head_dim)
        else:
            self.rope = initialize_rope(
                head_dim,
                args.rope_theta,
                args.rope_traditional,
                args.rope_scaling,
                args.max_position_embeddings,
            )

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, L, self.n_heads, -1)
        k = k.reshape(B, L, self.n_kv_heads, -1)
        if "q_norm" in self and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(0, 2, 1, 3)
        k = k.transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
        else:
            q, k = self.rope(q), self.rope(k)
        if self.window is not None and cache is not None and hasattr(cache, "parts") and cache.offset + L > self.window:
            raise FlashError(f"the KV cache on flash does not take a sliding window yet ({self.window} positions, "
                             "passed): run without --kv-cache flash")
        out = attend(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def host_step(self, x, cache, rotation):
        """__call__ for one position on the host (models/host.py): x [dim] float32 -> [dim]."""
        q, k, v = (host.product(p, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm_full:
            q, k = host.rms_norm(q, self.q_norm), host.rms_norm(k, self.k_norm)
        q, k = q.reshape(self.n_heads, -1), k.reshape(self.n_kv_heads, -1)
        if "q_norm" in self and not self.qk_norm_full:
            q, k = host.rms_norm(q, self.q_norm), host.rms_norm(k, self.k_norm)
        q, k = rotation(q), rotation(k)
        keys, values = cache.update_and_fetch(mx.array(k.reshape(1, self.n_kv_heads, 1, -1)),
                                             mx.array(v.reshape(1, self.n_kv_heads, 1, -1)))
        mx.eval(keys, values)
        keys, values = np.array(keys, copy=False)[0], np.array(values, copy=False)[0]
        if self.window is not None:
            keys, values = keys[:, -self.window:], values[:, -self.window:]
        out = host.attention(q, keys, values, self.scale)
        return host.product(self.o_proj, out)


def phi3_rope(args, head_dim):
    """Phi-3's rotary embedding, as mlx_lm's phi3.py makes it: int(head_dim * partial_rotary_factor)
    dimensions; LongRoPE ("longrope", "su") with its short and long factors, or a linear scale."""
    from mlx_lm.models.rope_utils import SuScaledRoPE

    dims = int(head_dim * args.partial_rotary_factor)
    scaling = args.rope_scaling or {}
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind in ("longrope", "su"):
        return SuScaledRoPE(dims, base=args.rope_theta, max_position_embeddings=args.max_position_embeddings,
                            original_max_position_embeddings=args.original_max_position_embeddings or 4096,
                            short_factor=scaling["short_factor"], long_factor=scaling["long_factor"])
    scale = 1 / scaling["factor"] if kind == "linear" else 1.0
    return nn.RoPE(dims, traditional=args.rope_traditional, base=args.rope_theta, scale=scale)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.residual = args.residual_multiplier  # (Granite's: each branch scaled before it is added)
        self.self_attn = Attention(args)
        act = activation(args.hidden_act, args.fatrelu_threshold)
        self.mlp = FlashFFN(layer, args.hidden_size, args.intermediate_size, act, gated=True, bias=args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self._scaled(self.self_attn(self.input_layernorm(x), mask, cache))
        return h + self._scaled(self.mlp(self.post_attention_layernorm(h)))

    def host_step(self, x, cache, rotation):
        """__call__ for one position on the host (models/host.py): x [dim] float32 -> [dim]; the FFN
        through its own host step (its store's rows, its native products)."""
        h = x + self._scaled(self.self_attn.host_step(host.rms_norm(x, self.input_layernorm), cache, rotation))
        return h + self._scaled(self.mlp.host_step(host.rms_norm(h, self.post_attention_layernorm)))

    def _scaled(self, r):
        return r if self.residual == 1 else r * self.residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, block=None):
        super().__init__()
        block = block or TransformerBlock  # (models/moe.py passes its own: the same model around other blocks)
        self.embedding_multiplier = args.embedding_multiplier
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if self.embedding_multiplier != 1:
            h = h * self.embedding_multiplier
        if h.dtype == mx.float32 and host.eligible(self, inputs, cache, input_embeddings):
            return self._host_step(h, cache)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0], window_size=self.layers[0].self_attn.window)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.norm(h)

    def _host_step(self, h, cache):
        """One position of one sequence on the host (models/host.py): the same values as the loop
        above, without MLX's per-operation cost between the native products."""
        x = host_f32(h)
        rope, head_dim = host.rope_of(self), self.layers[0].self_attn.head_dim
        rotations = {}
        for layer, c in zip(self.layers, cache):
            if c.offset not in rotations:
                rotations[c.offset] = host.Rotation(rope, head_dim, c.offset)
            x = layer.host_step(x, c, rotations[c.offset])
        return mx.array(host.rms_norm(x, self.norm)).reshape(1, 1, -1)


class Model(nn.Module):
    def __init__(self, args: ModelArgs, block=None):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args, block)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        out = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(out)
        else:
            out = self.lm_head(out)
        scaling = self.args.logits_scaling
        return out if scaling == 1 else out / scaling

    @property
    def layers(self):
        return self.model.layers


# --- how a Hugging Face checkpoint maps onto this model (used by the converter)


def ffn_kinds(args: ModelArgs):
    return FFN_KINDS


def ffn_tensors(args: ModelArgs, layer: int):
    """{kind: (HF tensor name, transposed?)}: rows of each kind are neurons."""
    p = f"model.layers.{layer}.mlp."
    return {
        "gate": (p + "gate_proj.weight", False),
        "up": (p + "up_proj.weight", False),
        "down": (p + "down_proj.weight", True),
    }


def fused_tensors(args: ModelArgs):
    """{fused tensor's name: [(part's name, its rows)]}: Phi-3's checkpoints stack q, k, v in
    self_attn.qkv_proj and gate, up in mlp.gate_up_proj (convert/family_view.py splits them)."""
    if args.model_type != "phi3":
        return {}
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    q, kv, f = args.num_attention_heads * hd, args.num_key_value_heads * hd, args.intermediate_size
    out = {}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = [(p + "self_attn.q_proj.weight", np.arange(0, q)),
                                                (p + "self_attn.k_proj.weight", np.arange(q, q + kv)),
                                                (p + "self_attn.v_proj.weight", np.arange(q + kv, q + 2 * kv))]
        out[p + "mlp.gate_up_proj.weight"] = [(p + "mlp.gate_proj.weight", np.arange(0, f)),
                                              (p + "mlp.up_proj.weight", np.arange(f, 2 * f))]
    return out


def resident_name(args: ModelArgs, hf_name: str):
    """HF tensor name -> this model's parameter name, or None to drop it."""
    if "rotary_emb.inv_freq" in hf_name:
        return None
    if hf_name == "lm_head.weight" and args.tie_word_embeddings:
        return None
    m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.)(gate|up|down)_proj\.bias", hf_name)
    if m:  # (mlp_bias: resident beside the rows streamed from flash)
        return f"{m.group(1)}{m.group(2)}_bias"
    return hf_name


def check_supported(args: ModelArgs):
    if args.use_sliding_window and args.sliding_window:
        raise FlashError(f"{args.model_type} with use_sliding_window=true (windowed attention in some layers) "
                         "is not supported yet")
    activation(args.hidden_act, args.fatrelu_threshold)

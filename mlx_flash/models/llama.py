"""Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2.

Attention follows mlx_lm's llama.py so that, with every FFN row in DRAM, the
logits match mlx_lm. Unlike mlx_lm, the FFN honours `hidden_act` (silu, relu,
relu2, fatrelu), so ReLU-fied Llamas run as trained.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.rope_utils import initialize_rope

from ..kernels import host_f32
from . import host
from .attention import attend
from .ffn import FlashFFN, activation

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm2")
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

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        # Qwen2 always has q/k/v biases (its config does not say so).
        self.qkv_bias = self.attention_bias or self.model_type == "qwen2"
        self.qk_norm = self.model_type == "qwen3"


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim or dim // n_heads
        self.scale = head_dim**-0.5
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
        out = host.attention(q, np.array(keys, copy=False)[0], np.array(values, copy=False)[0], self.scale)
        return host.product(self.o_proj, out)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        act = activation(args.hidden_act, args.fatrelu_threshold)
        self.mlp = FlashFFN(layer, args.hidden_size, args.intermediate_size, act, gated=True)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def host_step(self, x, cache, rotation):
        """__call__ for one position on the host (models/host.py): x [dim] float32 -> [dim]; the FFN
        through its own host step (its store's rows, its native products)."""
        h = x + self.self_attn.host_step(host.rms_norm(x, self.input_layernorm), cache, rotation)
        return h + self.mlp.host_step(host.rms_norm(h, self.post_attention_layernorm))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, block=None):
        super().__init__()
        block = block or TransformerBlock  # (models/moe.py passes its own: the same model around other blocks)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if h.dtype == mx.float32 and host.eligible(self, inputs, cache, input_embeddings):
            return self._host_step(h, cache)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
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
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

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


def resident_name(args: ModelArgs, hf_name: str):
    """HF tensor name -> this model's parameter name, or None to drop it."""
    if "rotary_emb.inv_freq" in hf_name:
        return None
    if hf_name == "lm_head.weight" and args.tie_word_embeddings:
        return None
    return hf_name


def check_supported(args: ModelArgs):
    from ..errors import FlashError

    if args.mlp_bias:
        raise FlashError("llama models with mlp_bias=true are not supported yet")
    activation(args.hidden_act, args.fatrelu_threshold)

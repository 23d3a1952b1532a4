"""Phi-1 / Phi-1.5 / Phi-2 (model type `phi`): as mlx_lm's phi.py and transformers' PhiForCausalLM.

A parallel block: one LayerNorm, then attention and the FFN side by side on its output, both added
to the input; attention with q/k/v/dense biases, a rotary embedding over `partial_rotary_factor`
of each head (Phi-2: 0.4), optional q/k LayerNorms (`qk_layernorm`); a non-gated FFN with biases
(fc1, GELU, fc2) streamed from flash as OPT's is: fc1.bias -> `mlp.up_bias`, fc2.bias ->
`mlp.down_bias`; a final LayerNorm and an output head with a bias.
"""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask

from ..errors import FlashError
from .attention import attend
from .ffn import FlashFFN, activation

MODEL_TYPES = ("phi",)
FFN_KINDS = ("up", "down")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = None
    partial_rotary_factor: float = 0.5
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "gelu_new"
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.hidden_size
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = head_dim = d // self.n_heads
        self.q_proj = nn.Linear(d, self.n_heads * head_dim)
        self.k_proj = nn.Linear(d, self.n_kv_heads * head_dim)
        self.v_proj = nn.Linear(d, self.n_kv_heads * head_dim)
        self.dense = nn.Linear(self.n_heads * head_dim, d)
        if args.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(head_dim, eps=args.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(head_dim, eps=args.layer_norm_eps)
        self.rope = nn.RoPE(int(args.partial_rotary_factor * head_dim), traditional=False, base=args.rope_theta)
        self.scale = math.sqrt(1 / head_dim)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_layernorm" in self:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        out = attend(q, k, v, cache, self.scale, mask)
        return self.dense(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = Attention(args)
        self.mlp = FlashFFN(layer, args.hidden_size, args.intermediate_size, activation(args.hidden_act),
                            gated=False, bias=True)

    def __call__(self, x, mask=None, cache=None):
        h = self.input_layernorm(x)
        return self.self_attn(h, mask, cache) + self.mlp(h) + x


class PhiModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.final_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.final_layernorm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = PhiModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=True)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.lm_head(self.model(inputs, cache, input_embeddings))

    @property
    def layers(self):
        return self.model.layers


# --- how a Hugging Face checkpoint maps onto this model (used by the converter)


def ffn_kinds(args: ModelArgs):
    return FFN_KINDS


def ffn_tensors(args: ModelArgs, layer: int):
    """{kind: (HF tensor name, transposed?)}: rows of each kind are neurons."""
    p = f"model.layers.{layer}.mlp."
    return {"up": (p + "fc1.weight", False), "down": (p + "fc2.weight", True)}


def resident_name(args: ModelArgs, hf_name: str):
    """HF tensor name -> this model's parameter name, or None to drop it."""
    if hf_name.startswith("model.layers."):
        if hf_name.endswith(".mlp.fc1.bias"):
            return hf_name[: -len("fc1.bias")] + "up_bias"
        if hf_name.endswith(".mlp.fc2.bias"):
            return hf_name[: -len("fc2.bias")] + "down_bias"
    return hf_name


def check_supported(args: ModelArgs):
    activation(args.hidden_act)
    if args.tie_word_embeddings:
        raise FlashError("phi models with tie_word_embeddings=true are not supported (Phi-1/1.5/2 have an "
                         "output head of their own)")

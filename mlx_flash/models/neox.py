"""Decoders with LayerNorms and a non-gated FFN with biases, laid out as GPT-NeoX's: Phi-1 / 1.5 /
2 (`phi`, as mlx_lm's phi.py and transformers'), Persimmon (`persimmon`) and Falcon (`falcon`), as
transformers defines them (mlx_lm has neither).

- Phi: a parallel block (one LayerNorm; attention and the FFN side by side on its output, both
  added to the input), biases everywhere, a rotary embedding over `partial_rotary_factor` of each
  head (Phi-2: 0.4), optional q/k LayerNorms, GELU (tanh), an output head with a bias.
- Persimmon: a sequential block (LayerNorm, attention, residual; LayerNorm, FFN, residual), q, k
  and v fused head by head in query_key_value, q/k LayerNorms, half of each head rotated, squared
  ReLU, an output head without a bias.
- Falcon: a parallel block with one LayerNorm (7B) or two (40B / 180B, new_decoder_architecture:
  attention's and the FFN's), or a sequential one; multi-query or grouped attention with q, k, v
  fused in query_key_value (each group: its queries, then its key, then its value), every
  dimension rotated, exact GELU, biases where `bias` says, the output head tied to the
  embeddings. ALiBi Falcons (RW-1B) are refused.

The FFN (fc1 / dense_h_to_4h -> `up`, fc2 / dense_4h_to_h -> `down`; their biases `mlp.up_bias`,
`mlp.down_bias`) is streamed from flash as OPT's is. Fused q/k/v are split at conversion
(fused_tensors, convert/family_view.py); Falcon's tensors take this module's names there (source_name:
transformer.h.N -> model.layers.N, self_attention -> self_attn, ln_attn / ln_mlp ->
input_layernorm / post_attention_layernorm, word_embeddings -> embed_tokens, ln_f ->
final_layernorm).
"""

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs, create_attention_mask

from ..errors import FlashError
from .attention import attend
from .ffn import FlashFFN, activation

MODEL_TYPES = ("phi", "persimmon", "falcon")
FFN_KINDS = ("up", "down")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: Optional[int] = None
    partial_rotary_factor: float = 0.5
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hidden_act: str = "gelu_new"
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    # the block's shape (not config.json fields: from_dict sets them by model type)
    parallel_block: bool = True  # attention and the FFN side by side (Phi, most Falcons)
    block_norms: int = 1  # LayerNorms a block: 1 (shared) or 2 (attention's and the FFN's)
    attention_bias: bool = True
    mlp_bias: bool = True
    head_bias: bool = True
    qkv_layout: Optional[str] = None  # fused q/k/v: "interleaved" (per head) or "grouped" (per kv head)
    alibi: bool = False
    rope_scaling: Optional[dict] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    @classmethod
    def from_dict(cls, params):
        params = dict(params)
        rope = params.get("rope_parameters") or {}
        if "rope_theta" in rope:  # (transformers 5 writes rope_parameters, not rope_theta)
            params.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            params.setdefault("rope_scaling", rope)
        if rope.get("partial_rotary_factor") is not None:
            params.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        if params.get("model_type") == "persimmon":
            params = {"qk_layernorm": True, "hidden_act": "relu2", **params, "parallel_block": False,
                      "block_norms": 2, "head_bias": False, "qkv_layout": "interleaved"}
        elif params.get("model_type") == "falcon":
            params = _falcon_params(params)
        return super().from_dict(params)


def _falcon_params(p):
    """A Falcon config.json (old field names too: n_embed, n_layer, n_head, n_head_kv) -> this
    module's fields, as transformers' FalconConfig and FalconDecoderLayer read it."""
    p = dict(p)
    for old, new in (("n_embed", "hidden_size"), ("n_layer", "num_hidden_layers"),
                     ("n_head", "num_attention_heads"), ("n_head_kv", "num_kv_heads")):
        if old in p and new not in p:
            p[new] = p.pop(old)
    heads, hidden = p["num_attention_heads"], p["hidden_size"]
    new_arch = bool(p.get("new_decoder_architecture", False))
    if new_arch:
        kv = p.get("num_kv_heads") or heads
    else:  # (multi-query: one key and value head; else one a head, laid out q, k, v per head)
        kv = 1 if p.get("multi_query", True) else heads
    parallel = new_arch or bool(p.get("parallel_attn", True))
    bias = bool(p.get("bias", False))
    return {**p, "intermediate_size": p.get("ffn_hidden_size") or 4 * hidden, "num_key_value_heads": kv,
            "layer_norm_eps": p.get("layer_norm_epsilon", 1e-5), "hidden_act": p.get("activation", "gelu"),
            "partial_rotary_factor": 1.0, "qk_layernorm": False,
            "tie_word_embeddings": p.get("tie_word_embeddings", True), "parallel_block": parallel,
            "block_norms": (p.get("num_ln_in_parallel_attn") or 2) if new_arch else (1 if parallel else 2),
            "attention_bias": bias, "mlp_bias": bias, "head_bias": False,
            "qkv_layout": "grouped" if new_arch or kv == 1 else "interleaved", "alibi": bool(p.get("alibi", False))}


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, bias = args.hidden_size, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = head_dim = d // self.n_heads
        self.q_proj = nn.Linear(d, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * head_dim, bias=bias)
        self.dense = nn.Linear(self.n_heads * head_dim, d, bias=bias)
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
        self.parallel = args.parallel_block
        self.input_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        if args.block_norms == 2:  # (the FFN's own: after attention, or beside it)
            self.post_attention_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = Attention(args)
        self.mlp = FlashFFN(layer, args.hidden_size, args.intermediate_size, activation(args.hidden_act),
                            gated=False, bias=args.mlp_bias)

    def __call__(self, x, mask=None, cache=None):
        h = self.input_layernorm(x)
        a = self.self_attn(h, mask, cache)
        if self.parallel:
            if "post_attention_layernorm" in self:
                h = self.post_attention_layernorm(x)
            return a + self.mlp(h) + x
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class NeoXModel(nn.Module):
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
        self.model = NeoXModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=args.head_bias)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        out = self.model(inputs, cache, input_embeddings)
        return self.model.embed_tokens.as_linear(out) if self.args.tie_word_embeddings else self.lm_head(out)

    @property
    def layers(self):
        return self.model.layers


# --- how a Hugging Face checkpoint maps onto this model (used by the converter)

FFN_NAMES = {"phi": ("fc1", "fc2")}  # (Persimmon's and Falcon's: dense_h_to_4h, dense_4h_to_h)
FALCON_NAMES = (("transformer.h.", "model.layers."), (".self_attention.", ".self_attn."),
                (".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".post_attention_layernorm."),
                ("transformer.word_embeddings.", "model.embed_tokens."),
                ("transformer.ln_f.", "model.final_layernorm."))


def ffn_kinds(args: ModelArgs):
    return FFN_KINDS


def _ffn_names(args):
    return FFN_NAMES.get(args.model_type, ("dense_h_to_4h", "dense_4h_to_h"))


def ffn_tensors(args: ModelArgs, layer: int):
    """{kind: (HF tensor name, transposed?)}: rows of each kind are neurons."""
    up, down = _ffn_names(args)
    p = f"model.layers.{layer}.mlp."
    return {"up": (p + up + ".weight", False), "down": (p + down + ".weight", True)}


def source_name(args: ModelArgs, name: str):
    """A checkpoint's tensor name -> the name this module's other functions use (Falcon's differ)."""
    if args.model_type == "falcon":
        for old, new in FALCON_NAMES:
            name = name.replace(old, new)
    return name


def fused_tensors(args: ModelArgs):
    """{fused tensor's name: [(part's name, its rows)]}: Persimmon's and Falcon's query_key_value
    (weight and bias) -> q_proj, k_proj, v_proj (convert/family_view.py splits them)."""
    if args.qkv_layout is None:
        return {}
    n, kv = args.num_attention_heads, args.num_key_value_heads
    hd = args.hidden_size // n
    if args.qkv_layout == "interleaved":  # head by head: its q, k, v rows
        rows = np.arange(3 * n * hd).reshape(n, 3, hd)
        q, k, v = rows[:, 0], rows[:, 1], rows[:, 2]
    else:  # kv head by kv head: its n / kv queries' rows, its key's, its value's
        r = n // kv
        rows = np.arange((n + 2 * kv) * hd).reshape(kv, r + 2, hd)
        q, k, v = rows[:, :r], rows[:, r], rows[:, r + 1]
    out = {}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for suffix in ("weight", "bias"):
            out[f"{p}query_key_value.{suffix}"] = [(f"{p}{x}_proj.{suffix}", part.reshape(-1))
                                                   for x, part in zip("qkv", (q, k, v))]
    return out


def resident_name(args: ModelArgs, hf_name: str):
    """HF tensor name (source_name's) -> this model's parameter name, or None to drop it."""
    if "rotary_emb.inv_freq" in hf_name or (hf_name == "lm_head.weight" and args.tie_word_embeddings):
        return None
    up, down = _ffn_names(args)
    if hf_name.startswith("model.layers."):
        if hf_name.endswith(f".mlp.{up}.bias"):
            return hf_name[: -len(f"{up}.bias")] + "up_bias"
        if hf_name.endswith(f".mlp.{down}.bias"):
            return hf_name[: -len(f"{down}.bias")] + "down_bias"
    return hf_name


def check_supported(args: ModelArgs):
    activation(args.hidden_act)
    name = args.model_type
    if args.model_type == "phi" and args.tie_word_embeddings:
        raise FlashError("phi models with tie_word_embeddings=true are not supported (Phi-1/1.5/2 have an "
                         "output head of their own)")
    if args.alibi:
        raise FlashError(f"{name} models with alibi=true (ALiBi position biases instead of a rotary embedding, "
                         "Falcon-RW) are not supported")
    if args.rope_scaling:
        raise FlashError(f"{name} models with RoPE scaling ({args.rope_scaling}) are not supported")
    if args.num_attention_heads % args.num_key_value_heads:
        raise FlashError(f"{name}: {args.num_attention_heads} attention heads do not split into "
                         f"{args.num_key_value_heads} key/value heads")
    if args.block_norms not in (1, 2):
        raise FlashError(f"{name}: num_ln_in_parallel_attn must be 1 or 2, not {args.block_norms}")

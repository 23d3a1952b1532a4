"""OPT family (facebook/opt-*, Galactica): as Hugging Face transformers' OPTForCausalLM.

ReLU (or `activation_function`) FFN with biases, learned positional embeddings
with OPT's offset of 2, pre-LN (`do_layer_norm_before`, most OPTs) or post-LN
(opt-350m), optional `project_in`/`project_out` when `word_embed_proj_dim`
differs from `hidden_size` (opt-350m), LM head tied to the token embeddings.

Parameter names mirror the Hugging Face ones (`model.decoder.…`), except that
the FFN is a FlashFFN called `mlp`: fc1.bias -> `mlp.up_bias`, fc2.bias ->
`mlp.down_bias`; fc1.weight / fc2.weight live in the flash layout.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask

from ..errors import FlashError
from .attention import attend
from .ffn import FlashFFN, activation

MODEL_TYPES = ("opt",)
FFN_KINDS = ("up", "down")
POSITION_OFFSET = 2  # OPT's learned positions start at row 2 (rows 0, 1: padding hack)
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, which OPT uses
PREFIX = "model.decoder."


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    ffn_dim: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    _remove_final_layer_norm: bool = False
    word_embed_proj_dim: Optional[int] = None
    activation_function: str = "relu"
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            self.word_embed_proj_dim = self.hidden_size
        self.has_final_layer_norm = self.do_layer_norm_before and not self._remove_final_layer_norm
        self.has_projections = self.word_embed_proj_dim != self.hidden_size


def _layer_norm(args):
    return nn.LayerNorm(args.hidden_size, eps=LN_EPS, affine=args.layer_norm_elementwise_affine)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        bias = args.enable_bias
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        out = attend(q, k, v, cache, self.scale, mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.pre_ln = args.do_layer_norm_before
        self.self_attn = Attention(args)
        self.self_attn_layer_norm = _layer_norm(args)
        act = activation(args.activation_function)
        self.mlp = FlashFFN(
            layer, args.hidden_size, args.ffn_dim, act, gated=False, bias=args.enable_bias
        )
        self.final_layer_norm = _layer_norm(args)

    def __call__(self, x, mask=None, cache=None):
        if self.pre_ln:
            h = x + self.self_attn(self.self_attn_layer_norm(x), mask, cache)
            return h + self.mlp(self.final_layer_norm(h))
        h = self.self_attn_layer_norm(x + self.self_attn(x, mask, cache))
        return self.final_layer_norm(h + self.mlp(h))


class OPTDecoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.max_positions = args.max_position_embeddings
        self.embed_tokens = nn.Embedding(args.vocab_size, args.word_embed_proj_dim)
        self.embed_positions = nn.Embedding(
            args.max_position_embeddings + POSITION_OFFSET, args.hidden_size
        )
        if args.has_projections:
            self.project_in = nn.Linear(args.word_embed_proj_dim, args.hidden_size, bias=False)
            self.project_out = nn.Linear(args.hidden_size, args.word_embed_proj_dim, bias=False)
        if args.has_final_layer_norm:
            self.final_layer_norm = _layer_norm(args)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]

    def positions(self, L, cache):
        """Rows of embed_positions for the next L tokens (HF: cumsum(mask) - 1 + 2)."""
        offset = 0 if cache is None else cache.offset
        if isinstance(offset, int):
            if offset + L > self.max_positions:
                raise FlashError(
                    f"OPT supports at most {self.max_positions} positions "
                    f"(asked for {offset + L})"
                )
            return mx.arange(offset, offset + L) + POSITION_OFFSET
        # batched caches: an offset per sequence, negative over left padding,
        # where HF's position is -1 (row 1, the padding row)
        pos = mx.arange(L) + offset[..., None]
        return mx.maximum(pos, -1) + POSITION_OFFSET

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if "project_in" in self:
            h = self.project_in(h)
        if cache is None:
            cache = [None] * len(self.layers)
        h = h + self.embed_positions(self.positions(h.shape[1], cache[0]))
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        if "final_layer_norm" in self:
            h = self.final_layer_norm(h)
        if "project_out" in self:
            h = self.project_out(h)
        return h


class OPTModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.decoder = OPTDecoder(args)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.decoder(inputs, cache, input_embeddings)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = OPTModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.word_embed_proj_dim, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        out = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.decoder.embed_tokens.as_linear(out)
        return self.lm_head(out)

    @property
    def layers(self):
        return self.model.decoder.layers


# --- how a Hugging Face checkpoint maps onto this model (used by the converter)


def ffn_kinds(args: ModelArgs):
    return FFN_KINDS


def ffn_tensors(args: ModelArgs, layer: int):
    """{kind: (HF tensor name, transposed?)}: rows of each kind are neurons.

    Only the `model.decoder.` naming (OPTForCausalLM.save_pretrained) is
    recognised here; see `canonical_name` for checkpoints saved from OPTModel.
    """
    p = f"{PREFIX}layers.{layer}."
    return {"up": (p + "fc1.weight", False), "down": (p + "fc2.weight", True)}


def canonical_name(hf_name: str):
    """OPTModel checkpoints name tensors `decoder.…`; OPTForCausalLM ones `model.decoder.…`."""
    if hf_name.startswith("decoder."):
        return "model." + hf_name
    return hf_name


def resident_name(args: ModelArgs, hf_name: str):
    """HF tensor name -> this model's parameter name, or None to drop it."""
    name = canonical_name(hf_name)
    if name == "lm_head.weight" and args.tie_word_embeddings:
        return None
    if name.startswith(PREFIX + "layers."):
        if name.endswith(".fc1.bias"):
            return name[: -len("fc1.bias")] + "mlp.up_bias"
        if name.endswith(".fc2.bias"):
            return name[: -len("fc2.bias")] + "mlp.down_bias"
    return name


def check_supported(args: ModelArgs):
    activation(args.activation_function)
    if args.hidden_size % args.num_attention_heads:
        raise FlashError(
            f"hidden_size {args.hidden_size} is not a multiple of num_attention_heads "
            f"{args.num_attention_heads}"
        )

"""Mixture-of-experts families on the llama attention: Mixtral, Qwen2-MoE (shared expert with
its gate), Qwen3-MoE, OLMoE (q/k norm over the whole projection).

Routing follows each family's mlx_lm module, so that with every expert in DRAM the logits
match mlx_lm's. The experts themselves are never held here: `ExpertFFN` asks a store
(runtime/stores/experts.py) for the slots that hold the routed experts, and multiplies on
the store's slabs with `mx.gather_qmm` / `mx.gather_mm` as mlx_lm's SwitchGLU does on its
stacked weights. The router, attention, norms and shared experts are resident.
"""

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from ..errors import FlashError
from ..kernels import qmv_many
from . import llama
from .ffn import host_silu
from .llama import Attention

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# where each family keeps its MoE block, and what mlx_lm names its experts' stacked weights
BLOCK = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp", "olmoe": "mlp"}
HF_EXPERT = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}  # the others: gate_proj, up_proj, down_proj


@dataclass
class ModelArgs(llama.ModelArgs):
    """llama.py's arguments (the attention is the same) and the experts'."""

    num_experts_per_tok: int = 2
    num_experts: Optional[int] = None  # qwen2_moe, qwen3_moe, olmoe
    num_local_experts: Optional[int] = None  # mixtral
    moe_intermediate_size: Optional[int] = None  # qwen: the experts' size (intermediate_size: dense layers)
    shared_expert_intermediate_size: Optional[int] = None  # qwen2_moe
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    rope_theta: float = 1000000  # (the MoE families' defaults where config.json says nothing)
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.n_experts = self.num_local_experts if self.model_type == "mixtral" else self.num_experts
        self.d_expert = self.moe_intermediate_size or self.intermediate_size
        self.qkv_bias = self.attention_bias or self.model_type == "qwen2_moe"
        self.qk_norm = {"qwen3_moe": True, "olmoe": "full"}.get(self.model_type, False)
        self.window = None  # (the mixtures' attention here takes no sliding window)

    def is_moe_layer(self, layer):
        if self.model_type != "qwen3_moe":
            return True
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass
class ExpertRows:
    """What a store hands an ExpertFFN for one layer's routed experts."""

    idx: mx.array  # slot of each (token, k) choice, the shape of the router's indices
    weights: dict  # {kind: (weight, scales, biases)} (quantized) or {kind: weight}: [slots, out, in...]
    bits: Optional[int] = None  # quantized: gather_qmm's bits and group size
    group_size: Optional[int] = None
    mask: Optional[mx.array] = None  # 0/1 per choice: this part serves only some (a prompt, in groups)
    # one position on the CPU: (the slots as a NumPy array, {kind: [QuantMatrix per slot]}): the native
    # kernels multiply each routed expert where it lies (MLX's quantized gather is ~10x slower there)
    host: Optional[tuple] = None
    # one position whose missing experts are still being read (the store's overlap): (NumPy bool, the
    # shape of idx: which choices, a callable that returns when their slots are filled or raises)
    late: Optional[tuple] = None


def _gather_sort(x, indices):  # as mlx_lm's switch_layers: many tokens, experts in order
    *_, m = indices.shape
    indices = indices.flatten()
    order = mx.argsort(indices)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // m], indices[order], inv_order


def _switch_linear(x, w, idx, rows, sorted_indices):
    if rows.bits is None:
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sorted_indices)
    weight, scales, biases = w
    return mx.gather_qmm(x, weight, scales, biases, rhs_indices=idx, transpose=True, group_size=rows.group_size,
                         bits=rows.bits, sorted_indices=sorted_indices)


HOST_MATVECS = 16  # positions of one expert up to which a matrix-vector product each beats dequantizing
HOST_CHUNK = 1024  # rows dequantized at a time for BLAS


def _host_products(mat, xs):
    """xs [n, K] float32 -> xs @ W.T [n, N] by the native kernels: a matrix-vector product per
    position, or for many positions the weight dequantized in chunks of rows for BLAS."""
    if xs.shape[0] <= HOST_MATVECS:
        return np.stack([mat.matvec(x) for x in xs])
    out = np.empty((xs.shape[0], mat.n), dtype=np.float32)
    buf = np.empty((min(HOST_CHUNK, mat.n), mat.k), dtype=np.float32)
    for start in range(0, mat.n, HOST_CHUNK):
        stop = min(mat.n, start + HOST_CHUNK)
        w = buf[: stop - start]
        mat.dequantize(start, stop, w)
        np.matmul(xs, w.T, out=out[:, start:stop])
    return out


def _one_position(x, slots, mats, out=None):
    """One position's routed experts (their slots) by the native kernels -> float32 [k, D] (into out)."""
    gates, ups, downs = ([mats[kind][s] for s in slots.tolist()] for kind in ("gate", "up", "down"))
    k = len(gates)
    out = np.empty((k, downs[0].n), dtype=np.float32) if out is None else out
    if 2 * k <= gates[0].kernels.MAX_MANY:
        # every gate and up in one native call, every down in another (the store's slots are alike
        # by construction: one shape per kind, one width, group and scale dtype)
        gu = qmv_many((x,), gates + ups, (0,) * (2 * k))
        g, u = gu[:k], gu[k:]
        qmv_many(tuple(host_silu(g) * u), downs, range(k), out=out)
    else:  # more routed experts than one native call takes (no family routes to 32): a call per matrix
        for j, (gate, up, down) in enumerate(zip(gates, ups, downs)):
            g, u = gate.matvec(x), up.matvec(x)
            down.matvec(host_silu(g) * u, out[j])
    return out


def host_switch_glu(x, rows: ExpertRows):
    """The routed experts by the native kernels, expert by expert over the positions routed to it:
    [..., D] -> [..., k, D] (float32 sums; the same values as switch_glu to float32 rounding)."""
    slots, mats = rows.host
    d = x.shape[-1]
    xs = np.array(x.astype(mx.float32)).reshape(-1, d)
    chosen = slots.reshape(xs.shape[0], -1)
    out = np.empty(chosen.shape + (d,), dtype=np.float32)
    if xs.shape[0] == 1:
        if rows.late is None:
            _one_position(xs[0], chosen[0], mats, out[0])
        else:  # the experts in the buffer while the missing ones are read, then those (the same sums)
            late, wait = rows.late
            on_time, later = np.flatnonzero(~late.reshape(-1)), np.flatnonzero(late.reshape(-1))
            if on_time.size:
                out[0, on_time] = _one_position(xs[0], chosen[0, on_time], mats)
            wait()
            if later.size:
                out[0, later] = _one_position(xs[0], chosen[0, later], mats)
    else:
        for slot in np.unique(chosen).tolist():
            pos, j = np.nonzero(chosen == slot)
            xe = np.ascontiguousarray(xs[pos])
            g, u = _host_products(mats["gate"][slot], xe), _host_products(mats["up"][slot], xe)
            out[pos, j] = _host_products(mats["down"][slot], host_silu(g) * u)
    return mx.array(out).reshape(*x.shape[:-1], chosen.shape[1], d).astype(x.dtype)


def switch_glu(x, rows: ExpertRows):
    """mlx_lm's SwitchGLU on a store's slabs: [..., D] -> [..., k, D]."""
    if rows.host is not None:
        return host_switch_glu(x, rows)
    indices = rows.idx
    x = mx.expand_dims(x, (-2, -3))
    do_sort = indices.size >= 64
    idx, inv_order = indices, None
    if do_sort:
        x, idx, inv_order = _gather_sort(x, indices)
    up = _switch_linear(x, rows.weights["up"], idx, rows, do_sort)
    gate = _switch_linear(x, rows.weights["gate"], idx, rows, do_sort)
    x = _switch_linear(swiglu(gate, up), rows.weights["down"], idx, rows, do_sort)
    if do_sort:
        x = mx.unflatten(x[inv_order], 0, indices.shape)
    return x.squeeze(-2)


class ExpertFFN:
    """A layer's experts, asked of `store` (set by the runtime): `store.experts(layer, inds)`
    -> ExpertRows or a list of them (a prompt whose experts are more than the slots: each
    part's output is evaluated before the store reads the next)."""

    def __init__(self, layer):
        self.layer = layer
        self.store = None
        # (next MoE layer, guess(residual, this layer's router indices) -> its indices): set by Model
        # to the router look-ahead; a benchmark may put another predictor there
        self.lookahead = None

    def __call__(self, x, inds, residual=None):
        if self.store is None:
            raise FlashError("the experts have no store; load the model with mlx_flash.load")
        parts = self.store.experts(self.layer, inds)
        if self.lookahead is not None and residual is not None and self.store.prefetch:
            # the next MoE layer's experts, as guessed (by default its router on this layer's
            # residual stream), read while this layer computes
            layer, guess = self.lookahead
            self.store.read_ahead(layer, guess(residual, inds))
        if isinstance(parts, ExpertRows):
            y = switch_glu(x, parts)
        else:
            y = None
            for part in parts:
                if callable(part):  # its reads overwrite slots the sum so far reads: evaluate it first
                    mx.eval(y)
                    part = part()
                out = switch_glu(x, part) * part.mask[..., None].astype(x.dtype)
                y = out if y is None else y + out
        # Evaluated here, so that no lazy result outlives this call still reading the slots: a
        # caller may hold this call's output unevaluated while later calls refill them. (The
        # router's read-back has synchronised this layer anyway; the look-ahead's read goes on.)
        mx.eval(y)
        return y


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class MoEBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.family = args.model_type
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.n_experts, bias=False)
        if args.shared_expert_intermediate_size:
            self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        self.experts = ExpertFFN(layer)

    def route(self, x):
        """-> (expert indices [..., k], their weights [..., k]) as the family's mlx_lm module."""
        gates = self.gate(x)
        k = self.top_k
        if self.family == "mixtral":
            inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
            scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
            return inds, scores
        gates = mx.softmax(gates, axis=-1, precise=True)
        if self.family == "qwen3_moe":
            inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        else:
            inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob and self.family != "qwen2_moe":  # (mlx_lm's qwen2_moe ignores it)
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores

    def __call__(self, x, residual=None):
        inds, scores = self.route(x)
        y = self.experts(x, inds, residual)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.block_name = BLOCK[args.model_type]
        if args.is_moe_layer(layer):
            setattr(self, self.block_name, MoEBlock(args, layer))
        else:  # a dense layer of a MoE model (Qwen3-MoE's mlp_only_layers): resident
            setattr(self, self.block_name, MLP(args.hidden_size, args.intermediate_size))
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        block = self[self.block_name]
        if isinstance(block, MoEBlock):
            return h + block(self.post_attention_layernorm(h), residual=h)
        return h + block(self.post_attention_layernorm(h))


def on_route(model, record):
    """Call record(layer, x, inds, scores) on every routing of every MoE block (calibration);
    -> a function that takes the hooks off."""
    blocks = [(i, layer[layer.block_name]) for i, layer in enumerate(model.layers)
              if isinstance(layer[layer.block_name], MoEBlock)]
    for i, block in blocks:
        def route(x, original=block.route, layer=i):
            inds, scores = original(x)
            record(layer, x, inds, scores)
            return inds, scores

        block.route = route

    def off():
        for _, block in blocks:
            del block.route

    return off


def router_lookahead(block):
    """The next MoE layer's router applied to this layer's residual stream (before the next
    attention): its guess of that layer's experts, the most likely first (the store reads them in
    that order until the layer comes)."""
    norm, moe = block.post_attention_layernorm, block[block.block_name]

    def guess(residual, inds):
        chosen, scores = moe.route(norm(residual))
        return mx.take_along_axis(chosen, mx.argsort(-scores, axis=-1), axis=-1)

    return guess


class Model(llama.Model):
    """llama.py's model around MoE blocks; each MoE layer's experts know the next MoE layer's
    norm and router (the look-ahead)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock)
        moe = [(i, layer) for i, layer in enumerate(self.layers) if isinstance(layer[layer.block_name], MoEBlock)]
        for (_, layer), (j, after) in zip(moe, moe[1:]):
            layer[layer.block_name].experts.lookahead = (j, router_lookahead(after))

    def expert_ffns(self):
        """{layer: ExpertFFN} of the layers with experts."""
        out = {}
        for i, layer in enumerate(self.layers):
            block = layer[layer.block_name]
            if isinstance(block, MoEBlock):
                out[i] = block.experts
        return out


# --- how a checkpoint maps onto this model (used by the converter)


def expert_tensors(args: ModelArgs, layer: int):
    """{kind: (stacked mlx-lm name, [per-expert Hugging Face names])} of a MoE layer, or None."""
    if not args.is_moe_layer(layer):
        return None
    p = f"model.layers.{layer}.{BLOCK[args.model_type]}."
    hf = HF_EXPERT.get(args.model_type, {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    return {kind: (f"{p}switch_mlp.{kind}_proj.weight",
                   [f"{p}experts.{e}.{hf[kind]}.weight" for e in range(args.n_experts)])
            for kind in ("gate", "up", "down")}


resident_name = llama.resident_name  # (the same names: HF tensor -> parameter, or None to drop it)


def ffn_kinds(args: ModelArgs):
    return ()


def ffn_tensors(args: ModelArgs, layer: int):
    return {}  # no neuron bundles: the experts are expert bundles (expert_tensors)


def check_supported(args: ModelArgs):
    if not args.n_experts:
        raise FlashError(f"{args.model_type}: config.json gives no number of experts "
                         f"({'num_local_experts' if args.model_type == 'mixtral' else 'num_experts'})")
    if not 1 <= args.num_experts_per_tok <= args.n_experts:
        raise FlashError(f"{args.model_type}: num_experts_per_tok {args.num_experts_per_tok} is not in "
                         f"1..{args.n_experts}")
    if args.mlp_bias:
        raise FlashError(f"{args.model_type} models with mlp_bias=true are not supported yet")
    if args.hidden_act not in ("silu", "swish"):
        raise FlashError(f"{args.model_type}: hidden_act '{args.hidden_act}' is not supported (the experts are SwiGLU)")

"""A GGUF file as a converter source: HF-named float32 tensors, one at a time.

One file past 500 lines: each architecture's names, values and tokenizer are undone here, beside
the reader they configure.

The file is memory-mapped (gguf's GGUFReader), so `read()` touches only the
bytes of the tensor asked for. Three things differ from a Hugging Face folder
and are undone here:

- names: llama.cpp's `blk.N.attn_q.weight` becomes `model.layers.N.self_attn.q_proj.weight`;
- values: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks are MLX affine groups of 32 values
  (`read_quantized`: the same numbers, repacked, bit-exact; Q5_x's held at 8 bits); so
  are Q4_K and Q5_K sub-blocks (kquants.py: the values as they are, each group's scale
  and bias rounded once to float16; Q5_K's values held at 8 bits); other quantized types
  (Q6_K, Q2_K, Q3_K) have no such form and are dequantized (gguf.quants)
  for the converter to re-quantize; for the llama architecture
  the rows of q/k are un-permuted (convert_hf_to_gguf.py permutes them for
  its rotary kernel);
- tokenizer: there is no tokenizer.json, only a vocabulary, token types and merges
  (byte-level BPE) or scores (SentencePiece) in the metadata, from which a `tokenizers`
  Tokenizer is rebuilt (gguf_tokenizer.py).
"""

import json
import re
from pathlib import Path

import numpy as np

from ..errors import FlashError
from . import kquants
from .gguf_tokenizer import PRE_TOKENIZERS, byte_level_bpe, sentencepiece_bpe

# HF config fields per architecture. Qwen2/3 GGUFs are not permuted; llama's are.
ARCHS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "permuted": True},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "permuted": False},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "permuted": False},
    # mixtures of experts: a layer's experts of each kind merged in one [E, out, in] tensor
    # (llama.cpp's *_exps), read as mlx-lm's stacked switch_mlp weights
    # (Mixtral's GGUFs are "llama" ones with experts: read as mixtral, MIXTRAL below)
    "qwen3moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "permuted": False},
    "olmoe": {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "permuted": False},
    # Gemma: llama.cpp stores each RMS norm's weight + 1 (its norm multiplies by w, Gemma's by 1 + w)
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "permuted": False},
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "permuted": False},
    # Granite: a llama with four multipliers (llama.cpp's *_scale keys); Phi-3: q/k/v in attn_qkv,
    # gate and up in ffn_up, split by the converter (convert/family_view.py) as from Phi-3's checkpoints
    "granite": {"model_type": "granite", "architectures": ["GraniteForCausalLM"], "permuted": True},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "permuted": False},
    # Phi-2: LayerNorms with biases, a parallel block, a non-gated FFN (models/neox.py)
    "phi2": {"model_type": "phi", "architectures": ["PhiForCausalLM"], "permuted": False},
    # Persimmon and Falcon: q/k/v in attn_qkv (Persimmon's head by head as in its checkpoints;
    # Falcon's regrouped by convert_hf_to_gguf.py as all q, all k, all v: put back here)
    "persimmon": {"model_type": "persimmon", "architectures": ["PersimmonForCausalLM"], "permuted": False},
    "falcon": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "permuted": False},
}
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
EXPERT_KEYS = {"llama": "num_local_experts", "qwen3moe": "num_experts", "olmoe": "num_experts"}
GEMMA = ("gemma2", "gemma3")
# the layers of the 27B models, whose attention scales by (hidden / heads)^-1/2, not head_dim^-1/2
# (llama.cpp's rule: the GGUF does not say)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# llama.cpp tensor names -> HF names. "{i}" is the layer index.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_norm_2": "post_attention_layernorm",
}
# Gemma's block has four norms: llama.cpp's ffn_norm is the one before the FFN
ARCH_LAYER_NAMES = {**{arch: {"ffn_norm": "pre_feedforward_layernorm"} for arch in GEMMA},
                    "phi3": {"ffn_up": "mlp.gate_up_proj"},
                    "phi2": {"attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"},
                    **{arch: {"attn_qkv": "self_attn.query_key_value", "attn_output": "self_attn.dense",
                              "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
                              "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
                       for arch in ("persimmon", "falcon")}}
ARCH_GLOBAL_NAMES = {arch: {"output_norm": "model.final_layernorm"} for arch in ("phi2", "persimmon", "falcon")}
# Phi-3's LongRoPE: llama.cpp keeps its per-frequency factors as tensors
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
LAYER_ORDER = {k: i for i, k in enumerate(LAYER_NAMES)}

# Tensor types gguf.quants can dequantize and that we accept. The issue asks
# for F32/F16/BF16/Q8_0/Q4_0/Q4_1; Q5_x and the K-quants come for free.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


# GGUF block types that are MLX affine groups (group size 32, float16 d): per 32-value
# block, bytes of the header (d, and m for Q4_1) and of the values, the bits, and the
# offset that makes llama.cpp's values unsigned (x = d * (q - offset) = d * q + (-offset d)).
# Q5_0 / Q5_1 (values' fifth bits in a 32-bit word before the nibbles) are held at 8 bits: the
# same values in a wider field, the width with fast kernels.
EXACT_BLOCKS = {"Q4_0": (2, 16, 4, 8), "Q4_1": (4, 16, 4, None), "Q8_0": (2, 32, 8, -128),
                "Q5_0": (2, 20, 8, 16), "Q5_1": (4, 20, 8, None)}


def _short_float(x):
    """float32 metadata as the decimal a config.json would hold (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(x)))


def unpermute(w, n_head):
    """Undo convert_hf_to_gguf.py's `permute`: rows (head, 2, half) were stored as (head, half, 2)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def layer_names(arch, names):
    """An architecture's llama.cpp layer tensor names -> HF's, given all the file's tensor names.
    Falcon-40B's two LayerNorms: llama.cpp's attn_norm is the FFN's (ln_mlp), attn_norm_2
    attention's (ln_attn)."""
    out = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
    if arch == "falcon" and any(n.endswith(".attn_norm_2.weight") for n in names):
        out.update(attn_norm="post_attention_layernorm", attn_norm_2="input_layernorm")
    if arch == "llama" and any(n.endswith(".ffn_gate_exps.weight") for n in names):  # Mixtral's block
        out.update({k: v.replace("mlp.", "block_sparse_moe.", 1) for k, v in LAYER_NAMES.items() if "ffn_gate_" in k
                    or k.endswith("_exps")})
    return out


def hf_name(gguf_name, arch=None, names=None):
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown. names:
    layer_names(arch, ...) (else the architecture's usual ones)."""
    parts = gguf_name.split(".")
    if parts[-1] not in ("weight", "bias"):
        return None
    names = names or layer_names(arch, ())
    if parts[0] == "blk" and len(parts) == 4 and parts[1].isdigit() and parts[2] in names:
        name = names[parts[2]]
        return f"model.layers.{int(parts[1])}.{name}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{ARCH_GLOBAL_NAMES.get(arch, {}).get(parts[0], GLOBAL_NAMES[parts[0]])}.{parts[1]}"
    return None


def _sort_key(gguf_name):
    """HF order: embeddings, layers in order, final norm, lm_head."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), LAYER_ORDER[parts[2]], parts[3])
    return ({"token_embd": 0, "output_norm": 2, "output": 3}[parts[0]], 0, 0, parts[-1])


def llama3_rope_scaling(freqs, theta, head_dim):
    """Recover HF's `rope_scaling` (type llama3) from llama.cpp's `rope_freqs` tensor.

    llama.cpp stores the per-frequency divisors instead of the parameters. We
    try the parameters every Llama 3.x model uses (only `factor` differs) and
    accept them if they reproduce the tensor; anything else is refused.
    """
    factor = float(freqs.max())
    low, high, old_ctx = 1.0, 4.0, 8192
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    expected = 1.0 / ((1 - smooth) / factor + smooth)
    if freqs.shape != expected.shape or not np.allclose(freqs, expected, rtol=1e-4):
        return None
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_ctx,
    }


class GGUFSource:
    """A GGUF file of an architecture in ARCHS, read lazily tensor by tensor."""

    def __init__(self, path):
        import gguf

        self._gguf = gguf
        self.path = Path(path)
        if not self.path.is_file():
            raise FlashError(f"{self.path}: no such GGUF file")
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises ValueError, IndexError, ... on bad bytes
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FlashError(f"{self.path}: not a readable GGUF file, truncated or corrupt ({detail})")
        self._meta = dict(self._reader.fields)

        if (self._get("split.count") or 1) > 1:
            raise FlashError(
                f"{self.path.name}: split GGUF ({self._get('split.count')} files) is not supported; "
                "merge it first with llama.cpp's `llama-gguf-split --merge`"
            )

        arch = self._get("general.architecture")
        if arch not in ARCHS:
            raise FlashError(
                f"{self.path.name}: unsupported GGUF architecture '{arch}' (supported: {', '.join(ARCHS)})"
            )
        self.arch = arch

        size = self.path.stat().st_size
        self._tensors = {}
        rope_freqs = None
        self._rope_factors = {}
        names = layer_names(arch, [t.name for t in self._reader.tensors])
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise FlashError(f"{self.path}: truncated GGUF file (tensor {t.name} ends past the end)")
            if t.name == "rope_freqs.weight":
                rope_freqs = t
                continue
            if t.name in ROPE_FACTORS:
                self._rope_factors[t.name.split(".")[0]] = t
                continue
            name = hf_name(t.name, arch, names)
            if name is None:
                if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", t.name):
                    raise FlashError(f"{self.path.name}: experts stored one tensor each ('{t.name}'), as llama.cpp "
                                     "wrote mixtures before it merged them; convert the model again with a "
                                     "current llama.cpp, or convert its Hugging Face folder")
                raise FlashError(f"{self.path.name}: unexpected tensor '{t.name}' for a {arch} GGUF")
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise FlashError(
                    f"{self.path.name}: tensor '{t.name}' has type {t.tensor_type.name}, "
                    f"which mlx_flash cannot dequantize (supported: {', '.join(SUPPORTED_TYPES)})"
                )
            self._tensors[name] = t
        if "model.embed_tokens.weight" not in self._tensors:
            raise FlashError(f"{self.path.name}: no token_embd.weight tensor; not a language model GGUF")
        self._order = sorted(self._tensors, key=lambda n: _sort_key(self._tensors[n].name))

        self.config = self._build_config(rope_freqs)
        self._check_tokenizer()

    # --- metadata ---

    def _get(self, key, default=None):
        """A metadata value as Python: str, int, float, bool, or a list of them."""
        field = self._meta.get(key)
        if field is None:
            return default
        # The reader keeps each value (each array element too) as its own small array.
        is_str = field.types[-1] == self._gguf.GGUFValueType.STRING
        parts = [field.parts[i] for i in field.data]
        values = [bytes(p).decode("utf-8") if is_str else p.tolist()[0] for p in parts]
        return values if field.types[0] == self._gguf.GGUFValueType.ARRAY else values[0]

    def _arch_get(self, key, default=None):
        return self._get(f"{self.arch}.{key}", default)

    def _build_config(self, rope_freqs):
        n_head = self._arch_get("attention.head_count")
        hidden = self._arch_get("embedding_length")
        n_layers = self._arch_get("block_count")
        if None in (n_head, hidden, n_layers) or isinstance(n_head, list):
            raise FlashError(
                f"{self.path.name}: GGUF metadata lacks {self.arch}.block_count/embedding_length/attention.head_count"
            )
        n_kv = self._arch_get("attention.head_count_kv", n_head)
        default_head_dim = hidden // n_head
        head_dim = self._arch_get("attention.key_length") or default_head_dim
        theta = _short_float(self._arch_get("rope.freq_base", 10000.0))
        vocab = self.shape("model.embed_tokens.weight")[0]
        config = {
            **{k: v for k, v in ARCHS[self.arch].items() if k != "permuted"},
            "hidden_size": hidden,
            "intermediate_size": self._arch_get("feed_forward_length"),
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_head,
            "num_key_value_heads": n_kv,
            "rms_norm_eps": _short_float(self._arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": theta,
            "vocab_size": vocab,
            "max_position_embeddings": self._arch_get("context_length", 4096),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "hidden_act": "silu",
        }
        if self.arch in ("qwen3moe", "olmoe") or any(".switch_mlp." in n for n in self._tensors):
            config.update(self._moe_config(config))
        if head_dim != default_head_dim or self.arch in ("qwen3", "qwen3moe"):
            config["head_dim"] = head_dim  # mlx-lm's qwen3 requires it
        if self.arch in GEMMA:
            config.update(self._gemma_config(hidden, n_head, n_layers, head_dim))
        if self.arch == "granite":  # (each only where the file has it, as llama.cpp reads them)
            for key, field in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                               ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
                if self._arch_get(key):
                    config[field] = _short_float(self._arch_get(key))
        if self.arch == "falcon":
            config.update(self._falcon_config(n_kv))
        if self.arch in ("phi2", "phi3", "persimmon"):  # (the rotated share of each head)
            config["partial_rotary_factor"] = self._arch_get("rope.dimension_count", head_dim) / head_dim
        if self.arch == "phi3":
            config.update(self._phi3_longrope())
            if self._arch_get("attention.sliding_window"):  # (every layer's, as from the folder)
                config["sliding_window"] = self._arch_get("attention.sliding_window")
        if self.arch in ("phi2", "persimmon"):
            config.update(layer_norm_eps=_short_float(self._arch_get("attention.layer_norm_epsilon", 1e-5)),
                          hidden_act="gelu_new" if self.arch == "phi2" else "relu2", tie_word_embeddings=False)
        if self.arch == "persimmon":
            config["qk_layernorm"] = "model.layers.0.self_attn.q_layernorm.weight" in self._tensors
        if self.arch in ("llama", "granite"):
            config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self._tensors
            config["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in self._tensors

        scaling = self._arch_get("rope.scaling.type")
        if scaling == "linear":
            factor = _short_float(self._arch_get("rope.scaling.factor"))
            config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif scaling not in (None, "none") and not (scaling in ("longrope", "su") and "rope_scaling" in config):
            raise FlashError(f"{self.path.name}: RoPE scaling '{scaling}' is not supported")
        if rope_freqs is not None:
            freqs = self._gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float64)
            config["rope_scaling"] = llama3_rope_scaling(freqs, theta, head_dim)
            if config["rope_scaling"] is None:
                raise FlashError(
                    f"{self.path.name}: its rope_freqs tensor matches no Llama 3 RoPE scaling we know"
                )

        for key, gguf_key in (("bos", "bos"), ("pad", "padding"), ("unk", "unknown")):
            tid = self._get(f"tokenizer.ggml.{gguf_key}_token_id")
            if tid is not None:
                config[f"{key}_token_id"] = tid
        eos = self._eos_ids()
        if eos:
            config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        return config

    def _gemma_config(self, hidden, n_head, n_layers, head_dim):
        """Gemma 2 / 3 fields llama.cpp keeps in its own code rather than in the file."""
        config = {
            "head_dim": head_dim,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hidden // n_head if n_layers == GEMMA_27B_LAYERS[self.arch] else head_dim,
        }
        window = self._arch_get("attention.sliding_window")
        if window:
            config["sliding_window"] = window
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if self._arch_get(key) is not None:  # (absent: the family's defaults, llama.cpp's too)
                config[key] = _short_float(self._arch_get(key))
        if self.arch == "gemma3":
            config["rope_local_base_freq"] = 10000.0
            pattern = self._arch_get("attention.sliding_window_pattern")
            if isinstance(pattern, list):  # (newer files: whether each layer is a sliding one)
                config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                config["sliding_window_pattern"] = 6
        return config

    def _moe_config(self, config):
        """A mixture's fields: its experts, how many a token takes, their size; a llama GGUF with
        experts is Mixtral."""
        experts = self._arch_get("expert_count")
        if not experts:
            raise FlashError(f"{self.path.name}: a {self.arch} GGUF with experts but no {self.arch}.expert_count")
        out = {EXPERT_KEYS[self.arch]: experts, "num_experts_per_tok": self._arch_get("expert_used_count")}
        if self.arch == "llama":
            out.update(MIXTRAL)
        elif self.arch == "olmoe":
            out["norm_topk_prob"] = False
        else:  # qwen3moe
            out.update(moe_intermediate_size=self._arch_get("expert_feed_forward_length"), norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[])
            out["intermediate_size"] = config["intermediate_size"] or out["moe_intermediate_size"]
        return out

    def _falcon_config(self, n_kv):
        """Falcon's fields as transformers names them. Every Falcon llama.cpp runs has a parallel
        block; its q/k/v are read back in the grouped layout (new_decoder_architecture: each kv
        head's queries, key, value), one kv head's group for the multi-query 7B; a second
        LayerNorm (attn_norm_2) is the FFN's."""
        has = self._tensors.__contains__
        return {"num_kv_heads": n_kv, "new_decoder_architecture": True, "parallel_attn": True,
                "num_ln_in_parallel_attn": 2 if has("model.layers.0.post_attention_layernorm.weight") else 1,
                "bias": has("model.layers.0.self_attn.query_key_value.bias"), "alibi": False,
                "ffn_hidden_size": self.shape("model.layers.0.mlp.dense_h_to_4h.weight")[0], "activation": "gelu",
                "layer_norm_epsilon": _short_float(self._arch_get("attention.layer_norm_epsilon", 1e-5))}

    def _phi3_longrope(self):
        """Phi-3's LongRoPE, from its factors' tensors, where the file has them."""
        config = {}
        if self._rope_factors:
            if set(self._rope_factors) != {"rope_factors_long", "rope_factors_short"}:
                raise FlashError(f"{self.path.name}: a Phi-3 GGUF with {', '.join(self._rope_factors)} but not both "
                                 "rope_factors_long and rope_factors_short")
            factors = {k: self._gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).tolist()
                       for k, t in self._rope_factors.items()}
            config["rope_scaling"] = {"type": "longrope", "long_factor": factors["rope_factors_long"],
                                      "short_factor": factors["rope_factors_short"]}
            config["original_max_position_embeddings"] = self._arch_get("rope.scaling.original_context_length", 4096)
        return config

    def _eos_ids(self):
        """End-of-generation ids: eos, plus end-of-turn/-message where they differ (Llama 3 instruct)."""
        ids = []
        for key in ("eos", "eot", "eom"):
            tid = self._get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and tid not in ids:
                ids.append(tid)
        return ids

    def _check_tokenizer(self):
        """Refuse early what write_tokenizer cannot rebuild, before any tensor is converted."""
        model = self._get("tokenizer.ggml.model")
        if model is None:
            raise FlashError(f"{self.path.name}: GGUF has no tokenizer metadata (tokenizer.ggml.model)")
        if model not in ("gpt2", "llama"):
            raise FlashError(f"{self.path.name}: GGUF tokenizer '{model}' is not supported (byte-level BPE, "
                             "'gpt2', and SentencePiece BPE, 'llama')")
        pre = self._get("tokenizer.ggml.pre", "default")
        if model == "gpt2" and pre not in PRE_TOKENIZERS:
            raise FlashError(
                f"{self.path.name}: GGUF pre-tokenizer '{pre}' is not supported "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )

    # --- tensors ---

    def names(self):
        return list(self._order)

    def shape(self, name):
        # GGUF lists dims innermost first: [in, out] for a linear weight.
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def _falcon_qkv_rows(self):
        """The file's attn_qkv rows (all q, all k, all v) in Falcon's grouped order: for each kv
        head, its queries' rows, its key's, its value's."""
        n, kv = self.config["num_attention_heads"], self.config["num_kv_heads"]
        hd = self.config["hidden_size"] // n
        heads = np.arange(n * hd).reshape(kv, n // kv, hd)
        keys = n * hd + np.arange(kv * hd).reshape(kv, 1, hd)
        return np.concatenate([heads, keys, keys + kv * hd], axis=1).reshape(-1)

    def _unpermute(self, name, w):
        if self.arch == "falcon" and ".query_key_value." in name:
            return w[self._falcon_qkv_rows()]
        if ARCHS[self.arch]["permuted"]:
            if ".self_attn.q_proj." in name:
                return unpermute(w, self.config["num_attention_heads"])
            if ".self_attn.k_proj." in name:
                return unpermute(w, self.config["num_key_value_heads"])
        return w

    def read(self, name):
        t = self._tensors[name]
        w = self._gguf.quants.dequantize(t.data, t.tensor_type)
        # F32 comes back as a view of the mmap: copy so the caller owns its array.
        w = np.array(w, dtype=np.float32, copy=t.tensor_type.name == "F32")
        w = w.reshape(self.shape(name))
        if self.arch in GEMMA and name.endswith("norm.weight"):
            w = w - np.float32(1)  # (exact for w >= 0.5: a Gemma norm is read back as the file's w)
        return np.ascontiguousarray(self._unpermute(name, w))

    def quant(self, name):
        """The QuantSpec of a tensor stored in a block type with an exact MLX form, else None."""
        from ..layout.quant import QuantSpec

        kind = self._tensors[name].tensor_type.name
        if kind in kquants.BITS:
            return QuantSpec(kquants.BITS[kind], 32, "float16")
        if kind not in EXACT_BLOCKS:
            return None
        return QuantSpec(EXACT_BLOCKS[kind][2], 32, "float16")

    def lossy(self, name):
        """The GGUF type of a quantized tensor with no exact MLX form (re-quantized), else None."""
        kind = self._tensors[name].tensor_type.name
        return None if kind in EXACT_BLOCKS or kind in kquants.BITS or kind in ("F32", "F16", "BF16") else kind

    def read_quantized(self, name):
        """A Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K tensor -> QuantTensor with the file's
        values, repacked."""
        from ..layout.quant import pack, to_words

        t = self._tensors[name]
        *lead, n = self.shape(name)  # ([E,] out, in: merged experts are one tensor)
        rows = int(np.prod(lead))
        if t.tensor_type.name in kquants.BITS:
            return self._read_kquant(name, t, lead, rows, n)
        head, body, bits, offset = EXACT_BLOCKS[t.tensor_type.name]
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, n // 32, head + body)
        d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        qs = blocks[..., head:]
        if body == 20:  # Q5_x: bit j of the little-endian word qh is value j's fifth bit
            qh = np.ascontiguousarray(qs[..., :4]).view("<u4")[..., 0]
            high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            q = np.concatenate([qs[..., 4:] & 0x0F, qs[..., 4:] >> 4], axis=-1) | (high << 4)
        elif bits == 4:  # byte j holds value j (low nibble) and value j + 16 (high nibble)
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        else:  # int8 -> unsigned
            q = (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        if offset is None:  # Q4_1: x = d * q + m
            bias = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        else:
            with np.errstate(over="raise"):
                try:
                    bias = (-float(abs(offset)) * d.astype(np.float32)).astype(np.float16)
                except FloatingPointError:
                    bias = None
            if bias is None or not np.isfinite(bias).all() or not np.array_equal(
                    bias.astype(np.float32), -abs(offset) * d.astype(np.float32)):
                raise FlashError(f"{self.path.name}: tensor {t.name} has a block scale too large to "
                                 "keep exactly at float16; convert with --dequantize")
        packed = to_words(pack(q.reshape(rows, n), bits))
        return self._quant_tensor(name, packed, d, bias, lead)

    def _read_kquant(self, name, t, lead, rows, n):
        """A Q4_K / Q5_K tensor -> QuantTensor: its values, each group's scale and bias at float16."""
        from ..layout.quant import pack, to_words

        q, scales, biases = kquants.affine_groups(t.tensor_type.name, t.data, rows, n)
        with np.errstate(over="ignore"):
            s16, b16 = scales.astype(np.float16), biases.astype(np.float16)
        if not (np.isfinite(s16).all() and np.isfinite(b16).all()):
            raise FlashError(f"{self.path.name}: tensor {t.name} has a block scale beyond float16's range; "
                             "convert with --dequantize")
        packed = to_words(pack(q, self.quant(name).bits))
        return self._quant_tensor(name, packed, s16, b16, lead)

    def _quant_tensor(self, name, packed, scales, biases, lead):
        from ..layout.quant import QuantTensor

        w = QuantTensor(packed, np.ascontiguousarray(scales), np.ascontiguousarray(biases), self.quant(name))
        if len(lead) > 1:  # merged experts: [E, out, ...]
            return QuantTensor(*(a.reshape(*lead, -1) for a in (w.packed, w.scales, w.biases)), w.spec)
        return w.rows(lambda a: self._unpermute(name, a))

    # --- tokenizer ---

    def _sentencepiece(self):
        return self._get("tokenizer.ggml.model") == "llama"

    def _add_bos(self):
        """tokenizer.ggml.add_bos_token, else llama.cpp's default: SentencePiece vocabularies and
        the Llama 3 / Tekken pre-tokenizers add one."""
        default = self._sentencepiece() or PRE_TOKENIZERS[self._get("tokenizer.ggml.pre", "default")][2]
        return bool(self._get("tokenizer.ggml.add_bos_token", default))

    def _build_tokenizer(self, tokens):
        types = self._get("tokenizer.ggml.token_type") or [1] * len(tokens)
        bos = self._get("tokenizer.ggml.bos_token_id") if self._add_bos() else None
        if self._sentencepiece():
            scores = self._get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise FlashError(f"{self.path.name}: a SentencePiece GGUF vocabulary without a score per token")
            return sentencepiece_bpe(tokens, types, scores, bos,
                                     bool(self._get("tokenizer.ggml.add_space_prefix", True)))
        return byte_level_bpe(tokens, types, self._get("tokenizer.ggml.merges") or [],
                              self._get("tokenizer.ggml.pre", "default"), bos)

    def write_tokenizer(self, out_dir):
        out_dir = Path(out_dir)
        tokens = self._get("tokenizer.ggml.tokens")
        tk = self._build_tokenizer(tokens)
        tk.save(str(out_dir / "tokenizer.json"))

        special = {}
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
            tid = self._get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and 0 <= tid < len(tokens):
                special[f"{name}_token"] = tokens[tid]

        tokenizer_config = {
            # the generic class: it takes tokenizer.json as is, with no per-model rewriting
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": self._add_bos(),
            "add_eos_token": bool(self._get("tokenizer.ggml.add_eos_token", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": self.config["max_position_embeddings"],
        }
        template = self._get("tokenizer.chat_template")
        if template:
            tokenizer_config["chat_template"] = template
        _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
        _write_json(out_dir / "special_tokens_map.json", special)

        keys = ("bos_token_id", "eos_token_id", "pad_token_id")
        generation = {k: self.config[k] for k in keys if k in self.config}
        _write_json(out_dir / "generation_config.json", generation)

    def close(self):
        # Dropping the reader drops the memory map (the tensor views hold it until then).
        self._tensors = {}
        self._reader = None
        self._meta = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")

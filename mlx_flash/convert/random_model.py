"""Checkpoints of real model shapes with random weights: for the benchmarks (`mlx_flash.benchmark
paper`, `batch`, `moe`), the machine probe's models (plan/measure.py) and the tests.

The paper measures OPT-6.7B (and Falcon 7B, Llama 2 7B...). For I/O and compute timings
only the shapes matter:
`RandomSource` is a converter source (config, tensor names, float32 tensors in
Hugging Face orientation) whose tensors are seeded Gaussian noise (std 0.02,
norms 1, biases 0), and `build_checkpoint` runs the real converter on it once
into $MLX_FLASH_HOME/bench/<shape>-<dtype> (atomic: an interrupted build
leaves nothing behind and is started again by the next run).
"""

import json
import zlib
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..models.moe import MODEL_TYPES as MOE_TYPES

OPT = dict(model_type="opt", architectures=["OPTForCausalLM"], activation_function="relu",
           do_layer_norm_before=True, enable_bias=True, tie_word_embeddings=True,
           max_position_embeddings=2048, bos_token_id=2, eos_token_id=2)
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)

SHAPES = {
    "opt-6.7b": dict(OPT, hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                     num_attention_heads=32, vocab_size=50272),
    "opt-1.3b": dict(OPT, hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                     num_attention_heads=32, vocab_size=50272),
    "opt-125m": dict(OPT, hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
                     num_attention_heads=12, vocab_size=50272),
    # Llama 2 sparsified with FATReLU, as in the paper's Table 3 (threshold 0.01)
    "llama-2-7b": dict(LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       hidden_act="fatrelu", fatrelu_threshold=0.01),
    # the machine profile's per-layer overhead probe (plan/measure.py), and tests
    "tiny-llama": dict(LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=512, hidden_act="silu",
                       max_position_embeddings=256),
    # the per-layer overhead probe at a small model's width (SmolLM2-135M's layer, a tiny vocabulary)
    "probe-576": dict(LLAMA, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, vocab_size=512, hidden_act="silu",
                      max_position_embeddings=256),
    # for tests
    "tiny-opt": dict(OPT, hidden_size=64, ffn_dim=512, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=512, max_position_embeddings=256),
}
QWEN3_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], rms_norm_eps=1e-6,
                 rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], bos_token_id=1, eos_token_id=2)
MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], rms_norm_eps=1e-5, rope_theta=1000000.0,
               max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu", bos_token_id=1,
               eos_token_id=2)
# mixtures of experts (benchmark moe): their real shapes, and a tiny one for tests
SHAPES.update({
    "qwen3-30b-a3b": dict(QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, vocab_size=151936),
    "mixtral-8x7b": dict(MIXTRAL, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000),
    # a model of a few hundred MB for the tests under a memory cgroup
    "small-moe": dict(QWEN3_MOE, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      num_experts=64, num_experts_per_tok=4, vocab_size=512, max_position_embeddings=512),
    "tiny-moe": dict(QWEN3_MOE, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     num_experts=16, num_experts_per_tok=4, vocab_size=512, max_position_embeddings=256),
})
# the two probes at 36 layers: the per-layer cost is the slope between 4 and 36 layers, what a
# token costs once (embedding, lm_head, sampling, Python) the rest (plan/measure.py)
for _probe in ("tiny-llama", "probe-576"):
    SHAPES[f"{_probe}-36"] = dict(SHAPES[_probe], num_hidden_layers=36)


def tensor_shapes(cfg):
    """{HF name: shape} of a checkpoint of this config (OPTForCausalLM / LlamaForCausalLM)."""
    d, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    t = {}
    if cfg["model_type"] == "opt":
        f, p = cfg["ffn_dim"], "model.decoder."
        t[p + "embed_tokens.weight"] = (V, d)
        t[p + "embed_positions.weight"] = (cfg["max_position_embeddings"] + 2, d)
        t[p + "final_layer_norm.weight"] = t[p + "final_layer_norm.bias"] = (d,)
        for i in range(L):
            q = f"{p}layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                t[q + f"self_attn.{name}.weight"] = (d, d)
                t[q + f"self_attn.{name}.bias"] = (d,)
            for ln in ("self_attn_layer_norm", "final_layer_norm"):
                t[q + ln + ".weight"] = t[q + ln + ".bias"] = (d,)
            t[q + "fc1.weight"], t[q + "fc1.bias"] = (f, d), (f,)
            t[q + "fc2.weight"], t[q + "fc2.bias"] = (d, f), (d,)
        return t
    if cfg["model_type"] in MOE_TYPES:
        return _moe_shapes(cfg)
    f, kv = cfg["intermediate_size"], cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]
    t["model.embed_tokens.weight"] = (V, d)
    t["model.norm.weight"] = (d,)
    t["lm_head.weight"] = (V, d)
    for i in range(L):
        q = f"model.layers.{i}."
        t[q + "self_attn.q_proj.weight"] = t[q + "self_attn.o_proj.weight"] = (d, d)
        t[q + "self_attn.k_proj.weight"] = t[q + "self_attn.v_proj.weight"] = (kv, d)
        t[q + "mlp.gate_proj.weight"] = t[q + "mlp.up_proj.weight"] = (f, d)
        t[q + "mlp.down_proj.weight"] = (d, f)
        t[q + "input_layernorm.weight"] = t[q + "post_attention_layernorm.weight"] = (d,)
    return t


def _moe_shapes(cfg):
    """{HF name: shape} of a mixture-of-experts checkpoint (one tensor per expert, as HF stores it)."""
    from ..models.moe import BLOCK, ModelArgs, expert_tensors

    args = ModelArgs.from_dict(cfg)
    d, hd = args.hidden_size, args.head_dim or args.hidden_size // args.num_attention_heads
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    t = {"model.embed_tokens.weight": (args.vocab_size, d), "model.norm.weight": (d,),
         "lm_head.weight": (args.vocab_size, d)}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"], t[p + "self_attn.o_proj.weight"] = (q, d), (d, q)
        t[p + "self_attn.k_proj.weight"] = t[p + "self_attn.v_proj.weight"] = (kv, d)
        if args.qk_norm is True:
            t[p + "self_attn.q_norm.weight"] = t[p + "self_attn.k_norm.weight"] = (hd,)
        t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = (d,)
        t[p + f"{BLOCK[args.model_type]}.gate.weight"] = (args.n_experts, d)
        for kind, (_, names) in expert_tensors(args, i).items():
            for name in names:
                t[name] = (d, args.d_expert) if kind == "down" else (args.d_expert, d)
    return t


def shape_config(shape):
    if shape not in SHAPES:
        raise FlashError(f"unknown shape '{shape}' (available: {', '.join(SHAPES)})")
    return dict(SHAPES[shape])


def parameter_count(shape):
    return sum(int(np.prod(s)) for s in tensor_shapes(shape_config(shape)).values())


class RandomSource:
    """A converter source: the tensors of `shape`, seeded noise, made when read.

    bits: the 2-D weights are random `bits`-bit values (group 64, float16 scales and biases that
    spread them over about +-2.5 std) held as an mlx-lm quantized folder holds them, kept as they
    are by the converter: a checkpoint of tens of GB is then written at the disk's pace, with no
    float weights to draw and quantize."""

    def __init__(self, shape, seed=0, std=0.02, bits=None):
        self.config = shape_config(shape)
        self.shapes = tensor_shapes(self.config)
        self.seed, self.std, self.bits = seed, std, bits
        self.name = f"random:{shape}:seed{seed}" + (f":q{bits}" if bits else "")

    def quant(self, name):
        from ..layout.quant import QuantSpec

        if self.bits is None or len(self.shapes[name]) != 2:
            return None
        return QuantSpec(self.bits, 64, "float16")

    def read_quantized(self, name):
        from ..layout.quant import QuantTensor

        out, n_in = self.shapes[name]
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        packed = rng.integers(0, 2**32, size=(out, n_in * self.bits // 32), dtype=np.uint32)
        scale = np.float16(5 * self.std / (2**self.bits - 1))
        scales = np.full((out, n_in // 64), scale, dtype=np.float16)
        biases = np.full((out, n_in // 64), np.float16(-2.5 * self.std), dtype=np.float16)
        return QuantTensor(packed, scales, biases, self.quant(name))

    def names(self):
        return list(self.shapes)

    def shape(self, name):
        return self.shapes[name]

    def read(self, name):
        shape = self.shapes[name]
        if len(shape) == 1:
            base = name.rsplit(".", 1)[-1]
            return np.ones(shape, np.float32) if base == "weight" else np.zeros(shape, np.float32)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= self.std
        return x

    def write_tokenizer(self, out_dir):
        write_byte_tokenizer(out_dir, self.config["vocab_size"])

    def close(self):
        pass


def write_byte_tokenizer(folder, vocab_size):
    """A byte-level tokenizer (256 byte tokens + an end token) for random checkpoints:
    mlx_flash.load wants one; the benchmark feeds token ids directly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["</s>"] = len(vocab)
    if vocab_size < len(vocab):
        raise FlashError(f"vocab_size {vocab_size} is too small for a byte tokenizer")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "bos_token": "</s>"}))


def checkpoint_dir(shape, dtype, home=None):
    from ..home import default_home

    return Path(home or default_home()) / "bench" / f"{shape}-{dtype}"


QUANTIZED = {"q4": 4, "q8": 8}  # checkpoint dtypes that are group-wise quantized (group 64)


def build_checkpoint(shape, dtype="float16", home=None, progress=True, seed=0):
    """The flash-layout checkpoint of `shape` with random weights; built once, then reused.
    dtype q4 / q8: quantized as mlx_lm.convert -q would (group 64, float16 scales)."""
    from .convert import convert
    from .quantize import QuantOptions

    quant = None
    if dtype in QUANTIZED:
        quant = QuantOptions(quantize=True, bits=QUANTIZED[dtype], group_size=64)
    if shape_config(shape)["model_type"] in MOE_TYPES:  # random values at their bits (RandomSource)
        if dtype not in QUANTIZED:
            raise FlashError(f"{shape}: the mixture-of-experts shapes are built at q4 or q8")
        return convert(RandomSource(shape, seed=seed, bits=QUANTIZED[dtype]), checkpoint_dir(shape, dtype, home),
                       dtype="float16", progress=progress)
    return convert(RandomSource(shape, seed=seed), checkpoint_dir(shape, dtype, home),
                   dtype="float16" if quant else dtype, progress=progress, quant=quant)



def write_mlx_lm_folder(shape, folder, bits=4, seed=0, shard_bytes=4 << 30, progress=True):
    """A random mixture of experts as an mlx-lm folder holds it (`mlx_lm.convert -q`'s form: every
    2-D weight quantized at `bits`, group 64, float16 scales; a layer's experts of one kind stacked as
    `switch_mlp.<kind>_proj` [E, out, in]), in safetensors shards of about `shard_bytes`: the input
    a user converts. Its values are RandomSource(shape, seed, bits)'s, so that converting it gives
    build_checkpoint(shape, "q<bits>")'s files. Written tensor by tensor (one layer's stacked kind at
    a time) into `folder`.partial, then renamed: an interrupted run leaves no folder."""
    import shutil

    from ..layout.safetensors_io import SafetensorsWriter
    from ..models.moe import ModelArgs, expert_tensors
    from .writer import _progress

    if bits not in QUANTIZED.values():
        raise FlashError(f"bits {bits}: the random mlx-lm folders are written at 4 or 8 bits")
    src = RandomSource(shape, seed=seed, bits=bits)
    cfg = src.config
    if cfg["model_type"] not in MOE_TYPES:
        raise FlashError(f"{shape}: not a mixture-of-experts shape")
    args = ModelArgs.from_dict(cfg)
    stacks = {}  # stacked name -> its experts' per-expert names
    for i in range(args.num_hidden_layers):
        for name, per_expert in (expert_tensors(args, i) or {}).values():
            stacks[name] = per_expert
    in_stacks = {n for names in stacks.values() for n in names}
    tensors = []  # (name, shape, dtype, source tensor or stack, part)
    for name in src.names():
        if name in in_stacks:
            continue
        shp = src.shape(name)
        if src.quant(name) is None:
            tensors.append((name, shp, "float16", name, None))
        else:
            tensors += _quantized_parts(name, shp, name, bits)
    for name, per_expert in stacks.items():
        out, n_in = src.shape(per_expert[0])
        tensors += _quantized_parts(name, (len(per_expert), out, n_in), name, bits)

    def produce(key):
        if key in stacks:
            parts = [src.read_quantized(n) for n in stacks[key]]
            return [np.stack([getattr(p, a) for p in parts]) for a in ("packed", "scales", "biases")]
        if src.quant(key) is None:
            return src.read(key)
        q = src.read_quantized(key)
        return [q.packed, q.scales, q.biases]

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    nbytes = [int(np.prod(t[1])) * (4 if t[2] == "uint32" else 2) for t in tensors]
    shards, size = [[]], 0
    for t, n in zip(tensors, nbytes):
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    bar = _progress(sum(nbytes), progress, f"write {shape}")
    weight_map, held = {}, (None, None)  # (the producer's last key, its arrays)
    for j, shard in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        w = SafetensorsWriter(tmp / fname, [t[:3] for t in shard], metadata={"format": "mlx"})
        for name, _, _, key, part in shard:
            if held[0] != key:
                held = (key, produce(key))
            array = held[1] if part is None else held[1][part]
            w.write(name, array)
            weight_map[name] = fname
            bar.update(array.nbytes)
        w.close()
    bar.close()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(dict(cfg, quantization={"group_size": 64, "bits": bits}), indent=1))
    write_byte_tokenizer(tmp, cfg["vocab_size"])
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _quantized_parts(name, shape, key, bits):
    """A quantized weight's three tensors in an mlx-lm folder: (name, shape, dtype, key, part)."""
    stem, lead, (out, n_in) = name[: -len("weight")], tuple(shape[:-2]), shape[-2:]
    return [(name, lead + (out, n_in * bits // 32), "uint32", key, 0),
            (stem + "scales", lead + (out, n_in // 64), "float16", key, 1),
            (stem + "biases", lead + (out, n_in // 64), "float16", key, 2)]

"""GGUFSource: names, shapes, config, dequantization, q/k un-permutation, tokenizer.

A tiny llama GGUF is written with gguf.GGUFWriter the way llama.cpp's
convert_hf_to_gguf.py writes one (q/k rows permuted, mixed tensor types), so
these run offline in a few seconds. One test uses the real SmolLM2 GGUF when
it is on disk.
"""

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mlx_flash.convert.gguf import GGUFSource, llama3_rope_scaling, unpermute
from mlx_flash.errors import FlashError

ROOT = Path(__file__).resolve().parent.parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = [
    "Hello world, hello tokens!",
    "In 2024 there were 366 days.",
    "Ünïcödé ß 日本 🎉",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  two spaces\n\tand a tab",
]

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS

# (GGUF base name, HF suffix, shape, GGUF type): a mix of every type the converter must read
LAYER_TENSORS = [
    ("attn_norm", "input_layernorm", (HIDDEN,), T.F32),
    ("attn_q", "self_attn.q_proj", (HEADS * HEAD_DIM, HIDDEN), T.Q8_0),
    ("attn_k", "self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN), T.Q4_0),
    ("attn_v", "self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN), T.Q4_1),
    ("attn_output", "self_attn.o_proj", (HIDDEN, HEADS * HEAD_DIM), T.F16),
    ("ffn_norm", "post_attention_layernorm", (HIDDEN,), T.F32),
    ("ffn_gate", "mlp.gate_proj", (FFN, HIDDEN), T.Q4_1),
    ("ffn_up", "mlp.up_proj", (FFN, HIDDEN), T.Q8_0),
    ("ffn_down", "mlp.down_proj", (HIDDEN, FFN), T.Q4_0),
]


def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def train_tokenizer():
    """A ~300-token byte-level BPE (SmolLM-style: digits split) trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens", "366 days"] * 20
    tk.train_from_iterator(corpus, trainer)
    spec = json.loads(tk.to_str())["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    return tk, [t for t, _ in vocab], merges


def write_gguf(path, arch="llama", tied=False, extra=None, add_bos=False, split_count=None, pre="smollm"):
    """A 2-layer GGUF as llama.cpp would write it; returns the HF-orientation originals and the stored tensors."""
    rng = np.random.default_rng(0)
    _, tokens, merges = train_tokenizer()
    vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if split_count:
        w.add_uint16("split.count", split_count)
    w.add_chat_template(CHATML)

    originals, stored = {}, {}

    def add(gguf_name, hf, shape, qtype):
        x = rng.normal(0, 0.5, size=shape).astype(np.float32)
        if hf.endswith("norm.weight"):
            x = 1 + 0.1 * x
        originals[hf] = x
        if arch == "llama" and ".attn_q." in gguf_name:
            x = permute(x, HEADS)
        elif arch == "llama" and ".attn_k." in gguf_name:
            x = permute(x, KV_HEADS)
        data = gguf.quants.quantize(x, qtype)
        stored[hf] = (data, qtype)
        w.add_tensor(gguf_name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), T.F16)
    for i in range(LAYERS):
        for base, hf, shape, qtype in LAYER_TENSORS:
            add(f"blk.{i}.{base}.weight", f"model.layers.{i}.{hf}.weight", shape, qtype)
        if arch == "qwen2":
            for x, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(f"blk.{i}.attn_{x}.bias", f"model.layers.{i}.self_attn.{x}_proj.bias", (heads * HEAD_DIM,), T.F32)
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", f"model.layers.{i}.self_attn.q_norm.weight", (HEAD_DIM,), T.F32)
            add(f"blk.{i}.attn_k_norm.weight", f"model.layers.{i}.self_attn.k_norm.weight", (HEAD_DIM,), T.F32)
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), T.F32)
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, HIDDEN), T.BF16)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals, stored


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    originals, stored = write_gguf(path)
    return path, originals, stored


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    for n_head in (1, 2, 3, 4, 6):
        if w.shape[0] % (2 * n_head) == 0:
            assert np.array_equal(unpermute(permute(w, n_head), n_head), w)
    b = np.arange(48, dtype=np.float32)  # biases are permuted too
    assert np.array_equal(unpermute(permute(b, 4), 4), b)


def test_config_names_shapes(llama_gguf):
    path, originals, _ = llama_gguf
    with GGUFSource(path) as src:
        c = src.config
        assert c["model_type"] == "llama" and c["architectures"] == ["LlamaForCausalLM"]
        assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
        assert (c["num_attention_heads"], c["num_key_value_heads"]) == (HEADS, KV_HEADS)
        assert c["vocab_size"] == 300 and c["max_position_embeddings"] == 256
        assert c["rms_norm_eps"] == 1e-6 and c["rope_theta"] == 10000.0
        assert c["tie_word_embeddings"] is False and c["hidden_act"] == "silu"
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 2)
        assert "head_dim" not in c
        json.dumps(c)  # plain Python types only
        assert sorted(src.names()) == sorted(originals)
        assert src.names()[0] == "model.embed_tokens.weight" and src.names()[-1] == "lm_head.weight"
        for name, x in originals.items():
            assert src.shape(name) == x.shape


def test_read_dequantizes_and_unpermutes(llama_gguf):
    path, originals, stored = llama_gguf
    tolerance = {T.Q8_0: 0.01, T.Q4_0: 0.15, T.Q4_1: 0.1, T.BF16: 0.01}  # relative to max |w|
    with GGUFSource(path) as src:
        for name, original in originals.items():
            data, qtype = stored[name]
            got = src.read(name)
            assert got.dtype == np.float32 and got.shape == original.shape and got.flags.c_contiguous
            if qtype == T.F32:
                assert np.array_equal(got, original)
            elif qtype == T.F16:
                assert np.array_equal(got, original.astype(np.float16).astype(np.float32))
            else:
                # exactly what gguf dequantizes from the stored bytes, with the permutation undone ...
                expected = gguf.quants.dequantize(data, qtype)
                if ".q_proj." in name:
                    expected = unpermute(expected, HEADS)
                elif ".k_proj." in name:
                    expected = unpermute(expected, KV_HEADS)
                assert np.array_equal(got, expected), name
                # ... and so close to the unpermuted original (a permuted read would be far off)
                err = np.abs(got - original).max() / np.abs(original).max()
                assert err < tolerance[qtype], (name, err)


def test_read_returns_owned_arrays(llama_gguf):
    path, originals, _ = llama_gguf
    src = GGUFSource(path)
    norm = src.read("model.norm.weight")  # F32: must not be a view of the memory map
    norm[:] = 0
    assert np.array_equal(src.read("model.norm.weight"), originals["model.norm.weight"])
    src.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_archs_are_not_permuted(tmp_path, arch):
    originals, stored = write_gguf(tmp_path / f"{arch}.gguf", arch=arch, tied=True)
    with GGUFSource(tmp_path / f"{arch}.gguf") as src:
        assert src.config["model_type"] == arch and src.config["tie_word_embeddings"] is True
        assert "lm_head.weight" not in src.names()
        assert sorted(src.names()) == sorted(originals)
        extra = "model.layers.1.self_attn.k_norm.weight" if arch == "qwen3" else "model.layers.0.self_attn.q_proj.bias"
        assert np.array_equal(src.read(extra), originals[extra])
        if arch == "qwen3":
            assert src.config["head_dim"] == HEAD_DIM
        # stored as is: no q/k row permutation to undo
        q = "model.layers.0.self_attn.q_proj.weight"
        assert np.array_equal(src.read(q), gguf.quants.dequantize(*stored[q]))


def test_write_tokenizer_round_trips(llama_gguf, tmp_path):
    from transformers import AutoTokenizer

    reference, _, _ = train_tokenizer()
    path, _, _ = llama_gguf
    with GGUFSource(path) as src:
        src.write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (tmp_path / name).is_file()
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2

    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tok.unk_token, tok.pad_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.eos_token_id == 2 and len(tok) == 300
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text).ids, text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user")[0] == 1  # control tokens stay whole
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"

    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_token_adds_exactly_one(tmp_path):
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "bos.gguf", add_bos=True)
    with GGUFSource(tmp_path / "bos.gguf") as src:
        src.write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok.encode("hello")
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "tekken", "smollm"])
def test_pre_tokenizers(tmp_path, pre):
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "t.gguf", pre=pre, add_bos=None)
    with GGUFSource(tmp_path / "t.gguf") as src:
        src.write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # with no add_bos_token in the file, llama.cpp adds BOS for Llama 3 and Tekken vocabularies only
    assert (tok.encode("hi")[0] == 1) == (pre in ("llama-bpe", "tekken"))


def test_tokenizer_loads_in_mlx_lm(llama_gguf, tmp_path):
    from mlx_lm.tokenizer_utils import load

    path, _, _ = llama_gguf
    with GGUFSource(path) as src:
        src.write_tokenizer(tmp_path)
    wrapper = load(tmp_path)
    assert type(wrapper.detokenizer).__name__ == "BPEStreamingDetokenizer"
    ids = wrapper.apply_chat_template([{"role": "user", "content": "hello 42"}], add_generation_prompt=True)
    assert ids[0] == 1 and wrapper.decode(ids).endswith("<|im_start|>assistant\n")
    assert 2 in wrapper.eos_token_ids


def test_llama3_rope_freqs_are_recognised():
    theta, head_dim, factor = 500000.0, 64, 8.0
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv
    # llama.cpp's LlamaModel.generate_extra_tensors for Llama 3.1
    freqs = []
    for wl in wavelen:
        if wl < 8192 / 4:
            freqs.append(1.0)
        elif wl > 8192 / 1:
            freqs.append(factor)
        else:
            smooth = (8192 / wl - 1) / (4 - 1)
            freqs.append(1 / ((1 - smooth) / factor + smooth))
    scaling = llama3_rope_scaling(np.array(freqs), theta, head_dim)
    assert scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert llama3_rope_scaling(np.array(freqs) * 1.5, theta, head_dim) is None


# --- errors ---


def test_missing_file(tmp_path):
    with pytest.raises(FlashError, match="no such GGUF file"):
        GGUFSource(tmp_path / "nope.gguf")


def test_wrong_magic(llama_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    data = bytearray(llama_gguf[0].read_bytes())
    data[:4] = b"GGML"
    bad.write_bytes(bytes(data))
    with pytest.raises(FlashError, match="not a readable GGUF"):
        GGUFSource(bad)


@pytest.mark.parametrize("keep", [0.2, 0.9, 0.999])
def test_truncated(llama_gguf, tmp_path, keep):
    data = llama_gguf[0].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(FlashError, match="GGUF"):
        GGUFSource(bad)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bloom.gguf"
    w = gguf.GGUFWriter(str(path), "bloom")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FlashError, match="unsupported GGUF architecture 'bloom' \\(supported: llama"):
        GGUFSource(path)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "f64.gguf"
    write_gguf(path, tied=True, extra={"blk.0.attn_q.bias": np.zeros(HIDDEN, np.float64)})
    with pytest.raises(FlashError, match="'blk.0.attn_q.bias' has type F64"):
        GGUFSource(path)


def test_split_gguf_is_refused(tmp_path):
    write_gguf(tmp_path / "split.gguf", split_count=3)
    with pytest.raises(FlashError, match="split GGUF"):
        GGUFSource(tmp_path / "split.gguf")


def test_unknown_tensor(tmp_path):
    path = tmp_path / "extra.gguf"
    write_gguf(path, tied=True, extra={"blk.0.mystery.weight": np.zeros(HIDDEN, np.float32)})
    with pytest.raises(FlashError, match="unexpected tensor 'blk.0.mystery.weight'"):
        GGUFSource(path)


# --- the real model (skipped unless the 98 MB file is on disk) ---


def _smollm2_path():
    for p in (os.environ.get("MLX_FLASH_SMOLLM2_GGUF"), ROOT / "models/download/SmolLM2-135M-Instruct.Q4_1.gguf"):
        if p and Path(p).is_file():
            return Path(p)
    return None


@pytest.mark.skipif(_smollm2_path() is None, reason="SmolLM2-135M-Instruct.Q4_1.gguf not downloaded")
def test_real_smollm2(tmp_path):
    from transformers import AutoTokenizer

    with GGUFSource(_smollm2_path()) as src:
        c = src.config
        assert c["model_type"] == "llama"
        assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
        assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (9, 3, 49152)
        assert c["tie_word_embeddings"] is True and c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 100000.0
        assert len(src.names()) == 272 and "lm_head.weight" not in src.names()
        params = sum(int(np.prod(src.shape(n))) for n in src.names())
        assert abs(params - 134.5e6) < 0.1e6
        assert src.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
        q = src.read("model.layers.0.self_attn.q_proj.weight")
        assert q.shape == (576, 576) and np.isfinite(q).all()
        src.write_tokenizer(tmp_path)

    tok = AutoTokenizer.from_pretrained(tmp_path)
    # ids of the original HuggingFaceTB/SmolLM2-135M-Instruct tokenizer
    assert tok.encode("<|im_start|>user\nhi<|im_end|>\n") == [1, 4093, 198, 6004, 2, 198]
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("a 123 b") == [81, 216, 33, 34, 35, 278]  # digits one by one
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")

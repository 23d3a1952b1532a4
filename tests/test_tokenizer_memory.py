"""mlx_flash.tokenizer.load_tokenizer: the same tokens, text and streamed text as mlx_lm's
load, in less resident memory (the construction-only vocabulary copies dropped, the
detokenizer's token table packed). On SmolLM2 (the default model) and Qwen2.5-Coder-1.5B
(skipped where models/qwen2.5-coder-1.5b-instruct has no tokenizer), and a tiny SPM one."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_flash.tokenizer import TokenTable, construction_only, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
QWEN = REPO / "models" / "qwen2.5-coder-1.5b-instruct"
MB = 1e6
# RSS above the imports, after gc and malloc_trim (measured on this machine; the margins
# asked are half the saving measured: SmolLM2 25.4 -> 21.4..22.6 MB, Qwen 124 -> 52 MB)
MARGIN = {"smollm2": 1.5 * MB, "qwen": 36 * MB}

TEXTS = [
    "",
    "Hello, world!",
    "a ,b",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)  # tab\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\r\n",
    "naïve café résumé Ångström straße ﬁ",
    "cafe\u0301 and cafe\u0301s (decomposed: NFC changes them)",
    "你好，世界。日本語のテキスト。한국어 텍스트.",
    "Привет мир. مرحبا بالعالم. नमस्ते",
    "emoji 🙂👍🏽👨‍👩‍👧‍👦🇫🇷 ❤️ 🤖!",
    "   leading spaces, trailing spaces   ",
    "\n\n\nnewlines\n\n  \n",
    "numbers 1234567890 3.14159 -1e-9 0x7fff",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n<|endoftext|>",
    "A" * 300 + " " + "ab" * 200,
    "mixed: x = 'ü' + \"😀\"  # 🐍\n    return {'k': [1, 2, 3]}",
]
CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo 你好 🙂"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "def f(x):\n    return x"}],
]


def _tokenizer_folder(folder):
    if not (folder / "tokenizer.json").exists() or not (folder / "tokenizer_config.json").exists():
        pytest.skip(f"{folder.name}: no tokenizer files (make model / make model-large)")
    return folder


def _eos(folder):
    config = folder / "config.json"
    return json.loads(config.read_text()).get("eos_token_id") if config.exists() else None


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def pair(request):
    """(name, mlx_lm's tokenizer, load_tokenizer's) for one model."""
    from mlx_lm.tokenizer_utils import load

    folder = _tokenizer_folder(SMOLLM2 if request.param == "smollm2" else QWEN)
    ref = load(folder, eos_token_ids=_eos(folder))
    return request.param, ref, load_tokenizer(folder, eos_token_ids=_eos(folder))


def stream(tok, ids):
    """What a generation loop sees: last_segment after each token, then after finalize."""
    d = tok.detokenizer
    out = []
    try:
        for t in ids:
            d.add_token(t)
            out.append(d.last_segment)
        d.finalize()
        out.append(d.last_segment)
    except Exception as e:  # (the same failure on both sides is the same behaviour)
        return ("raised", type(e).__name__)
    return out, d.text, list(d.tokens)


def random_ids(tok, seed, n=64):
    rng = random.Random(seed)
    return [rng.randrange(len(tok)) for _ in range(n)]


def test_what_was_dropped(pair):
    name, ref, tok = pair
    assert isinstance(tok, type(ref)) and type(tok._tokenizer) is type(ref._tokenizer)
    assert type(tok._detokenizer) is type(ref._detokenizer)
    assert isinstance(tok._detokenizer.tokenmap, TokenTable)
    assert list(tok._detokenizer.tokenmap) == list(ref._detokenizer.tokenmap)
    assert tok._detokenizer.tokenmap.nbytes() < 20 * len(tok)  # (the list's str objects: ~60 bytes a token)
    if name == "qwen":  # Qwen2Tokenizer keeps the vocab and merges it was built from
        assert {"_vocab", "_merges"} <= set(vars(ref._tokenizer))
        assert not {"_vocab", "_merges"} & set(vars(tok._tokenizer))
    assert construction_only(tok._tokenizer) == []


def test_attributes_are_the_same(pair):
    _, ref, tok = pair
    for attr in ("eos_token_ids", "chat_template", "has_chat_template", "vocab_size", "bos_token", "eos_token",
                 "bos_token_id", "eos_token_id", "pad_token", "unk_token", "all_special_ids", "has_thinking",
                 "think_start", "think_end", "has_tool_calling", "tool_call_start", "tool_call_end",
                 "structural_markers", "clean_up_tokenization_spaces"):
        assert getattr(tok, attr) == getattr(ref, attr), attr
    assert (ref.tool_parser is None) == (tok.tool_parser is None)
    assert len(tok) == len(ref) and tok.get_vocab() == ref.get_vocab()
    words = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "hello", "Ġthe", "not-a-token-at-all"]
    assert tok.convert_tokens_to_ids(words) == ref.convert_tokens_to_ids(words)
    ids = list(range(0, len(ref), 997)) + [len(ref) - 1]
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


def test_encode_and_decode_are_the_same(pair):
    _, ref, tok = pair
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids)
        raw = dict(clean_up_tokenization_spaces=False)
        assert tok.decode(ids, **raw) == ref.decode(ids, **raw)
    for seed in range(20):
        ids = random_ids(ref, seed)
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_chat_template_is_the_same(pair):
    _, ref, tok = pair
    for messages in CHATS:
        for gen in (True, False):
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == \
                ref.apply_chat_template(messages, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False) == \
                ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def test_streamed_text_is_the_same(pair):
    _, ref, tok = pair
    for text in TEXTS:
        ids = ref.encode(text)
        assert stream(tok, ids) == stream(ref, ids), text
    for messages in CHATS:
        ids = list(ref.apply_chat_template(messages, add_generation_prompt=False))
        assert stream(tok, ids) == stream(ref, ids)
    for seed in range(50):  # broken UTF-8, special tokens mid-stream
        ids = random_ids(ref, 1000 + seed)
        assert stream(tok, ids) == stream(ref, ids)
    past = [len(ref._detokenizer.tokenmap), len(ref._detokenizer.tokenmap) + 5]  # (a padded vocabulary's ids)
    assert stream(tok, ref.encode("a b") + past) == stream(ref, ref.encode("a b") + past)


def test_detokenizers_are_independent(pair):
    _, _, tok = pair
    a, b = tok.detokenizer, tok.detokenizer
    ids = tok.encode("one two three")
    for t in ids:
        a.add_token(t)
    a.finalize()
    assert b.text == "" and b.tokens == [] and a.text.strip() == "one two three"


def _spm_folder(folder):
    """A tiny SentencePiece-style tokenizer (byte fallback, ▁ for spaces): mlx_lm gives it
    the SPM streaming detokenizer, whose table holds bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 5, "hello world, paris is big"],
                            trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return folder


def test_spm_detokenizer(tmp_path):
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, load

    folder = _spm_folder(tmp_path)
    ref, tok = load(folder), load_tokenizer(folder)
    assert isinstance(tok._detokenizer, SPMStreamingDetokenizer)
    assert isinstance(tok._detokenizer.tokenmap, TokenTable)
    assert list(tok._detokenizer.tokenmap) == list(ref._detokenizer.tokenmap)
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == ids
        assert stream(tok, ids) == stream(ref, ids), text
    for seed in range(30):
        ids = random_ids(ref, seed)
        assert stream(tok, ids) == stream(ref, ids)


def test_token_table():
    entries = ["a", "Ġthe", "", None, b"\x00", b"\xff\xfe", "ü你🙂", "\ud800", b""]
    t = TokenTable.pack(entries)
    assert len(t) == len(entries) and list(t) == entries
    assert [t[i] for i in range(-len(entries), 0)] == entries and t[2:6] == entries[2:6]
    assert all(type(t[i]) is type(e) for i, e in enumerate(entries))
    for bad in (len(entries), -len(entries) - 1):
        with pytest.raises(IndexError):
            t[bad]
    assert TokenTable.pack(["a", 3]) is None


def test_construction_only():
    class Built:
        def __init__(self):
            self._table = dict.fromkeys(range(2000))  # used to build, never again
            self._read = list(range(2000))  # read by a method
            self._named = list(range(2000))  # read through getattr by name
            self._small = [1, 2]
            self.public = list(range(2000))

        def size(self):
            return len(self._read)

        @property
        def named(self):
            return getattr(self, "_named")

    assert construction_only(Built()) == ["_table"]


MEASURE = """
import ctypes, gc, json, sys
from pathlib import Path
import mlx_lm, transformers  # noqa: F401
import mlx_flash.tokenizer
from mlx_lm.tokenizer_utils import load

def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

folder, which, eos = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
bare = rss()
loader = load if which == "mlx_lm" else mlx_flash.tokenizer.load_tokenizer
tok = loader(folder, eos_token_ids=eos)
tok.encode("warm up"), tok.decode([1, 2, 3])
print(json.dumps({"bare": bare, "loaded": rss()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS and malloc_trim: Linux")
@pytest.mark.parametrize("name", ["smollm2", "qwen"])
def test_resident_memory_is_lower(name):
    folder = _tokenizer_folder(SMOLLM2 if name == "smollm2" else QWEN)
    procs = {which: subprocess.Popen([sys.executable, "-c", MEASURE, str(folder), which, json.dumps(_eos(folder))],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for which in ("mlx_lm", "mlx_flash")}  # (one fresh process each, both at once)
    got = {}
    for which, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        got[which] = r["loaded"] - r["bare"]
    print(f"{name}: tokenizer RSS mlx_lm {got['mlx_lm'] / MB:.1f} MB, load_tokenizer {got['mlx_flash'] / MB:.1f} MB")
    assert got["mlx_flash"] <= got["mlx_lm"] - MARGIN[name], got

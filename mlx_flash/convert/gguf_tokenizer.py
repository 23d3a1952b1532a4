"""A GGUF's tokenizer rebuilt as a `tokenizers` Tokenizer: the file holds no tokenizer.json, only
its vocabulary, token types and (byte-level BPE) merges or (SentencePiece) scores.

- `byte_level_bpe` (tokenizer.ggml.model "gpt2": Llama 3, Qwen, SmolLM2, ...): GPT-2's byte
  alphabet, the file's merges, the pre-tokenizer's split that `tokenizer.ggml.pre` names;
- `sentencepiece_bpe` (tokenizer.ggml.model "llama": Gemma, Llama 2, Mistral v0.1, ...): as
  llama.cpp's SentencePiece tokenizer, which joins, over the whole text with spaces written
  "▁", the adjacent pieces whose join is the vocabulary's highest-scored piece, and spells what
  no piece holds as <0xXX> byte tokens. Here the same as a BPE whose merges are every split of
  every normal piece into two pieces, ranked by the joined piece's score, with byte fallback.

Control tokens are special (matched whole in any text); user-defined ones are matched whole too.
"""

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4  # gguf.TokenType

# llama.cpp's `tokenizer.ggml.pre` -> how text is split before BPE, with the
# regexes of llama.cpp's llama-vocab.cpp / the models' own tokenizer.json.
SPLITS = {
    "llama3": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
# name -> (split, ignore_merges, add_bos when the file does not say). "gpt2" is
# GPT-2's own regex (ByteLevel's); "digits" is that with every digit on its own.
# llama.cpp tries a whole word against the vocabulary before merging
# (ignore_merges) and adds BOS by default for the Llama 3 and Tekken families.
PRE_TOKENIZERS = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "mpt", "olmo", "jais"], ("gpt2", False, False)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        ("digits", False, False),
    ),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], ("llama3", True, True)),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ("llama3", False, False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], ("qwen2", False, False)),
    "tekken": ("tekken", True, True),
    "falcon": ("falcon", False, False),
}

def bytes_to_unicode():
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))




def byte_level_bpe(tokens, types, merges, pre, bos):
    """tokens, types, merges as the file lists them; pre: a PRE_TOKENIZERS key; bos: the token id
    to put first, or None -> Tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    split, ignore_merges, _ = PRE_TOKENIZERS[pre]
    # Normal tokens are spelled in the byte-level alphabet (space = "Ġ"). A few files store
    # some in plain UTF-8: re-spell those so BPE finds them. Control and user-defined tokens
    # keep their text: they are matched whole in the input, as added tokens.
    byte_chars = bytes_to_unicode()
    alphabet = set(byte_chars.values())
    vocab = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(byte_chars[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)

    model = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=ignore_merges)
    tk = Tokenizer(model)
    if split == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "falcon":  # (as Falcon's tokenizer.json: punctuation runs, byte level, runs of 3 digits)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Punctuation("contiguous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated"),
        ])
    elif split == "digits":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tk.decoder = decoders.ByteLevel()
    post = [processors.ByteLevel(trim_offsets=False)]
    if bos is not None:
        post.append(_with_bos(tokens, bos))
    tk.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)
    _add_whole_tokens(tk, tokens, types)
    return tk


def sentencepiece_bpe(tokens, types, scores, bos, space_prefix):
    """tokens, types, scores as the file lists them; bos: the token id to put first, or None;
    space_prefix: a "▁" before the text's first word (tokenizer.ggml.add_space_prefix) -> Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    ranked = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind != TOKEN_NORMAL or len(tok) < 2:
            continue
        for k in range(1, len(tok)):
            if tok[:k] in vocab and tok[k:] in vocab:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    merges = [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]
    unk = next((t for t, kind in zip(tokens, types) if t == "<unk>"), None)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unk, fuse_unk=True))
    scheme = "first" if space_prefix else "never"
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(steps)
    if bos is not None:
        tk.post_processor = _with_bos(tokens, bos)
    _add_whole_tokens(tk, tokens, types)
    return tk


def _with_bos(tokens, bos):
    from tokenizers import processors

    b = tokens[bos]
    return processors.TemplateProcessing(single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1",
                                         special_tokens=[(b, bos)])


def _add_whole_tokens(tk, tokens, types):
    """Control tokens as special added tokens, user-defined ones as plain added tokens."""
    from tokenizers import AddedToken

    special = [t for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL]
    user = [t for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

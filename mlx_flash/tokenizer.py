"""load_tokenizer(): mlx_lm's tokenizer, less what it keeps that nothing reads again.

mlx_lm.tokenizer_utils.load gives a TokenizerWrapper: a transformers tokenizer (whose Rust
`tokenizers` object does the work) and a streaming detokenizer. Two things in it are Python
copies of the vocabulary that cost resident memory for nothing:

- the transformers class's own copies, made for its construction: Qwen2Tokenizer (and most
  v5 BPE classes: Llama, GPT-2, Gemma...) keep the `vocab` dict and `merges` list their Rust
  tokenizer is built from, as `_vocab` / `_merges`: ~50 MB of str and tuple objects for a
  152k vocabulary, read by no method once `__init__` is done. They are dropped, each only
  where no method of the class but an `__init__` names it (checked on the class's code, so
  a class that does read it later, as WhisperTokenizer's save_vocabulary does, keeps it);
- the BPE / SPM streaming detokenizer's `tokenmap`, one Python str (or bytes) per token
  (~23 MB for 152k tokens). It becomes a TokenTable: the same values, packed in one bytes
  blob with an offsets array (~2 MB), each made again when a token is detokenized.

What is left is mlx_lm's own TokenizerWrapper with the same tokenizer and detokenizer
classes, so every call answers as mlx_lm's load does (tests/test_tokenizer_memory.py).
Measured (RSS above the imports, after gc and malloc_trim): Qwen2.5-Coder-1.5B (152k
tokens) 121 -> 50 MB, SmolLM2 (49k tokens) 26 -> 22 MB; what is left is mostly the Rust
tokenizer (49 / 15 MB). The load's peak is mlx_lm's (~245 / ~85 MB): this only trims after.
"""

from array import array
from pathlib import Path

BIG = 1024  # an instance attribute with fewer entries is not worth a look


def load_tokenizer(folder, eos_token_ids=None, **kwargs):
    """mlx_lm.tokenizer_utils.load(folder, eos_token_ids, **kwargs), slimmed (slim())."""
    from mlx_lm.tokenizer_utils import load

    return slim(load(Path(folder), eos_token_ids=eos_token_ids, **kwargs))


def slim(wrapper):
    """Drop a loaded TokenizerWrapper's construction-only vocabulary copies and pack its
    detokenizer's token table, in place; returns it."""
    inner = getattr(wrapper, "_tokenizer", None)
    if inner is not None:
        for name in construction_only(inner):
            delattr(inner, name)
    detokenizer = getattr(wrapper, "_detokenizer", None)
    table = getattr(detokenizer, "tokenmap", None)
    if isinstance(table, list):
        packed = TokenTable.pack(table)
        if packed is not None:
            detokenizer.tokenmap = packed
    return wrapper


def construction_only(obj):
    """Names of obj's big private containers (dict, list, tuple, set) that no method of its
    class reads, `__init__`s aside: what its construction kept and nothing uses again."""
    big = [name for name, value in vars(obj).items()
           if name.startswith("_") and not name.startswith("__")
           and isinstance(value, (dict, list, tuple, set)) and len(value) >= BIG]
    if not big:
        return []
    named = _names_in_methods(type(obj))
    return [name for name in big if name not in named]


def _names_in_methods(cls):
    """Every attribute name and str constant in the code of cls's methods (its whole MRO,
    nested functions included), except `__init__`'s."""
    codes = []
    for klass in cls.__mro__:
        for attr, value in vars(klass).items():
            if attr == "__init__":
                continue
            for f in _functions_of(value):
                code = getattr(f, "__code__", None)
                if code is not None:
                    codes.append(code)
    names = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, str):
                names.add(c)
            elif hasattr(c, "co_names"):
                codes.append(c)
    return names


def _functions_of(value):
    """The functions a class attribute holds: itself, a static/class method's, a property's."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    func = getattr(value, "func", None)  # functools.cached_property, partialmethod
    return [value] + ([func] if func is not None else [])


class TokenTable:
    """A read-only list of str / bytes / None (a detokenizer's token map) in one bytes blob:
    table[i] makes the entry again (equal to the list's), len() and iteration as a list's."""

    NONE, STR, BYTES = 0, 1, 2

    def __init__(self, blob, offsets, kinds):
        self._blob, self._offsets, self._kinds = blob, offsets, kinds

    @classmethod
    def pack(cls, entries):
        """A TokenTable of entries, or None where one is neither str, bytes nor None."""
        kinds, parts = bytearray(len(entries)), []
        for i, e in enumerate(entries):
            if isinstance(e, str):
                kinds[i] = cls.STR
                parts.append(e.encode("utf-8", "surrogatepass"))
            elif isinstance(e, bytes):
                kinds[i] = cls.BYTES
                parts.append(bytes(e))
            elif e is None:
                parts.append(b"")
            else:
                return None
        offsets = array("Q", [0])
        total = 0
        for p in parts:
            total += len(p)
            offsets.append(total)
        if total < 1 << 32:
            offsets = array("I", offsets)
        return cls(b"".join(parts), offsets, bytes(kinds))

    def __len__(self):
        return len(self._kinds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._kinds)
        i = i.__index__()
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("TokenTable index out of range")
        kind = self._kinds[i]
        if kind == self.NONE:
            return None
        raw = self._blob[self._offsets[i]:self._offsets[i + 1]]
        return raw.decode("utf-8", "surrogatepass") if kind == self.STR else raw

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def nbytes(self):
        """The bytes its three buffers hold."""
        return len(self._blob) + self._offsets.itemsize * len(self._offsets) + len(self._kinds)

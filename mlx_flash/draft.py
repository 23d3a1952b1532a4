"""Draft models for speculative decoding (the paper's §5.2): held in DRAM, they propose
tokens that the flash model verifies in one pass (mlx_lm's speculative loop).

--draft-model takes what --model takes (another model of the same tokenizer, loaded dense),
or `self:SPEC`, a layer-skipping draft of the target itself: the target's folder loaded
dense, only the layers SPEC names kept. SPEC is ranges of layer indices ("0-19,26-29") or
a count N: the first N-4 layers and the last 4 (a model's last layers matter most to its
output). Load the draft before the target: under --memory-limit, the draft's weights are
then part of the resident set the plan measures and takes off the limit.

A self-draft is loaded dense and then cut to its layers, so while it loads it holds the
whole model at its stored bits (its peak, not its size); loading only the kept layers is
left to do.
"""

import re

from .errors import FlashError

PROBE = "The quick brown fox, 1234 — déjà vu.\n"


def parse_layers(spec, n_layers):
    """Layer indices of a `self:` draft, sorted; FlashError naming the spec."""
    spec = spec.strip()
    if re.fullmatch(r"\d+", spec):
        n = int(spec)
        if not 1 <= n < n_layers:
            raise FlashError(f"--draft-model self:{spec}: a self-draft keeps 1 to {n_layers - 1} of the "
                             f"model's {n_layers} layers")
        tail = min(4, n)
        return list(range(n - tail)) + list(range(n_layers - tail, n_layers))
    out = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise FlashError(f"--draft-model self:{spec}: give a layer count (self:20) or ranges (self:0-19,26-29)")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if a > b or b >= n_layers:
            raise FlashError(f"--draft-model self:{spec}: {part.strip()} is not within layers 0-{n_layers - 1}")
        out.update(range(a, b + 1))
    if len(out) >= n_layers:
        raise FlashError(f"--draft-model self:{spec} keeps every layer: a draft must be smaller than the model")
    return sorted(out)


class Draft:
    """A loaded draft: the model, its tokenizer, what it is (for the log line)."""

    def __init__(self, spec, model, tokenizer, description):
        self.spec, self.model, self.tokenizer, self.description = spec, model, tokenizer, description
        self._cache = None

    def allocate(self, context):
        """Allocate the draft's KV cache for `context` tokens now (one buffer a layer), so that
        a --memory-limit plan made after this measures it in the resident set."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        cache = make_prompt_cache(self.model)
        for c in cache:
            c.step = context
        self.model(mx.array([[0]]), cache=cache)
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        trim_prompt_cache(cache, 1)
        self._cache = cache

    def cache(self):
        """An empty KV cache for one generation (the allocated one, emptied, when there is one)."""
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        if self._cache is None:
            return make_prompt_cache(self.model)
        trim_prompt_cache(self._cache, self._cache[0].offset)
        return self._cache

    def check(self, tokenizer, model=None):
        """A draft must speak the model's tokens, and (given the model) its KV cache must rewind."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        t = self.tokenizer
        if t.encode(PROBE) != tokenizer.encode(PROBE) or len(t.vocab) != len(tokenizer.vocab):
            raise FlashError(f"--draft-model {self.spec}: its tokenizer differs from the model's; a draft must "
                             "share it")
        if model is not None and not can_trim_prompt_cache(make_prompt_cache(model)):
            raise FlashError("--draft-model: speculative decoding rewinds the KV cache after a rejected token, and "
                             "this KV cache cannot be (--kv-cache flash): use --kv-cache dram")


def load_draft(spec, target, progress=False):
    """A Draft. spec: `self:SPEC` or a model (path, repo, .gguf); target: what --model names."""
    from .loader import forget_loaded, load, resolve_model_path

    if spec.startswith("self:"):
        folder = resolve_model_path(target, progress=progress)
        model, tok = load(str(folder), mode="dense")
        forget_loaded(model)  # (it stays beside the target, whose limit counts it: not a leftover)
        layers = model.model.layers
        keep = parse_layers(spec[5:], len(layers))
        model.model.layers = [layers[i] for i in keep]
        return Draft(spec, model, tok, f"self-draft, {len(keep)} of the model's {len(layers)} layers "
                                       f"({_ranges(keep)}), dense in DRAM")
    model, tok = load(spec, mode="dense")
    forget_loaded(model)
    return Draft(spec, model, tok, f"{spec}, {len(model.layers)} layers, dense in DRAM")


def speculative_cache(model, draft):
    """The prompt cache of one speculative generation: the model's KV caches, then the draft's.
    When mlx_lm's loop trims the model's caches after a rejected draft token, the model's
    runtime hears of it (Runtime.rewind), so a window keeps only the accepted positions'
    neurons."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    runtime = getattr(model, "runtime", None)
    if runtime is not None:
        cache[0].__class__ = _rewinding(type(cache[0]))
        cache[0].runtime = runtime
    return cache + draft.cache()


_REWINDING = {}


def _rewinding(base):
    """`base` (a KV cache class) whose trim() also rewinds the runtime (one layer's cache
    carries it: every layer is trimmed alike)."""
    if base not in _REWINDING:
        def trim(self, n):
            n = base.trim(self, n)
            self.runtime.rewind(n)
            return n

        _REWINDING[base] = type(f"Rewinding{base.__name__}", (base,), {"trim": trim})
    return _REWINDING[base]


class Acceptance:
    """Counts a speculative generation's passes from its tokens' from_draft flags: a pass
    yields the draft tokens the model accepted, then one of the model's own."""

    def __init__(self, num_draft, max_tokens):
        self.num_draft, self.max_tokens = num_draft, max_tokens
        self.tokens = self.accepted = self.proposed = self.passes = 0
        self._start = 0

    def add(self, from_draft):
        if self.tokens == self._start:  # a pass begins: it proposed this many
            self.proposed += min(self.num_draft, self.max_tokens - self.tokens)
            self.passes += 1
        self.tokens += 1
        if from_draft:
            self.accepted += 1
        else:
            self._start = self.tokens

    @property
    def rate(self):
        return self.accepted / self.proposed if self.proposed else 0.0

    def line(self):
        return (f"Speculative: {self.accepted} of {self.proposed} drafted tokens accepted ({100 * self.rate:.1f} %), "
                f"{self.tokens} tokens in {self.passes} passes of the model ({self.tokens / max(1, self.passes):.2f} "
                "a pass)")


def _ranges(ids):
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else str(a))
            start = b
    return ",".join(out)

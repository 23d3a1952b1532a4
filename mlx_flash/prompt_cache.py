"""A KV cache kept across requests of one conversation (the server's and the chat's).

It remembers which tokens it holds. The next prompt that starts with them (the previous
prompt, the answer, the new message: a conversation's next turn) feeds only the rest.
Where the cache holds more than the shared prefix, it is trimmed to it when its kind can
be trimmed (mlx_lm's KVCache can; not every kind can), else a fresh cache is made.
"""

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from .generate import context_used


def common_prefix(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _trim(cache, n):
    """Trim n positions off every layer's cache; False when a cache trimmed fewer (a rotating
    cache that has wrapped around cannot go back)."""
    return all(c.trim(n) == n for c in cache) if n > 0 else True


class PromptCache:
    """draft: a draft.Draft for speculative decoding; its KV caches then follow the model's in
    the list (mlx_lm's layout), and each part is trimmed to the shared prefix on its own
    (after a speculative generation the draft may hold a token less or more)."""

    def __init__(self, model, draft=None):
        self.model, self.draft = model, draft
        self.cache, self.tokens = None, []
        self.split = len(model.layers)
        self.trimmable = can_trim_prompt_cache(make_prompt_cache(model))

    def reset(self):
        self.cache, self.tokens = None, []

    def _fresh(self):
        if self.draft is None:
            return make_prompt_cache(self.model)
        from .draft import speculative_cache

        return speculative_cache(self.model, self.draft)

    def _parts(self, cache):
        return [cache[: self.split]] + ([cache[self.split:]] if self.draft is not None else [])

    @property
    def held(self):
        return min(context_used(p) for p in self._parts(self.cache)) if self.cache is not None else 0

    def prepare(self, ids):
        """(a cache to generate with, how many of ids it already holds): feed it ids[cached:].
        At least the last token of ids is always left to feed."""
        if self.cache is not None:
            parts = self._parts(self.cache)
            keep = min(common_prefix(self.tokens[: self.held], ids), len(ids) - 1)
            if keep > 0 and all(context_used(p) == keep for p in parts):
                return self.cache, keep
            if keep > 0 and self.trimmable and all(_trim(p, context_used(p) - keep) for p in parts):
                self.tokens = self.tokens[:keep]
                return self.cache, keep
        self.reset()
        return self._fresh(), 0

    def keep(self, cache, known):
        """After a generation with `cache`: known = the prompt's ids + the tokens generated
        (all of them fed to the model, the last maybe not). Keeps the cache for the next turn."""
        for p in self._parts(cache):
            held = context_used(p)
            if held > len(known) and not (self.trimmable and _trim(p, held - len(known))):  # fed a token not kept
                return self.reset()
        self.cache = cache
        self.tokens = list(known[: self.held])

"""A KV cache kept across requests of one conversation (the server's and the chat's).

It remembers which tokens it holds. The next prompt that starts with them (the previous
prompt, the answer, the new message: a conversation's next turn) feeds only the rest.
Where the cache holds more than the shared prefix, it is trimmed to it when its kind can
be trimmed (mlx_lm's KVCache can; not every kind can), else a fresh cache is made.
"""

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .generate import context_used


def common_prefix(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    def __init__(self, model):
        self.model = model
        self.cache, self.tokens = None, []
        self.trimmable = can_trim_prompt_cache(make_prompt_cache(model))

    def reset(self):
        self.cache, self.tokens = None, []

    @property
    def held(self):
        return context_used(self.cache) if self.cache is not None else 0

    def prepare(self, ids):
        """(a cache to generate with, how many of ids it already holds): feed it ids[cached:].
        At least the last token of ids is always left to feed."""
        if self.cache is not None:
            held = context_used(self.cache)
            keep = min(common_prefix(self.tokens[:held], ids), len(ids) - 1)
            if keep > 0 and keep == held:
                return self.cache, keep
            if keep > 0 and self.trimmable:
                trim_prompt_cache(self.cache, held - keep)
                self.tokens = self.tokens[:keep]
                return self.cache, keep
        self.reset()
        return make_prompt_cache(self.model), 0

    def keep(self, cache, known):
        """After a generation with `cache`: known = the prompt's ids + the tokens generated
        (all of them fed to the model, the last maybe not). Keeps the cache for the next turn."""
        held = context_used(cache)
        if held > len(known):  # fed a token we did not keep
            if not self.trimmable:
                return self.reset()
            trim_prompt_cache(cache, held - len(known))
            held = len(known)
        self.cache, self.tokens = cache, list(known[:held])

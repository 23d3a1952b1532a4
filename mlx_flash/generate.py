"""generate / stream_generate with mlx_lm's shapes and sampling arguments.

Generation itself is mlx_lm's: our models are mlx_lm-compatible modules, so
sampling, stop tokens, prompt caches and speculative decoding behave the same.
"""

from mlx_lm.generate import generate as _lm_generate
from mlx_lm.generate import stream_generate as _lm_stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

SAMPLER_ARGS = ("temp", "top_p", "min_p", "min_tokens_to_keep", "top_k", "xtc_probability", "xtc_threshold")
PROCESSOR_ARGS = ("repetition_penalty", "repetition_context_size", "logit_bias")


def _split_sampling(kwargs):
    """Accept mlx_lm's sampling keywords (temp, top_p, ...) directly, as mlx_lm's CLI does."""
    s = {k: kwargs.pop(k) for k in SAMPLER_ARGS if k in kwargs}
    p = {k: kwargs.pop(k) for k in PROCESSOR_ARGS if k in kwargs}
    if s and "sampler" not in kwargs:
        kwargs["sampler"] = make_sampler(**s)
    if p and "logits_processors" not in kwargs:
        kwargs["logits_processors"] = make_logits_processors(**p)
    return kwargs


def context_used(prompt_cache):
    """Positions a prompt cache (mlx_lm's list of per-layer caches) already holds."""
    return int(getattr(prompt_cache[0], "offset", 0)) if prompt_cache else 0


def _within_memory_limit(model, tokenizer, prompt, max_tokens, kwargs):
    """Under --memory-limit: the prompt chunks the plan chose, and a clear error, before any
    work, when the prompt (plus what a prompt cache holds) and max_tokens exceed the context
    the KV cache was planned for."""
    memory = getattr(getattr(model, "runtime", None), "memory", None)
    if memory is None:
        return kwargs
    n = len(prompt) if not isinstance(prompt, str) else len(tokenizer.encode(prompt))
    held = context_used(kwargs.get("prompt_cache"))
    if held + n + max_tokens > memory.context:
        from .errors import FlashError

        raise FlashError(f"{'the conversation (' + str(held) + ' tokens) + ' if held else ''}the prompt "
                         f"({n} tokens) + max_tokens ({max_tokens}) exceed the {memory.context} tokens of "
                         "context the --memory-limit plan holds a KV cache for: raise --ctx-size (its KV cache "
                         "then takes more of the limit) or shorten them")
    kwargs.setdefault("prefill_step_size", memory.prefill_step)
    return kwargs


def stream_generate(model, tokenizer, prompt, max_tokens=256, **kwargs):
    """Yield mlx_lm GenerationResponse objects (text, token, tokens/s, peak memory)."""
    kwargs = _within_memory_limit(model, tokenizer, prompt, max_tokens, _split_sampling(kwargs))
    yield from _lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)


def generate(model, tokenizer, prompt, verbose=False, max_tokens=256, **kwargs):
    """Return the generated text, like mlx_lm.generate."""
    kwargs = _within_memory_limit(model, tokenizer, prompt, max_tokens, _split_sampling(kwargs))
    return _lm_generate(model, tokenizer, prompt, verbose=verbose, max_tokens=max_tokens, **kwargs)

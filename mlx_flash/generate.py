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


def stream_generate(model, tokenizer, prompt, max_tokens=256, **kwargs):
    """Yield mlx_lm GenerationResponse objects (text, token, tokens/s, peak memory)."""
    yield from _lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **_split_sampling(kwargs))


def generate(model, tokenizer, prompt, verbose=False, **kwargs):
    """Return the generated text, like mlx_lm.generate."""
    return _lm_generate(model, tokenizer, prompt, verbose=verbose, **_split_sampling(kwargs))

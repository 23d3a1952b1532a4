"""generate / stream_generate with mlx_lm's shapes and sampling arguments.

Generation itself is mlx_lm's: our models are mlx_lm-compatible modules, so
sampling, stop tokens, prompt caches and speculative decoding behave the same.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

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


def draft_ahead(kwargs):
    """Tokens a draft proposes beyond what is kept (the KV cache holds them until the model
    rejects them): 0 without a draft (mlx_lm's default is 2 a pass)."""
    return kwargs.get("num_draft_tokens", 2) if kwargs.get("draft_model") is not None else 0


def context_overflow(memory, n, max_tokens, held=0, ahead=0):
    """What exceeds the context a --memory-limit plan holds a KV cache for, said, or None."""
    if memory is None or held + n + max_tokens + ahead <= memory.context:
        return None
    return (f"{'the conversation (' + str(held) + ' tokens) + ' if held else ''}the prompt ({n} tokens) + "
            f"max_tokens ({max_tokens}){f' + the tokens a draft proposes ahead ({ahead})' if ahead else ''} "
            f"exceed the {memory.context} tokens of context")


def _within_memory_limit(model, tokenizer, prompt, max_tokens, kwargs):
    """Under --memory-limit: the prompt chunks the plan chose, and a clear error, before any
    work, when the prompt (plus what a prompt cache holds) and max_tokens exceed the context
    the KV cache was planned for."""
    if not isinstance(prompt, str):
        check_token_ids(model, prompt)
    memory = getattr(getattr(model, "runtime", None), "memory", None)
    if memory is None:
        return kwargs
    n = len(prompt) if not isinstance(prompt, str) else len(tokenizer.encode(prompt))
    over = context_overflow(memory, n, max_tokens, context_used(kwargs.get("prompt_cache")), draft_ahead(kwargs))
    if over:
        from .errors import FlashError

        raise FlashError(f"{over} the --memory-limit plan holds a KV cache for: raise --ctx-size (its KV cache "
                         "then takes more of the limit) or shorten them")
    kwargs.setdefault("prefill_step_size", memory.prefill_step)
    return kwargs


def check_token_ids(model, ids, what="the prompt"):
    """A clear error for a token id outside the model's vocabulary (an embedding lookup out of
    range reads memory that is not the table's: silent garbage, not an error)."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    a = np.asarray(ids).reshape(-1)
    out = np.flatnonzero((a < 0) | (a >= vocab)) if vocab and a.size else ()
    if len(out):
        from .errors import FlashError

        raise FlashError(f"{what} has token id {int(a[out[0]])}, outside the model's vocabulary (0 .. {vocab - 1})")


@contextmanager
def _last_logits(model, draft=None):
    """While mlx_lm's loop runs: an output head read from flash multiplies a prompt chunk's last
    position only (mlx_lm keeps no other logits of a chunk; models/quantized.py StreamedHead).
    Not with a draft model, whose verify passes use every position's."""
    from .models.quantized import streamed_head

    head = streamed_head(model) if draft is None else None
    if head is not None:
        head.last_only = True
    try:
        yield
    finally:
        if head is not None:
            head.last_only = False


def stream_generate(model, tokenizer, prompt, max_tokens=256, **kwargs):
    """Yield mlx_lm GenerationResponse objects (text, token, tokens/s, peak memory)."""
    kwargs = _within_memory_limit(model, tokenizer, prompt, max_tokens, _split_sampling(kwargs))
    with _last_logits(model, kwargs.get("draft_model")):
        yield from _lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs)


def generate(model, tokenizer, prompt, verbose=False, max_tokens=256, **kwargs):
    """Return the generated text, like mlx_lm.generate."""
    kwargs = _within_memory_limit(model, tokenizer, prompt, max_tokens, _split_sampling(kwargs))
    with _last_logits(model, kwargs.get("draft_model")):
        return _lm_generate(model, tokenizer, prompt, verbose=verbose, max_tokens=max_tokens, **kwargs)


@dataclass
class BatchResult:
    """What batch_generate returns: per prompt its text and tokens (in the prompts' order), and
    the run's counts and times (prompt processing and decoding apart)."""

    texts: list
    tokens: list
    finish_reasons: list
    prompt_tokens: int
    prompt_seconds: float
    generation_tokens: int
    decode_seconds: float
    steps: int  # decode steps: each reads the rows of every layer once for the whole batch
    bytes_per_step: float = 0.0  # read from flash by a decode pass (the runtime's stats; 0: none read)
    reads_per_step: float = 0.0

    @property
    def decode_tps(self):
        return self.generation_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def _batch_ids(model, tokenizer, prompts):
    """The prompts' token ids (strings encoded), each checked: not empty, in the vocabulary."""
    from .errors import FlashError

    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise FlashError(f"batch_generate: prompt {i + 1} is empty")
        check_token_ids(model, p, f"batch_generate: prompt {i + 1}")
    return ids


def _batch_prefill_step(memory, n, longest, max_tokens, step):
    """The prompts' prefill step: under --memory-limit its plan's, whose KV caches must hold the
    batch (n sequences of the longest prompt + max_tokens); else `step`."""
    from .errors import FlashError

    if memory is None:
        return step
    if n > memory.batch:
        raise FlashError(f"{n} prompts, and the --memory-limit plan holds KV caches for {memory.batch}: load with "
                         f"batch_size={n} (generate --batch-file sets it), or decode them in groups of {memory.batch}")
    if longest + max_tokens > memory.context:
        raise FlashError(f"the longest prompt ({longest} tokens) + max_tokens ({max_tokens}) exceed the "
                         f"{memory.context} tokens of context the --memory-limit plan holds for each sequence: "
                         "raise --ctx-size or shorten them")
    return memory.prefill_step


def _decode_batch(model, cache, y, ids, max_tokens, sampler, processors, ends):
    """Decode steps of every sequence at once after its prompt (y: each one's last token) until each
    has max_tokens or its end token (a finished sequence rides along) -> (each sequence's tokens,
    why each ended, the steps)."""
    import mlx.core as mx

    n = len(ids)
    out = [[] for _ in ids]
    reasons = ["length"] * n
    done = [False] * n
    steps = 0
    history = [list(p) for p in ids]
    while steps < max_tokens and not all(done):
        logits = model(y, cache=cache)[:, -1, :]
        if processors:
            logits = mx.concatenate([_process(processors, history[i], logits[i: i + 1]) for i in range(n)])
        nxt = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        picked = nxt.tolist()
        steps += 1
        for i, t in enumerate(picked):
            if done[i]:
                continue
            history[i].append(t)
            if t in ends:
                done[i], reasons[i] = True, "stop"
                continue
            out[i].append(t)
            if len(out[i]) == max_tokens:
                done[i] = True
        y = nxt.reshape(n, 1)
    return out, reasons, steps


def _reads_per_step(stats_rows, before, n):
    """The bytes and reads of a decode pass: the mean over the runtime's stats rows since `before`
    of the passes of one position a sequence ({}: no stats, or none read)."""
    if stats_rows is None:
        return {}
    stats_rows.end()
    # the decode passes: one position per sequence (a prompt chunk's: its length each)
    passes = [r for r in stats_rows.rows[before:] if r["tokens"] <= n]
    if not passes:
        return {}
    return {"bytes_per_step": float(np.mean([r["bytes_read"] for r in passes])),
            "reads_per_step": float(np.mean([r["reads"] for r in passes]))}


def batch_generate(model, tokenizer, prompts, max_tokens=256, stop=True, **kwargs):
    """Decode many prompts together: left-padded to the longest, one batched KV cache allocated
    once for the longest prompt plus max_tokens, the prompts fed in chunks, then every decode
    step runs all of them through each layer at once, so the FFN rows a step reads from flash
    (or converts, or multiplies) serve every sequence — FlexGen's block schedule (§4.2) with
    the whole batch as one block. A finished sequence rides along until the block ends.
    prompts: strings or token lists. stop: end a sequence at its end-of-sequence token (False:
    every one decodes max_tokens, as a benchmark wants). Sampling keywords as generate's (temp,
    top_p, ...). Under --memory-limit the plan holds `batch_size` sequences' KV caches of its
    context (load(..., batch_size=N); generate --batch-file sets it)."""
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from .errors import FlashError

    if not prompts:
        raise FlashError("batch_generate: no prompts")
    runtime = getattr(model, "runtime", None)
    config = getattr(runtime, "config", None)
    if getattr(config, "kv_cache", None) == "flash":
        raise FlashError("--kv-cache flash holds one sequence's keys and values: a batch keeps its KV cache in "
                         "DRAM (--kv-cache dram)")
    if getattr(config, "kv_bits", None) is not None:
        raise FlashError("--kv-bits quantizes one sequence's KV cache: a batch's is held at the compute dtype")
    kwargs = _split_sampling(kwargs)
    ids = _batch_ids(model, tokenizer, prompts)
    n, longest = len(ids), max(len(p) for p in ids)
    step = _batch_prefill_step(getattr(runtime, "memory", None), n, longest, max_tokens,
                               kwargs.get("prefill_step_size", 2048))
    sampler = kwargs.get("sampler") or (lambda logprobs: mx.argmax(logprobs, axis=-1))
    processors = kwargs.get("logits_processors") or []
    ends = set(tokenizer.eos_token_ids) if stop else set()
    pad = [longest - len(p) for p in ids]
    tokens = mx.array([[0] * k + p for k, p in zip(pad, ids)])
    cache = [BatchKVCache(pad) for _ in model.layers]
    for c in cache:
        c.step = longest + max_tokens  # (one allocation: the merge and growth copies of mlx_lm's batch never happen)
    stats_rows = getattr(getattr(runtime, "store", None), "stats", None)
    before = len(stats_rows.rows) if stats_rows is not None else 0
    t0 = time.perf_counter()
    with _last_logits(model):  # (the prompts' logits are dropped)
        for a in range(0, longest - 1, step):
            model(tokens[:, a: min(a + step, longest - 1)], cache=cache)
            mx.eval([c.state for c in cache])
    t1 = time.perf_counter()
    out, reasons, steps = _decode_batch(model, cache, tokens[:, -1:], ids, max_tokens, sampler, processors, ends)
    t2 = time.perf_counter()
    per_step = _reads_per_step(stats_rows, before, n)
    return BatchResult(texts=[tokenizer.decode(t) for t in out], tokens=out, finish_reasons=reasons,
                       prompt_tokens=sum(len(p) for p in ids), prompt_seconds=t1 - t0,
                       generation_tokens=sum(len(t) for t in out), decode_seconds=t2 - t1, steps=steps, **per_step)


def _process(processors, history, logits):
    import mlx.core as mx

    toks = mx.array(history)
    for p in processors:
        logits = p(toks, logits)
    return logits

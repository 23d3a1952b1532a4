"""Scoring through the real runtime: perplexity and zero-shot multiple choice.

Two ways to run the model, for both kinds of task:

* one pass (`incremental=False`, the default for --mode dense): a perplexity
  window, or an item's choices, in one forward. Exact for dense weights.
* token by token (`incremental=True`, the default for every flash mode): one
  token per forward through an mlx_lm KV cache, as a user decodes — the
  sparsity sources (DIP-CA above all) choose neurons from the state of their
  caches, so a whole-window forward would not score what a user gets. The
  neuron caches carry over from window to window and from choice to choice,
  as in a long session; only the KV cache starts afresh.

Perplexity (lm-evaluation-harness's rolling log-likelihood, without overlap):
the token stream is prefixed with one token (the tokenizer's BOS, else its
EOS) and cut into windows of `context` inputs; window k feeds
seq[k*context : (k+1)*context] and scores the next token at every position,
so every token of the text is scored once and no window sees the one before.

Multiple choice (lm-evaluation-harness's loglikelihood requests): the
context and the continuation are tokenized as the harness does — trailing
spaces of the context move to the continuation, context+continuation is
encoded whole and split at the token count of the context encoded alone
(the continuation is the tail of the whole encoding; the context tokens are
the context encoded alone). The log-likelihood of a choice is the sum over its
continuation tokens. acc: argmax of the log-likelihoods; acc_norm: argmax of
log-likelihood / len(choice) in characters, the choice text without the
leading delimiter (the harness's `completion_len`); acc_norm_bytes: divided
by the UTF-8 bytes of the continuation " " + choice instead. Ties go to the
first choice (np.argmax), as in the harness. One pass shares the context:
its KV cache is computed once and the choices run as one batch after it.
"""

import math
import time

import numpy as np

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..errors import FlashError


# --- tokens


def encode(tokenizer, text):
    """Token ids without special tokens (the harness's tok_encode)."""
    try:  # verbose=False: no "longer than the maximum sequence length" warning for a long text
        return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))
    except TypeError:
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))


def prefix_token(tokenizer):
    """The token a perplexity stream starts from: BOS, else EOS (the harness's prefix_token_id)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None else getattr(tokenizer, "eos_token_id", None)


def encode_pair(tokenizer, context, continuation):
    """(context tokens, continuation tokens) as lm-evaluation-harness splits them."""
    if context == "":
        p = prefix_token(tokenizer)
        return ([p] if p is not None else []), encode(tokenizer, continuation)
    n = len(context) - len(context.rstrip())
    if n:
        continuation = context[-n:] + continuation
        context = context[:-n]
    whole = encode(tokenizer, context + continuation)
    ctx = encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def tokenize_stream(tokenizer, text, n_tokens=None):
    """The text's tokens, or its first n_tokens (encoding only as much text as that needs)."""
    if n_tokens is None:
        return encode(tokenizer, text)
    margin = 32  # tokens near a cut may differ from the whole text's: never use them
    chars = 8 * (n_tokens + margin) + 1024
    while True:
        toks = encode(tokenizer, text[:chars])
        if chars >= len(text):
            return toks[:n_tokens]
        if len(toks) >= n_tokens + margin:
            return toks[:n_tokens]
        chars *= 2


def _eval_state(cache, logits):
    """Evaluate what the next step needs: the KV cache (lazily skipping the LM head), else the logits."""
    if all(isinstance(c, KVCache) for c in cache):
        mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])
    else:
        mx.eval(logits)


def _log_softmax(logits):
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# --- perplexity


def windows(n_targets, context):
    """(start, end) of each window: inputs seq[start:end], targets seq[start+1:end+1]."""
    return [(s, min(s + context, n_targets)) for s in range(0, n_targets, context)]


def token_nll(model, seq, n_targets, context, incremental=False, progress=None):
    """NLL of seq[1 : n_targets + 1], each token given the earlier ones of its window."""
    if context < 1:
        raise FlashError(f"--context must be at least 1, not {context}")
    out = np.empty(n_targets, dtype=np.float64)
    for s, e in windows(n_targets, context):
        inp, tgt = seq[s:e], seq[s + 1: e + 1]
        if incremental:
            cache = make_prompt_cache(model)
            for i, t in enumerate(inp):
                logits = model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)
                out[s + i] = (mx.logsumexp(logits) - logits[tgt[i]]).item()
                if progress is not None:
                    progress.update(1)
        else:
            lp = _log_softmax(model(mx.array([inp]))[0])
            nll = -mx.take_along_axis(lp, mx.array(tgt)[:, None], axis=-1)[:, 0]
            out[s:e] = np.array(nll, dtype=np.float64)
            if progress is not None:
                progress.update(e - s)
    return out


def perplexity_metrics(nll, n_bytes=None, n_words=None):
    """Token perplexity with a standard error (delta method on the mean NLL; tokens taken as
    independent, so it understates the uncertainty), and bits per byte / word perplexity."""
    n = len(nll)
    mean = float(np.mean(nll))
    se = float(np.std(nll, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    m = {"perplexity": math.exp(mean), "perplexity_stderr": math.exp(mean) * se,
         "mean_nll": mean, "mean_nll_stderr": se, "tokens": n}
    total = float(np.sum(nll))
    if n_bytes:
        m["bits_per_byte"] = total / n_bytes / math.log(2)
        m["byte_perplexity"] = math.exp(total / n_bytes)
        m["bytes"] = n_bytes
    if n_words:
        m["word_perplexity"] = math.exp(total / n_words)
        m["words"] = n_words
    return m


def evaluate_perplexity(model, tokenizer, text, context=512, limit=None, incremental=False,
                        progress=False):
    """Score the text's first `limit` tokens (all by default); returns a result dict."""
    prefix = prefix_token(tokenizer)
    head = [prefix] if prefix is not None else []
    need = None if limit is None else limit + 1 - len(head)
    tokens = tokenize_stream(tokenizer, text, need)
    seq = head + tokens
    n = len(seq) - 1 if limit is None else min(limit, len(seq) - 1)
    if n < 1:
        raise FlashError("the text is too short: it has fewer than 2 tokens")
    scored = seq[1: n + 1]
    bar = _bar(progress, n, "tokens")
    t0 = time.perf_counter()
    nll = token_nll(model, seq, n, context, incremental, bar)
    dt = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    text_scored = tokenizer.decode(scored)
    metrics = perplexity_metrics(nll, len(text_scored.encode("utf-8")), len(text_scored.split()))
    return {"kind": "perplexity", "metrics": metrics, "n": n, "seconds": dt,
            "tokens_forwarded": n, "tokens_per_s": n / dt if dt > 0 else float("inf"),
            "windows": len(windows(n, context)), "context": context, "prefix_token": prefix,
            "text_tokens": len(tokens), "incremental": incremental, "nll": nll}


# --- multiple choice


def _tile(cache, batch):
    """A KV cache holding `cache`'s keys/values repeated for `batch` sequences."""
    new = KVCache()
    if cache.keys is not None and cache.offset:
        k = cache.keys[..., : cache.offset, :]
        v = cache.values[..., : cache.offset, :]
        new.state = (mx.repeat(k, batch, axis=0), mx.repeat(v, batch, axis=0), cache.offset)
    return new


def _batched_logliks(model, prefix, rows, targets):
    """Sum of log P(targets[b]) after prefix + rows[b] (rows run as one right-padded batch)."""
    B, L = len(rows), max(len(r) for r in rows)
    x = np.zeros((B, L), dtype=np.int32)
    y = np.zeros((B, L), dtype=np.int32)
    keep = np.zeros((B, L), dtype=np.float32)
    for b, (r, t) in enumerate(zip(rows, targets)):
        x[b, : len(r)] = r
        keep[b, len(r) - len(t): len(r)] = 1  # targets: the last len(t) positions of the row
        y[b, len(r) - len(t): len(r)] = t
    cache = make_prompt_cache(model)
    if prefix and all(isinstance(c, KVCache) for c in cache):
        logits = model(mx.array([prefix]), cache=cache)
        _eval_state(cache, logits)
        cache = [_tile(c, B) for c in cache]
    elif prefix:  # no shareable cache: run the prefix in every row
        x = np.concatenate([np.tile(np.array(prefix, dtype=np.int32), (B, 1)), x], axis=1)
        y = np.concatenate([np.zeros((B, len(prefix)), np.int32), y], axis=1)
        keep = np.concatenate([np.zeros((B, len(prefix)), np.float32), keep], axis=1)
        cache = None
    lp = _log_softmax(model(mx.array(x), cache=cache))
    g = mx.take_along_axis(lp, mx.array(y)[..., None], axis=-1)[..., 0] * mx.array(keep)
    return [float(v) for v in np.array(g.sum(axis=-1), dtype=np.float64)]


def _loglik_token_by_token(model, ctx, cont):
    seq = ctx + cont
    cache = make_prompt_cache(model)
    total, first = 0.0, len(ctx) - 1
    for i in range(len(seq) - 1):
        logits = model(mx.array([[seq[i]]]), cache=cache)
        if i < first:
            _eval_state(cache, logits)
            continue
        lg = logits[0, -1].astype(mx.float32)
        total += (lg[seq[i + 1]] - mx.logsumexp(lg)).item()
    return total


def choice_logliks(model, ctx, conts, incremental=False):
    """[log P(cont | ctx) for cont in conts]; a continuation without tokens scores 0."""
    if not ctx:
        raise FlashError("a multiple-choice context encodes to no tokens")
    out = [0.0] * len(conts)
    live = [i for i, c in enumerate(conts) if c]
    if incremental:
        for i in live:
            out[i] = _loglik_token_by_token(model, ctx, conts[i])
        return out
    if live:
        rows = [[ctx[-1]] + conts[i][:-1] for i in live]
        lls = _batched_logliks(model, ctx[:-1], rows, [conts[i] for i in live])
        for i, v in zip(live, lls):
            out[i] = v
    return out


def score_item(model, tokenizer, item, incremental=False):
    """Per-choice log-likelihoods of an MCItem and the figures acc/acc_norm need."""
    pairs = [encode_pair(tokenizer, item.context, c) for c in item.continuations]
    ctx = pairs[0][0]
    conts = [p[1] for p in pairs]
    lls = choice_logliks(model, ctx, conts, incremental)
    if incremental:
        forwarded = sum(len(ctx) + len(c) - 1 for c in conts if c)
    else:
        forwarded = len(ctx) - 1 + len(conts) * max(len(c) for c in conts)
    return {"id": item.id, "gold": item.gold, "lls": lls,
            "chars": [len(c) for c in item.choices],
            "bytes": [len(c.encode("utf-8")) for c in item.continuations],
            "context_tokens": len(ctx), "choice_tokens": [len(c) for c in conts],
            "forwarded": forwarded}


def _mean_stderr(x):
    x = np.asarray(x, dtype=np.float64)
    if len(x) < 2:
        return float(np.mean(x)), float("nan")
    return float(np.mean(x)), float(np.std(x, ddof=1) / math.sqrt(len(x)))


def choice_metrics(results):
    """acc, acc_norm (by characters of the choice), acc_norm_bytes, each with its standard error."""
    correct = {"acc": [], "acc_norm": [], "acc_norm_bytes": []}
    for r in results:
        lls = np.array(r["lls"], dtype=np.float64)
        chars = np.maximum(np.array(r["chars"], dtype=np.float64), 1)
        nbytes = np.maximum(np.array(r["bytes"], dtype=np.float64), 1)
        correct["acc"].append(float(np.argmax(lls) == r["gold"]))
        correct["acc_norm"].append(float(np.argmax(lls / chars) == r["gold"]))
        correct["acc_norm_bytes"].append(float(np.argmax(lls / nbytes) == r["gold"]))
    m = {}
    for k, v in correct.items():
        m[k], m[k + "_stderr"] = _mean_stderr(v)
    m["items"] = len(results)
    return m


def evaluate_choices(model, tokenizer, items, incremental=False, progress=False):
    bar = _bar(progress, len(items), "items")
    results, forwarded = [], 0
    t0 = time.perf_counter()
    for item in items:
        r = score_item(model, tokenizer, item, incremental)
        r["pred"] = int(np.argmax(r["lls"]))
        r["pred_norm"] = int(np.argmax(np.array(r["lls"]) / np.maximum(np.array(r["chars"]), 1)))
        results.append(r)
        forwarded += r["forwarded"]
        if bar is not None:
            bar.update(1)
    dt = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return {"kind": "choice", "metrics": choice_metrics(results), "n": len(items), "seconds": dt,
            "tokens_forwarded": forwarded, "tokens_per_s": forwarded / dt if dt > 0 else float("inf"),
            "items_per_s": len(items) / dt if dt > 0 else float("inf"), "incremental": incremental,
            "items": results}


def _bar(progress, total, unit):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, leave=False, disable=None)


# --- a task by name


def load_task(task, split=None, data_dir=None):
    """(kind, data, description): kind 'perplexity' (data: the text) or 'choice' (data: MCItems).

    Raises FlashError for an unknown task, a missing file or an empty text.
    """
    from .tasks import load_choice_task, load_text, resolve_task

    kind = resolve_task(task)
    if split is not None and task not in ("arc_easy", "arc_challenge"):
        raise FlashError(f"--split applies to arc_easy / arc_challenge, not {task}")
    if kind == "perplexity":
        text, desc = load_text(task, data_dir)
        return kind, text, desc
    items = load_choice_task(task, split, data_dir)
    if task.startswith("arc"):
        desc = f"{task}, {split or 'test'} split ({len(items)} items)"
    else:
        desc = f"{task}, validation split ({len(items)} items)"
    return kind, items, desc


def evaluate(model, tokenizer, task, split=None, limit=None, context=512, incremental=None,
             data_dir=None, progress=False, loaded=None):
    """Run a task (a name of tasks.TASKS, or a text file) on a loaded model.

    incremental: token by token (default: unless the model runs --mode dense).
    limit: tokens scored (perplexity) or items from the start (multiple choice).
    loaded: load_task()'s result, when the caller already has it.
    """
    if limit is not None and limit <= 0:
        raise FlashError(f"--limit must be positive, not {limit}")
    if context < 1:
        raise FlashError(f"--context must be at least 1, not {context}")
    if incremental is None:
        runtime = getattr(model, "runtime", None)  # an mlx_lm model has none: dense
        incremental = runtime is not None and runtime.mode != "dense"
    kind, data, desc = loaded or load_task(task, split, data_dir)
    if kind == "perplexity":
        res = evaluate_perplexity(model, tokenizer, data, context, limit, incremental, progress)
    else:
        res = evaluate_choices(model, tokenizer, data[:limit] if limit else data, incremental, progress)
        res["available"] = len(data)
    res["task"], res["data"] = task, desc
    return res

"""mlx_flash.generate: generate text from a prompt with a model loaded from flash."""

import argparse
import json
import sys
import time

from . import add_device_arg, check_model_arg, default_model, run, use_device


def add_model_args(p):
    from ..runtime import add_cli_args

    p.add_argument("--model", default=None,
                   help=f"converted folder, Hub repo, HF/mlx-lm folder or .gguf (default {default_model()})")
    add_cli_args(p)  # every FlashConfig option with a flag
    add_device_arg(p)


def add_draft_args(p):
    p.add_argument("--draft-model", default=None,
                   help="speculative decoding: a draft model in DRAM proposes tokens, the model verifies them in one "
                   "pass; another model of the same tokenizer, or self:N / self:0-19,26-29 for a layer-skipping "
                   "draft of the model itself (loaded dense, then cut: while it loads it holds the whole model "
                   "at its stored bits)")
    p.add_argument("--num-draft-tokens", type=int, default=3, help="tokens the draft proposes a pass (default 3)")


def load_with_draft(args, ctx_size=None, context_of=None):
    """(model, tokenizer, draft or None): the --draft-model first (under --memory-limit its
    weights and its KV cache, allocated here, are then in the resident set the plan of the
    model measures), then the model; the draft checked against it. context_of (no draft: the
    tokenizer loads with the model): the context from the tokenizer, in place of ctx_size."""
    if getattr(args, "draft_model", None) is None:
        return (*load_for_cli(args, ctx_size=ctx_size, context_of=context_of), None)
    from ..draft import load_draft
    from ..errors import FlashError
    from ..runtime.memory import DEFAULT_CONTEXT

    if args.num_draft_tokens < 1:
        raise FlashError(f"--num-draft-tokens must be at least 1, got {args.num_draft_tokens}")
    use_device(args.device)
    draft = load_draft(args.draft_model, check_model_arg(args.model or default_model()), progress=True)
    if args.memory_limit is not None:
        context = args.ctx_size or ctx_size or DEFAULT_CONTEXT
        draft.allocate(context + args.num_draft_tokens)
    print(f"[mlx_flash] draft {draft.description}; {args.num_draft_tokens} tokens a pass", file=sys.stderr)
    model, tokenizer = load_for_cli(args, ctx_size=ctx_size)
    draft.check(tokenizer, model)
    return model, tokenizer, draft


def draft_kwargs(args, draft, model):
    """stream_generate's keywords for speculative decoding (none without a draft)."""
    if draft is None:
        return {}
    from ..draft import speculative_cache

    return {"draft_model": draft.model, "num_draft_tokens": args.num_draft_tokens,
            "prompt_cache": speculative_cache(model, draft)}


def add_sampling_args(p):
    p.add_argument("--max-tokens", "-m", type=int, default=100)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def flag_of(field):
    """The command-line flag of a setting: top_p -> --top-p."""
    return "--" + field.replace("_", "-")


def check_sampling(args, vocab_size=None, name=flag_of):
    """A FlashError naming the setting where a sampling setting is out of range, before it
    reaches mlx_lm's sampler (there some are a traceback, others silently ignored). args: any
    object with the settings as attributes (an argparse namespace; an absent or None one is not
    checked); vocab_size: the model's vocabulary once it is loaded (top_k must be below it);
    name(field): how the message names a setting (a flag here; a server may name its JSON keys)."""
    import math

    from ..errors import FlashError

    def value(field):
        return getattr(args, field, None)

    def refuse(field, rule):
        raise FlashError(f"{name(field)} {value(field)}: {rule}")

    def number_in(field, low, high, low_open=False):
        v = value(field)
        return math.isfinite(v) and (v > low if low_open else v >= low) and v <= high

    if value("max_tokens") is not None and value("max_tokens") < 1:
        refuse("max_tokens", "must be at least 1")
    if value("temp") is not None and not number_in("temp", 0, math.inf):
        refuse("temp", "must be 0 (greedy) or more")
    if value("top_p") is not None and not number_in("top_p", 0, 1, low_open=True):
        refuse("top_p", "must be above 0 and at most 1 (1: off)")
    if value("min_p") is not None and not number_in("min_p", 0, 1):
        refuse("min_p", "must be from 0 to 1 (0: off)")
    if value("top_k") is not None and value("top_k") < 0:
        refuse("top_k", "must be 0 (off) or more")
    if value("top_k") is not None and vocab_size is not None and value("top_k") >= vocab_size:
        refuse("top_k", f"must be below the model's vocabulary of {vocab_size} tokens (0: off, all of them)")
    if value("repetition_penalty") is not None and not number_in("repetition_penalty", 0, math.inf, low_open=True):
        refuse("repetition_penalty", "must be above 0 (1: off)")
    if value("seed") is not None and not 0 <= value("seed") < 1 << 64:
        refuse("seed", "must be from 0 to 2**64 - 1")


def vocab_size_of(model):
    """The model's vocabulary (the logits' width), or None where its args do not say."""
    return getattr(getattr(model, "args", None), "vocab_size", None)


def check_text(text, what):
    """`text`, or a FlashError naming `what` where it holds lone surrogates: bytes that were
    not valid UTF-8 as Python decodes the command line, which the tokenizer cannot encode."""
    from ..conversation import is_utf8
    from ..errors import FlashError

    if text is not None and not is_utf8(text):
        raise FlashError(f"{what} is not valid UTF-8; give it as UTF-8 text")
    return text


def read_stdin_text(what):
    """All of the standard input as UTF-8 text; a FlashError naming `what` where it is not UTF-8."""
    from ..errors import FlashError

    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FlashError(f"{what}: the standard input is not valid UTF-8 (byte {raw[e.start]:#04x} at offset "
                         f"{e.start}); give it as UTF-8 text") from None


def check_output_path(path, flag):
    """A FlashError naming `flag` where `path` cannot be a file written later (a folder, or in a
    folder that is missing or not writable): said before the model loads, not after the work."""
    import os
    from pathlib import Path

    from ..errors import FlashError

    if path is None:
        return
    p = Path(path)
    folder = p.parent
    if p.is_dir() or not p.name:
        raise FlashError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise FlashError(f"{flag} {path}: {folder} is not a folder; give a path in a folder you can write to")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise FlashError(f"{flag} {path}: not writable; give a path in a folder you can write to")


def write_output(path, flag, text):
    """Write `text` to `path`; a FlashError naming `flag` where that fails."""
    from ..errors import FlashError

    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except (OSError, ValueError) as e:  # ValueError: a path with a NUL byte in it
        raise FlashError(f"{flag} {path}: cannot write it ({getattr(e, 'strerror', None) or e})") from None


def sampling_kwargs(args):
    kw = dict(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    if args.repetition_penalty:
        kw["repetition_penalty"] = args.repetition_penalty
    return kw


def _context_of(args, prompt_text):
    """tokenizer -> the context a --memory-limit plan holds for generate: the tokens it will feed
    (the prompt as build_prompt makes it: chat template, system prompt), counted as generate's
    context check counts them, + --max-tokens."""
    def context(tok):
        p = build_prompt(tok, prompt_text, args.system_prompt, args.ignore_chat_template)
        return (len(tok.encode(p)) if isinstance(p, str) else len(p)) + args.max_tokens

    return context


def load_for_cli(args, ctx_size=None, batch_size=1, context_of=None):
    """ctx_size: the context a --memory-limit plan holds a KV cache for, when the user gave
    no --ctx-size (generate: what its prompt and --max-tokens can take), or context_of: that
    context from the model's tokenizer (loader.load); batch_size: the sequences it holds one
    for (generate --batch-file: its prompts)."""
    from .. import load
    from ..blas import blas_info
    from ..runtime import from_cli

    model_name = check_model_arg(args.model or default_model())
    use_device(args.device)
    if getattr(args, "explain", False):
        from ..plan.measure import ensure_profile_apart

        ensure_profile_apart()  # in a child process: a probe's memory must not count in this one's runtime
    t0 = time.perf_counter()
    overrides = {}
    if ctx_size is not None and context_of is None and args.memory_limit is not None and args.ctx_size is None:
        overrides["ctx_size"] = ctx_size
    if batch_size > 1 and args.memory_limit is not None:
        overrides["batch_size"] = batch_size
    model, tokenizer = load(model_name, progress=True, config=from_cli(args, **overrides), context_of=context_of)
    dt = time.perf_counter() - t0
    rt = model.runtime
    m = rt.manifest
    print(
        f"[mlx_flash] model {rt.folder} ({m.model_type}, flash "
        f"{m.dtype if m.layout.quant is None else f'{m.layout.quant.bits}-bit g{m.layout.quant.group_size}'}, "
        f"compute {rt.compute_dtype}, resident {rt.resident_dtype}); BLAS: {blas_info()}; loaded in {dt:.1f} s",
        file=sys.stderr,
    )
    return model, tokenizer


DEFAULT_PROMPT = "Tell me a short story about a robot."


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.generate", description=__doc__)
    add_model_args(p)
    p.add_argument("--prompt", "-p", default=None,
                   help=f"the prompt ('-' reads stdin; default: {DEFAULT_PROMPT!r})")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--ignore-chat-template", action="store_true")
    add_sampling_args(p)
    p.add_argument("--stats", action="store_true", help="print per-token timings and the I/O breakdown")
    p.add_argument("--stats-json", default=None, help="write one row per token and a summary here")
    p.add_argument("--batch-file", default=None, help="decode many prompts together: a JSONL file, each line a "
                   "string or {\"prompt\": ...}; every decode step reads the rows once for all of them")
    add_draft_args(p)
    p.add_argument("--batch-out", default=None, help="with --batch-file: write one JSON line per prompt "
                   "(prompt, text, tokens, finish reason) here instead of printing the answers")
    return p


def read_batch_file(path):
    """The prompts of a JSONL file: each line a JSON string or an object with "prompt"; blank
    lines skipped. A bad line is a FlashError naming the file and the line."""
    from pathlib import Path

    from ..conversation import is_utf8
    from ..errors import FlashError

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise FlashError(f"--batch-file {path}: cannot read it ({e})") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise FlashError(f"{path}:{i}: not JSON ({e.msg})") from None
        if isinstance(item, dict):
            item = item.get("prompt")
        if not isinstance(item, str) or not item:
            raise FlashError(f"{path}:{i}: expected a non-empty string or {{\"prompt\": \"...\"}}")
        if not is_utf8(item):
            raise FlashError(f"{path}:{i}: not valid UTF-8 (a lone surrogate escape such as \\udcff)")
        prompts.append(item)
    if not prompts:
        raise FlashError(f"--batch-file {path}: no prompts in it")
    return prompts


def run_batch(args, model, tokenizer, prompts):
    from .. import batch_generate

    texts = [build_prompt(tokenizer, p, args.system_prompt, args.ignore_chat_template) for p in prompts]
    r = batch_generate(model, tokenizer, texts, max_tokens=args.max_tokens, **sampling_kwargs(args))
    if args.batch_out:
        write_output(args.batch_out, "--batch-out", "".join(
            json.dumps({"prompt": p, "text": text, "tokens": len(toks), "finish_reason": why}) + "\n"
            for p, text, toks, why in zip(prompts, r.texts, r.tokens, r.finish_reasons)))
    else:
        for i, text in enumerate(r.texts, 1):
            print(f"--- {i}\n{text.strip()}")
    print("=" * 10)
    print(f"Batch of {len(prompts)}: prompts {r.prompt_tokens} tokens in {r.prompt_seconds:.1f} s; generated "
          f"{r.generation_tokens} tokens in {r.steps} steps, {r.decode_seconds:.1f} s: {r.decode_tps:.2f} tokens-per-sec"
          + (f"; answers in {args.batch_out}" if args.batch_out else ""))
    if args.stats:
        s = model.runtime.stats()["summary"]
        if "memory_limit" in s:
            print(memory_line(s))
        print(f"Mode {s['mode']}, FFN weights in DRAM {s['ffn_dram_bytes'] / 1e6:.1f} MB; read "
              f"{r.bytes_per_step / 1e6:.2f} MB per decode step in {r.reads_per_step:.0f} reads")


def expert_line(s):
    """--stats of a mixture-of-experts model: the expert buffer's use."""
    hit = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.3f}"
    layers = s["hit_rate_per_layer"]
    shown = ", ".join(f"{i}: {r:.2f}" for i, r in list(layers.items())[:8]) + (", ..." if len(layers) > 8 else "")
    return (f"Experts: {s['expert_slots']} slots for {s['experts_total']} experts ({s['eviction']} eviction); "
            f"{s['experts_asked']} asked for, {s['experts_read']} read ({s['bytes_read'] / 1e6:.1f} MB in "
            f"{s['read_s']:.2f} s, of it waited for {s['io_s']:.2f} s; {s['read_threads']} reader threads with "
            f"{s['read_buffer_bytes'] / 1e6:.0f} MB of buffers); hit rate {hit}" + (f" (per layer {shown})" if layers else "")
            + _prefetch_text(s.get("prefetch"))
            + ("" if s.get("hidden_share") is None else
               f"; of all expert reading, {100 * s['hidden_share']:.0f} % hidden behind compute"))


def _prefetch_text(p):
    if not p:
        return ""
    return (f"; look-ahead read {p['predicted']} experts ({p['bytes'] / 1e6:.1f} MB), {p['predicted_used']} of them "
            f"used ({100 * p['precision']:.0f} %)")


def memory_line(s):
    """--stats: the --memory-limit plan's parts beside the peak RSS (s: runtime.stats()'s summary)."""
    m = s["memory_limit"]
    kv = f"{m['ctx_size']} tokens" + (f" x {m['batch']}" if m.get("batch", 1) > 1 else "")
    kv += " on flash: its buffers" if m.get("kv_on_flash") else ""
    return (f"Memory limit {m['limit_bytes'] / 1e6:.0f} MB: weights {m['weights_bytes'] / 1e6:.0f}, runtime "
            f"{m['runtime_bytes'] / 1e6:.0f}, KV {m['kv_bytes'] / 1e6:.0f} ({kv}), activations "
            f"{m['activation_bytes'] / 1e6:.0f}, MLX cache {m['mlx_cache_bytes'] / 1e6:.0f}, margin "
            f"{m['margin_bytes'] / 1e6:.0f} MB; peak RSS {s['peak_rss_bytes'] / 1e6:.0f} MB")


def stats_lines(s):
    """--stats (and the chat's /stats): the plan's memory, the mode, and the runtime's per-token
    means (s: runtime.stats()'s summary)."""
    lines = []
    if "memory_limit" in s:
        lines.append(memory_line(s))
    lines.append(f"Mode {s['mode']}, FFN weights in DRAM {s['ffn_dram_bytes'] / 1e6:.1f} MB, "
                 f"all weights in DRAM {s['weights_in_dram_bytes'] / 1e6:.1f} MB, "
                 + (f"budget {s['memory_budget_bytes'] / 1e6:.0f} MB" if s["memory_budget_bytes"] else "no budget"))
    if "expert_slots" in s:
        lines.append(expert_line(s))
    if "mean_io_ms" in s:
        lines.append(f"Per token (decode means): I/O {s['mean_io_ms']:.1f} ms, memory management "
                     f"{s['mean_mem_ms']:.1f} ms, predict {s['mean_predict_ms']:.1f} ms, compute "
                     f"{s['mean_compute_ms']:.1f} ms; read {s['mean_bytes_read'] / 1e6:.2f} MB in "
                     f"{s['mean_reads']:.0f} reads; hit rate {s['mean_hit_rate']:.2f}, window {s['mean_window']:.1f}"
                     + (f"; FFN weights used {100 * s['mean_ffn_share']:.1f} %" if s.get("mean_ffn_share") else ""))
    return lines


def build_prompt(tokenizer, prompt, system_prompt=None, ignore_template=False):
    if ignore_template or getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


# long: the command read top to bottom: its body is one closure inside, for run()'s error handling
def main(argv=None):
    args = build_parser().parse_args(argv)

    # long: one linear pass, read top to bottom: the options checked, the model loaded, the tokens streamed, --stats
    def body():
        import mlx.core as mx

        from .. import stream_generate

        from ..errors import FlashError

        check_sampling(args)
        check_text(args.prompt, "--prompt")
        check_text(args.system_prompt, "--system-prompt")
        check_output_path(args.stats_json, "--stats-json")
        check_output_path(args.batch_out, "--batch-out")
        if args.seed is not None:
            mx.random.seed(args.seed)
        if args.batch_file:
            if args.prompt is not None:
                raise FlashError("--prompt and --batch-file: give one (the batch file holds the prompts)")
            if args.stats_json:
                raise FlashError("--stats-json records one sequence's tokens: not with --batch-file")
            if args.draft_model:
                raise FlashError("--draft-model drafts for one sequence: not with --batch-file")
            prompts = read_batch_file(args.batch_file)  # its errors before the model loads
            ctx = max(len(p.encode()) for p in prompts) + len((args.system_prompt or "").encode()) + 128 + args.max_tokens
            model, tokenizer = load_for_cli(args, ctx_size=ctx, batch_size=len(prompts))
            check_sampling(args, vocab_size_of(model))
            return run_batch(args, model, tokenizer, prompts)
        prompt_text = read_stdin_text("--prompt -") if args.prompt == "-" else (args.prompt or DEFAULT_PROMPT)
        # under --memory-limit, a KV cache for this prompt and --max-tokens: the tokens it will
        # feed, counted by the model's tokenizer, or, where a draft's KV cache is allocated before
        # the model loads, bounded by its bytes (a token is at least one) + 128 for a template
        ctx = len(prompt_text.encode()) + len((args.system_prompt or "").encode()) + 128 + args.max_tokens
        model, tokenizer, draft = load_with_draft(args, ctx_size=ctx, context_of=_context_of(args, prompt_text))
        check_sampling(args, vocab_size_of(model))
        speculative = draft_kwargs(args, draft, model)
        if (args.stats or args.stats_json) and model.runtime.store is not None:
            model.runtime.store.timed = True  # the phases timed truthfully (one sync per layer)
        prompt = build_prompt(tokenizer, prompt_text, args.system_prompt, args.ignore_chat_template)
        from ..io import device

        times, last, resp = [], time.perf_counter(), None
        disk0 = None  # the disk's counters when the decode starts (--stats: the rate it delivered)
        if draft is not None:
            from ..draft import Acceptance

            accepted = Acceptance(args.num_draft_tokens, args.max_tokens)
        for resp in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                    **sampling_kwargs(args), **speculative):
            now = time.perf_counter()
            times.append(now - last)
            last = now
            if len(times) == 1 and (args.stats or args.stats_json):
                disk0 = device.counters(model.runtime.folder)
            if draft is not None:
                accepted.add(resp.from_draft)
            print(resp.text, end="", flush=True)
        print()
        if resp is None:
            return
        print("=" * 10)
        print(f"Prompt: {resp.prompt_tokens} tokens, {resp.prompt_tps:.1f} tokens-per-sec")
        print(f"Generation: {resp.generation_tokens} tokens, {resp.generation_tps:.1f} tokens-per-sec")
        print(f"Peak memory: {resp.peak_memory:.3f} GB")
        if draft is not None:
            print(accepted.line())
        disk_gbs = device.rate(disk0, device.counters(model.runtime.folder)) if disk0 else None
        report = model.runtime.stats(disk_gbs)
        if args.stats and len(times) > 1:
            decode = sorted(times[1:])
            n = len(decode)
            print(
                f"Per token (decode, ms): mean {1e3 * sum(decode) / n:.1f}, "
                f"p50 {1e3 * decode[n // 2]:.1f}, p90 {1e3 * decode[int(n * 0.9)]:.1f}, "
                f"max {1e3 * decode[-1]:.1f}; first token {1e3 * times[0]:.1f} ms"
            )
            p = report["summary"].get("predicted")
            if p is not None:
                print(f"Cost model: predicted {p['total_ms']:.1f} ms/token (I/O {p['io_ms']:.1f}, compute "
                      f"{p['compute_ms']:.1f}), measured median {1e3 * decode[n // 2]:.1f}: "
                      f"{decode[n // 2] * 1e3 / p['total_ms']:.2f}x")
            at = report["summary"].get("predicted_at_run_disk")
            if at is not None:
                print(f"  the disk delivered {at['disk_gbs']:.2f} GB/s during the decode (the profile: "
                      f"{at['profile_disk_gbs']:.2f}); at that rate {at['total_ms']:.1f} ms/token: "
                      f"{decode[n // 2] * 1e3 / at['total_ms']:.2f}x")
        if args.stats:
            for line in stats_lines(report["summary"]):
                print(line)
        if args.stats_json:
            write_output(args.stats_json, "--stats-json", json.dumps(report, indent=1))

    return run(body, "mlx_flash.generate")


if __name__ == "__main__":
    sys.exit(main())

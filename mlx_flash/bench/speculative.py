"""`mlx_flash.benchmark speculative`: decoding with a draft model against without, one model
configuration, rounds alternating.

The draft loads first (under --memory-limit its weights and KV cache are then part of what
the plan measures), then the model once. Each round decodes the same greedy tokens after
the same prompt without drafting and with each --num-draft-tokens, the order rotated by
round. Per row: whether the tokens equal the undrafted ones, the draft's acceptance, the
tokens a pass of the model yields, decode tokens/s (median of rounds) and the bytes the
model read from flash per token (its runtime's per-pass rows).
"""

import json
import platform
import time
from pathlib import Path

import numpy as np

PROMPT = "Write a long story about a dragon who loves to read."


def _decode(model, tok, ids, tokens, kwargs, acceptance=None):
    """(tokens, decode seconds after the first token, bytes read after the first token)."""
    from ..generate import stream_generate

    rows = getattr(getattr(model.runtime, "store", None), "stats", None)
    out, t1, n_rows = [], None, 0
    for resp in stream_generate(model, tok, ids, max_tokens=tokens, **kwargs):
        if t1 is None:
            t1 = time.perf_counter()
            if rows is not None:
                rows.end()
                n_rows = len(rows.rows)
        out.append(resp.token)
        if acceptance is not None:
            acceptance.add(resp.from_draft)
    t2 = time.perf_counter()
    read = 0
    if rows is not None:
        rows.end()
        read = sum(r["bytes_read"] for r in rows.rows[n_rows:])
    return out, t2 - t1, read


def run_speculative_bench(model_path, draft_spec, num_drafts, tokens, rounds, load_options, progress=print):
    import mlx_flash

    from ..draft import Acceptance, load_draft, speculative_cache
    from ..runtime.memory import DEFAULT_CONTEXT

    draft = load_draft(draft_spec, model_path)
    if load_options.get("memory_limit"):
        draft.allocate((load_options.get("ctx_size") or DEFAULT_CONTEXT) + max(num_drafts))
    model, tok = mlx_flash.load(model_path, **load_options)
    draft.check(tok, model)
    from mlx_lm.models.cache import make_prompt_cache

    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    names = ["none"] + [f"draft {n}" for n in num_drafts]
    res = {n: {"seconds": [], "bytes": [], "tokens": None, "accepted": [], "proposed": [], "passes": []} for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            kw = {"prompt_cache": make_prompt_cache(model)}
            acc = None
            if name != "none":
                n = int(name.split()[1])
                kw = {"draft_model": draft.model, "num_draft_tokens": n, "prompt_cache": speculative_cache(model, draft)}
                acc = Acceptance(n, tokens)
            out, secs, read = _decode(model, tok, ids, tokens, kw, acc)
            row = res[name]
            row["seconds"].append(secs)
            row["bytes"].append(read)
            row["tokens"] = row["tokens"] or out
            if acc is not None:
                row["accepted"].append(acc.accepted)
                row["proposed"].append(acc.proposed)
                row["passes"].append(acc.passes)
            progress(f"round {r + 1} {name}: {len(out)} tokens, {(len(out) - 1) / secs:.1f} tok/s"
                     + (f", accepted {acc.accepted}/{acc.proposed}" if acc else ""))
    base = res["none"]["tokens"]
    rows = []
    for name in names:
        x = res[name]
        n_dec = len(x["tokens"]) - 1
        tps = float(np.median([n_dec / s for s in x["seconds"]]))
        rows.append({"row": name, "identical": x["tokens"] == base, "tokens": len(x["tokens"]),
                     "tok_s": tps, "ms_per_token": 1e3 / tps if tps else None,
                     "mb_read_per_token": float(np.median(x["bytes"])) / max(1, n_dec) / 1e6,
                     "acceptance": (sum(x["accepted"]) / sum(x["proposed"])) if x["proposed"] else None,
                     "tokens_per_pass": (len(x["tokens"]) * len(x["passes"]) / sum(x["passes"])) if x["passes"] else 1.0,
                     "rounds_tok_s": [n_dec / s for s in x["seconds"]]})
    for row in rows:
        row["speedup"] = row["tok_s"] / rows[0]["tok_s"]
    s = model.runtime.stats()["summary"]
    return {"model": str(model_path), "draft": draft.description, "load": dict(load_options),
            "mode": s["mode"], "weights_in_dram_mb": s["weights_in_dram_bytes"] / 1e6,
            "memory_limit": s.get("memory_limit"), "peak_rss_mb": s["peak_rss_bytes"] / 1e6,
            "tokens": tokens, "rounds": rounds, "prompt": PROMPT, "machine": f"{platform.machine()} {platform.system()}",
            "rows": rows}


def markdown(res):
    lines = [f"# Speculative decoding: {res['model']}, {res['mode']}",
             "", f"draft: {res['draft']}; load: {json.dumps(res['load'])}; {res['tokens']} greedy tokens after a "
             f"chat prompt; {res['rounds']} rounds alternating; weights in DRAM {res['weights_in_dram_mb']:.1f} MB "
             f"(the model's; the draft's are besides); peak RSS {res['peak_rss_mb']:.0f} MB", "",
             "| drafting | tokens identical | draft tokens accepted | tokens a pass | tok/s | ms/token | MB read a token | speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        acc = "–" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f} %"
        lines.append(f"| {r['row']} | {'yes' if r['identical'] else 'NO'} | {acc} | {r['tokens_per_pass']:.2f} | "
                     f"{r['tok_s']:.1f} | {r['ms_per_token']:.1f} | {r['mb_read_per_token']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def write(res, out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"speculative-{res['mode']}" + ("-limit" if res["memory_limit"] else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    path = out / f"{stem}.md"
    path.write_text(markdown(res))
    return path

"""Decode speed of several configurations of one model, in alternating rounds.

decode_speed() loads every configuration once, then each round decodes `tokens` greedy
tokens after the same prompt with each configuration in turn, the order rotated by
round, so that drift of the machine spreads over all of them. Per configuration: the
median over rounds of the decode ms/token (each round's mean), the FFN bytes read from
flash per token, the share of the FFN's weights a token used (DIP-store sources), and
the weights in DRAM. A configuration that cannot load (its resident weights exceed the
budget, say) gets its error instead of figures.

Used by the quality table (`mlx_flash.eval --table ... --speed-tokens N`) and by
benchmarks/sparsity/speed/sparsity_speed.py.
"""

import time

import numpy as np

import mlx.core as mx

import mlx_flash

from ..errors import FlashError

PROMPT = "Explain in a few sentences why the sky is blue, and what changes at sunset."


def _decode(model, prompt, tokens):
    """Seconds of each decoded token after the prompt (greedy)."""
    from mlx_lm.generate import generate_step

    times, t = [], time.perf_counter()
    for i, _ in enumerate(generate_step(prompt, model, max_tokens=tokens + 1)):
        now = time.perf_counter()
        if i:  # the first yield comes after the prompt
            times.append(now - t)
        t = now
    return times


def decode_speed(model_path, configs, tokens=32, rounds=3, log=None):
    """configs: {name: load() keywords}. -> {name: {"ms_per_token", "rounds_ms", "bytes_per_token",
    "ffn_share", "weights_in_dram_bytes", "budget_bytes"} or {"error": message}}."""
    if tokens < 1 or rounds < 1:
        raise FlashError(f"decode speed needs at least one token and one round (got {tokens}, {rounds})")
    models, out, tok = {}, {}, None
    for name, kw in configs.items():
        try:
            models[name], tok = mlx_flash.load(model_path, **kw)
        except FlashError as e:
            out[name] = {"error": str(e)}
            if log:
                log(f"{name}: not measured: {e}")
    names = list(models)
    if not names:
        return out
    prompt = mx.array(tok.encode(PROMPT))
    res = {n: {"ms": [], "bytes": [], "share": []} for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            m = models[n]
            st = m.runtime.store.stats
            if st is not None:
                st.end()
                k0 = len(st.rows)
            res[n]["ms"].append(1e3 * float(np.mean(_decode(m, prompt, tokens))))
            if st is not None:
                st.end()
                rows = [x for x in st.rows[k0:] if x["tokens"] == 1]
                res[n]["bytes"].append(float(np.mean([x["bytes_read"] for x in rows])))
                res[n]["share"].append(float(np.mean([x["ffn_share"] for x in rows])))
        if log:
            log(f"speed round {r + 1}/{rounds}: " + ", ".join(f"{n} {res[n]['ms'][-1]:.1f}" for n in names))
    for n in names:
        s = models[n].runtime.stats()["summary"]
        share = float(np.median(res[n]["share"])) if res[n]["share"] and res[n]["share"][0] else None
        out[n] = {"ms_per_token": float(np.median(res[n]["ms"])), "rounds_ms": res[n]["ms"],
                  "bytes_per_token": float(np.median(res[n]["bytes"])) if res[n]["bytes"] else 0.0,
                  "ffn_share": share, "weights_in_dram_bytes": s["weights_in_dram_bytes"],
                  "budget_bytes": s["memory_budget_bytes"]}
        models[n].runtime.close()
    return {n: out[n] for n in configs}

"""Quality of every sparsity source at matched densities, and the predictor's own figures, in one table.

    .venv/bin/python scripts/quality_table.py                 # SmolLM2, about 45 minutes here
    .venv/bin/python scripts/quality_table.py --resume        # continue: rows already in the JSON are kept

Writes results/quality.md, results/quality.csv (one row per configuration),
results/quality_predictor.csv (one row per layer) and results/quality.json
(everything, with per-task timings and the runtime's statistics).

Rows: dense once, then per density (--densities): oracle (exact top-k |GLU|),
predictor (the calibrated low-rank predictors), threshold (the gate as
predictor, paper App. C.5), dip and dip-ca (Dynamic Input Pruning, plain and
cache-aware). Columns: WikiText-2 test perplexity, ARC-Easy, ARC-Challenge and
a HellaSwag subset (acc and acc_norm, lm-evaluation-harness style, with
standard errors), through mlx_flash.eval's harness.

How each row runs:
- dense: one forward per window / item (exact).
- oracle, predictor, threshold, dip: --batch-prefill (one forward per window /
  item), without a memory budget. Their masks are per-token functions of the
  FFN input, so neither the way nor the budget changes the score: a check
  below re-runs the predictor (and dip) token by token under the budget and
  compares every token's NLL.
- dip-ca: token by token under --budget; its choices depend on what its caches
  hold, so only the real decode path measures it. At ~0.3-0.5 s/token here
  that is WikiText only by default (--dip-ca-tokens); --dip-ca-items N adds
  the first N items of each multiple-choice task, token by token.

Second table: the predictor per layer — false-negative / false-positive rate
and predicted vs true density, from calibration (the manifest's held-out C4
tokens) and re-measured on WikiText-2 test tokens it never saw; the overlap of
its density-capped choice with the oracle's top-k (and the gate's); its time
(the runtime's predict_ms over the token time, token by token) and memory.
"""

import argparse
import csv
import io
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import mlx_flash  # first: it loads OpenBLAS for MLX, and sees numpy's own OpenBLAS as "preloaded"
import mlx.core as mx
import numpy as np

from mlx_flash.blas import blas_info
from mlx_flash.layout import read_manifest
from mlx_flash.eval.harness import evaluate, load_task, prefix_token, tokenize_stream, windows
from mlx_flash.models.ffn import layer_ffn
from mlx_flash.sparsity import PredictorSource, top_k_mask

SOURCES = ("oracle", "predictor", "threshold", "dip", "dip-ca")
TASKS = ("wikitext", "arc_easy", "arc_challenge", "hellaswag")
TASK_NAMES = {"wikitext": "WikiText-2", "arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge",
              "hellaswag": "HellaSwag"}
SOURCE_NOTES = {
    "dense": "every FFN row",
    "oracle": "exact top-k of |act(gate x) * up x|; keeps gate and up resident",
    "predictor": "low-rank predictor: p >= the layer's threshold, at most the top density*n by p",
    "threshold": "gate as predictor: top-k of |act(gate x)|; keeps the gate resident",
    "dip": "top-k of |x| (inputs), then top-k of the approximate |GLU| (neurons)",
    "dip-ca": "DIP with cache-aware masking (gamma 0.2, LFU)",
}


# --- what to run


def plan_configs(densities, mc_densities, budget, tokens, items, dip_ca_tokens, dip_ca_items):
    """Every row of the table, in order: a key, how to load it, and its per-task limits."""
    def limits(n_tokens, n_items, mc):
        return {t: (n_tokens if t == "wikitext" else (n_items.get(t, 0) if mc else 0)) for t in TASKS}

    configs = [dict(key="dense", source="dense", density=1.0, load=dict(mode="dense"), budget=None,
                    way="one pass", limits=limits(tokens, items, True))]
    for d in densities:
        mc = any(abs(d - m) < 1e-9 for m in mc_densities)
        for s in SOURCES:
            c = dict(key=f"{s}@{d:g}", source=s, density=d)
            if s == "dip-ca":  # cache-aware: only the real decode path, under the budget, measures it
                c.update(budget=budget, way="token by token",
                         limits=limits(dip_ca_tokens, {t: dip_ca_items for t in TASKS}, mc))
            else:
                c.update(budget=None, way="batch prefill", limits=limits(tokens, items, mc))
            c["load"] = dict(mode="flash", sparsity=s, density=d, memory_budget=c["budget"])
            configs.append(c)
    return configs


def subset(task, loaded, n, spread):
    """The items a row scores: the first n, or (spread) every len/n-th, so all sources are covered."""
    kind, data, desc = loaded
    if kind == "perplexity" or not spread:
        return loaded
    step = max(1, len(data) // max(n, 1))
    return kind, data[::step], f"{desc}, every {step}th item"


# --- one configuration


def run_config(model_path, c, tasks, context, spread, progress, bar):
    model, tok = mlx_flash.load(model_path, **c["load"])
    info = model.flash
    row = dict(key=c["key"], source=c["source"], density=c["density"], budget=c["budget"], way=c["way"],
               limits=c["limits"], tasks={})
    src = getattr(info["store"], "source", None)
    from mlx.utils import tree_flatten

    row["resident_bytes"] = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    row["source_bytes"] = getattr(src, "resident_bytes", 0) or 0
    row["model_bytes"] = info.get("model_bytes")
    row["budget_bytes"] = info.get("budget_bytes")
    t_row = time.perf_counter()
    for task in TASKS:
        n = c["limits"][task]
        if not n:
            continue
        bar.set_postfix_str(f"{c['key']} {task}")
        res = evaluate(model, tok, task, limit=n, context=context, incremental=c["way"] == "token by token",
                       loaded=subset(task, tasks[task], n, spread and task == "hellaswag"), progress=progress)
        m = dict(res["metrics"])
        out = dict(metrics=m, n=res["n"], seconds=res["seconds"], tokens_per_s=res["tokens_per_s"],
                   incremental=res["incremental"], data=res["data"])
        if res["kind"] == "perplexity":
            nll = res["nll"]
            head = nll[:min(len(nll), context)]
            out["first_window"] = dict(tokens=len(head), perplexity=math.exp(float(np.mean(head))))
            out["nll"] = [float(v) for v in nll]  # every token's: the checks compare against them
        row["tasks"][task] = out
        bar.update(1)
    row["seconds"] = time.perf_counter() - t_row
    row["stats"] = model.runtime.stats()["summary"]
    return row


def run_check(model_path, source, density, budget, n, context, batch_row, tasks, progress):
    """Token by token (under `budget`) against the batch-prefill row: every token's NLL."""
    model, tok = mlx_flash.load(model_path, mode="flash", sparsity=source, density=density,
                                memory_budget=budget)
    res = evaluate(model, tok, "wikitext", limit=n, context=context, incremental=True,
                   loaded=tasks["wikitext"], progress=progress)
    s = model.runtime.stats()["summary"]
    ref = np.array(batch_row["tasks"]["wikitext"]["nll"][:n])
    nll = res["nll"][: len(ref)]
    diff = np.abs(nll - ref)
    apart = np.flatnonzero(diff > 1e-3)
    return dict(source=source, density=density, budget=budget, tokens=len(nll),
                ppl_token_by_token=math.exp(float(np.mean(nll))), ppl_batch=math.exp(float(np.mean(ref))),
                max_abs_nll_diff=float(np.max(diff)), mean_abs_nll_diff=float(np.mean(diff)),
                first_apart=int(apart[0]) if apart.size else None, seconds=res["seconds"],
                **{k: s.get(k) for k in ("mean_total_ms", "mean_predict_ms", "mean_io_ms", "mean_mem_ms",
                                         "mean_compute_ms", "n_tokens")},
                source_bytes=getattr(getattr(model.runtime.store, "source", None), "resident_bytes", None),
                model_bytes=model.runtime.model_bytes, budget_bytes=model.runtime.budget_bytes)


# --- the predictor against the truth, per layer


class _Probe:
    """Wraps the dense store: per layer, counts how the predictor's choice meets the true active set."""

    def __init__(self, inner, ffns, source, target, cal_density, densities):
        self.inner, self.ffns, self.source = inner, ffns, source
        self.target, self.cal_density, self.densities = target, cal_density, densities
        keys = ["tokens", "pos", "neg", "tp", "fp", "pred"] + [f"{w}@{d:g}" for d in densities
                                                               for w in ("pred_overlap", "gate_overlap")]
        self.counts = [dict.fromkeys(keys, 0) for _ in ffns]

    def rows(self, layer, x):
        parts = self.inner.rows(layer, x)
        r = parts[0] if isinstance(parts, list) else parts
        ffn = self.ffns[layer]
        x2 = x.reshape(-1, x.shape[-1])
        g = ffn._act(x2 @ r.gate.T)
        h = np.abs(np.array((g * (x2 @ r.up.T)).astype(mx.float32)))
        g = np.abs(np.array(g.astype(mx.float32)))
        n = h.shape[-1]
        y = h != 0 if self.target == "relu" else top_k_mask(h, max(1, round(self.cal_density * n)))
        p = np.array(mx.sigmoid(self.source.layers[layer](x2)).astype(mx.float32))
        pred = p >= self.source.thresholds[layer]
        c = self.counts[layer]
        c["tokens"] += h.shape[0]
        c["pos"] += int(y.sum())
        c["neg"] += int((~y).sum())
        c["tp"] += int((pred & y).sum())
        c["fp"] += int((pred & ~y).sum())
        c["pred"] += int(pred.sum())
        for d in self.densities:  # at a matched density: the capped predictor and the gate vs the oracle
            k = max(1, round(d * n))
            oracle = top_k_mask(h, k)
            c[f"pred_overlap@{d:g}"] += int((oracle & pred & top_k_mask(p, k)).sum())
            c[f"gate_overlap@{d:g}"] += int((oracle & top_k_mask(g, k)).sum())
        return parts


def predictor_layers(model_path, text, n_tokens, context, densities, progress):
    """Per-layer figures: calibration's (manifest) and re-measured on the first n_tokens of `text`."""
    from tqdm import tqdm

    model, tok = mlx_flash.load(model_path)
    manifest = model.runtime.manifest
    cal = manifest.calibration
    source = PredictorSource(model.runtime.folder, manifest, 1.0, mx.float32)
    ffns = [layer_ffn(layer) for layer in model.layers]
    pcal = cal["predictors"]
    probe = _Probe(ffns[0].store, ffns, source, pcal.get("target", "topk"), pcal.get("density") or 0.5,
                   densities)
    for f in ffns:
        f.store = probe
    p = prefix_token(tok)
    head = [p] if p is not None else []
    seq = head + tokenize_stream(tok, text, n_tokens - len(head))
    t0 = time.perf_counter()
    for s, e in tqdm(windows(len(seq), context), desc="predictor probe", leave=False, disable=not progress):
        mx.eval(model(mx.array([seq[s:e]])))
    layers = []
    for i, (c, m) in enumerate(zip(probe.counts, cal.get("metrics") or [{}] * len(ffns))):
        n = c["tokens"] * ffns[i].n_neurons
        row = dict(layer=i, rank=pcal["ranks"][i], threshold=pcal["thresholds"][i],
                   cal_fn_rate=m.get("false_negative_rate"), cal_fp_rate=m.get("false_positive_rate"),
                   cal_predicted_density=m.get("predicted_density"), cal_true_density=m.get("true_density"),
                   fn_rate=1 - c["tp"] / max(c["pos"], 1), fp_rate=c["fp"] / max(c["neg"], 1),
                   predicted_density=c["pred"] / n, true_density=c["pos"] / n)
        for d in densities:
            k = max(1, round(d * ffns[i].n_neurons)) * c["tokens"]
            row[f"pred_overlap@{d:g}"] = c[f"pred_overlap@{d:g}"] / k
            row[f"gate_overlap@{d:g}"] = c[f"gate_overlap@{d:g}"] / k
        layers.append(row)
    return dict(tokens=len(seq), seconds=time.perf_counter() - t0, target=pcal.get("target"),
                cal_density=pcal.get("density"), cal_data=cal.get("data"), cal_tokens=cal.get("tokens"),
                cal_held_out_tokens=cal.get("held_out_tokens"), file_bytes=pcal.get("size"),
                resident_bytes=source.resident_bytes, layers=layers)


# --- the whole table


def run_table(model_path, out, tasks, configs, checks=(), probe_tokens=0, probe_densities=(0.5,),
              context=512, spread=True, resume=False, progress=True, meta=None, log=print):
    """Run every configuration not already in <out>.json (with resume), write .json/.csv/.md after each.

    tasks: {name: load_task() result}; configs: plan_configs(); checks: (source, density, budget,
    tokens) run token by token against that source's batch row at the same density.
    """
    from tqdm import tqdm

    out = Path(out)
    path = out.with_suffix(".json")
    state = json.loads(path.read_text()) if resume and path.exists() else {}
    state.setdefault("rows", {})
    state.setdefault("checks", {})
    state["meta"] = dict(state.get("meta") or {}, **(meta or {}))
    state["meta"].setdefault("started", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    state["meta"].setdefault("context", context)
    state["meta"].setdefault("budget", next((c["budget"] for c in configs if c.get("budget")), None))
    state["meta"].setdefault("flash_dtype", read_manifest(Path(model_path)).dtype)
    state["order"] = [c["key"] for c in configs]
    t_start = time.perf_counter()
    before = state["meta"].get("seconds", 0.0) if resume else 0.0  # work of the runs this one resumes

    def save():
        state["meta"]["seconds"] = before + time.perf_counter() - t_start
        write_outputs(state, out)

    def have(key, limits):
        r = state["rows"].get(key)
        return r is not None and r.get("limits") == limits

    todo = [c for c in configs if not have(c["key"], c["limits"])]
    check_keys = [f"{s}@{d:g}/{b or 'none'}/{n}" for s, d, b, n in checks]
    state["checks"] = {k: v for k, v in state["checks"].items() if k in check_keys}
    steps = (sum(sum(1 for v in c["limits"].values() if v) for c in todo)
             + sum(k not in state["checks"] for k in check_keys)
             + (1 if probe_tokens and state.get("predictor", {}).get("tokens_asked") != probe_tokens else 0))
    bar = tqdm(total=steps, desc="quality table", unit="step", disable=not progress, file=sys.stderr,
               mininterval=5)
    todo_keys = {c["key"] for c in todo}
    for c in configs:
        if c["key"] not in todo_keys:
            log(f"[resume] {c['key']}: kept")
            continue
        try:
            row = run_config(model_path, c, tasks, context, spread, progress, bar)
        except Exception as e:  # one failing configuration must not cost the others
            row = dict(key=c["key"], source=c["source"], density=c["density"], budget=c["budget"],
                       way=c["way"], limits=c["limits"], error=f"{type(e).__name__}: {e}", tasks={})
            bar.update(sum(1 for v in c["limits"].values() if v))
        state["rows"][c["key"]] = row
        save()
        bar.write(row_line(row))
    for (s, d, b, n), key in zip(checks, check_keys):
        if key in state["checks"]:
            continue
        bar.set_postfix_str(f"check {key}")
        ref = state["rows"].get(f"{s}@{d:g}")
        if ref is None or "wikitext" not in ref.get("tasks", {}):
            log(f"check {key}: no batch row {s}@{d:g} with WikiText to compare with; skipped")
        else:
            ch = run_check(model_path, s, d, b, n, context, ref, tasks, progress)
            state["checks"][key] = ch
            bar.write(f"check {key}: token by token ppl {ch['ppl_token_by_token']:.3f} vs batch "
                      f"{ch['ppl_batch']:.3f}, first |dNLL| > 1e-3 at {ch['first_apart']}, max {ch['max_abs_nll_diff']:.2e}; predict "
                      f"{ch['mean_predict_ms']:.1f} of {ch['mean_total_ms']:.1f} ms/token")
            save()
        bar.update(1)
    if probe_tokens and state.get("predictor", {}).get("tokens_asked") != probe_tokens:
        bar.set_postfix_str("predictor probe")
        pr = predictor_layers(model_path, tasks["wikitext"][1], probe_tokens, context, probe_densities,
                              progress)
        pr["tokens_asked"] = probe_tokens
        state["predictor"] = pr
        save()
        bar.update(1)
        bar.write(f"predictor probe: {pr['tokens']} WikiText tokens, mean FN rate "
                  f"{np.mean([r['fn_rate'] for r in pr['layers']]):.3f}, predicted density "
                  f"{np.mean([r['predicted_density'] for r in pr['layers']]):.3f}")
    bar.close()
    state["meta"]["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    save()
    return state


# --- output


def _pm(v, se, digits=3):
    if v is None:
        return "—"
    if se is None or (isinstance(se, float) and math.isnan(se)):
        return f"{v:.{digits}f}"
    return f"{v:.{digits}f} ± {se:.{digits}f}"


def _ppl(v):
    return f"{v:.2f}" if v < 1000 else f"{v:.0f}"


def _cells(row):
    """Markdown cells of one row's scores."""
    t = row.get("tasks", {})
    cells = []
    w = t.get("wikitext")
    if w:
        m = w["metrics"]
        ppl = f"{_ppl(m['perplexity'])} ± {_ppl(m['perplexity_stderr'])}" if w["n"] > w["first_window"]["tokens"] else "—"
        cells += [ppl, _ppl(w["first_window"]["perplexity"])]
    else:
        cells += ["—", "—"]
    for task in TASKS[1:]:
        r = t.get(task)
        if r is None:
            cells.append("—")
            continue
        m = r["metrics"]
        cells.append(f"{_pm(m['acc'], m['acc_stderr'], 2)} / {_pm(m['acc_norm'], m['acc_norm_stderr'], 2)}")
    return cells


def row_line(row):
    if "error" in row:
        return f"{row['key']:>14}: {row['error']}"
    return f"{row['key']:>14} ({row['way']}, {row['seconds']:.0f} s): " + " | ".join(_cells(row))


def _budget_text(row):
    if row["source"] == "dense":
        return "— (all in DRAM)"
    if row.get("budget"):
        return f"{row['budget']} ({row['budget_bytes'] / 1e6:.0f} MB)" if row.get("budget_bytes") else row["budget"]
    return "none"


def csv_rows(state):
    out = []
    for key in state["order"]:
        r = state["rows"].get(key)
        if r is None:
            continue
        d = dict(key=key, source=r["source"], density=r["density"], budget=r.get("budget") or "",
                 way=r["way"], error=r.get("error", ""))
        w = r.get("tasks", {}).get("wikitext")
        d.update(wikitext_tokens=w["n"] if w else "", wikitext_ppl=w["metrics"]["perplexity"] if w else "",
                 wikitext_ppl_stderr=w["metrics"]["perplexity_stderr"] if w else "",
                 wikitext_bits_per_byte=w["metrics"].get("bits_per_byte", "") if w else "",
                 wikitext_first_tokens=w["first_window"]["tokens"] if w else "",
                 wikitext_first_ppl=w["first_window"]["perplexity"] if w else "")
        for task in TASKS[1:]:
            t = r.get("tasks", {}).get(task)
            d[f"{task}_items"] = t["n"] if t else ""
            for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
                d[f"{task}_{k}"] = t["metrics"][k] if t else ""
        d["seconds"] = r.get("seconds", "")
        d["source_resident_bytes"] = r.get("source_bytes", "")
        out.append(d)
    return out


def _write_csv(path, rows):
    if not rows:
        return
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    _atomic_write(path, buf.getvalue())


def _atomic_write(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def markdown(state):
    meta, rows = state["meta"], state["rows"]
    lim = meta.get("limits", {})
    lines = [f"# Quality vs sparsity: {meta.get('model', '')}", ""]
    if meta.get("command"):
        lines += [f"`{meta['command']}`", ""]
    spent = meta.get("seconds", 0.0)
    lines += [
        f"- Machine: {meta.get('machine', '')}; BLAS {meta.get('blas', '')}; MLX {meta.get('mlx', '')}.",
        f"- Weights {meta.get('flash_dtype')} on flash, compute {meta.get('dtype', 'float32')}. Run {meta.get('started', '')} "
        f"to {meta.get('finished', 'unfinished')}, {spent / 60:.0f} min of work.",
        f"- Limits: WikiText-2 test, first {lim.get('tokens')} tokens in windows of {meta.get('context')} "
        f"(dip-ca: the first {lim.get('dip_ca_tokens')}, token by token); ARC-Easy and ARC-Challenge test, "
        f"the first {lim.get('arc_easy')} and {lim.get('arc_challenge')} items; HellaSwag validation, "
        f"{lim.get('hellaswag')} items" + (" spread over the split (every len/n-th)" if meta.get("spread") else "")
        + f". Multiple choice at density {', '.join(f'{d:g}' for d in meta.get('mc_densities', []))} "
        "(and dense)" + (f"; dip-ca on the first {lim.get('dip_ca_items')} items, token by token"
                         if lim.get("dip_ca_items") else "; dip-ca: WikiText only") + ".",
        f"- Budget: {meta.get('budget')} of the model's float32 weights for dip-ca (token by token); none for "
        "the batch-prefill rows, whose scores do not depend on it (up to float rounding: see the check below).",
        "",
        "| source | density | budget | how | WikiText-2 ppl | ppl, first "
        f"{meta.get('context')} tok | ARC-E acc / acc_norm | ARC-C acc / acc_norm | HellaSwag acc / acc_norm | time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in state["order"]:
        r = rows.get(key)
        if r is None:
            lines.append(f"| {key} | | | not run yet | | | | | | |")
            continue
        dens = f"{r['density']:.0%}"
        if "error" in r:
            lines.append(f"| {r['source']} | {dens} | {_budget_text(r)} | {r['way']} | error: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['source']} | {dens} | {_budget_text(r)} | {r['way']} | " + " | ".join(_cells(r))
                     + f" | {r['seconds'] / 60:.1f} min |")
    lines += ["", "Notes:", ""]
    lines += [f"- **{s}**: {t}." for s, t in SOURCE_NOTES.items()]
    lines += [
        "- **density** is the fraction of FFN neurons a token uses (dip / dip-ca: of the input dims and of the "
        "neurons, so of the FFN weights). The predictor's density is a cap: `PredictorSource.select` keeps "
        "the neurons with p >= the layer's calibrated threshold (chosen for 95 % recall of the calibration "
        "target), and of those at most the density*n with the highest p." + _cap_note(state.get("predictor")),
        "- **budget**: threshold keeps the whole gate resident and oracle gate and up, so neither can meet a "
        "50 % budget (with the attention and embeddings they exceed it before any cache); they run without one. "
        "oracle / predictor / threshold / dip give every token its own mask from its own FFN input, so their "
        "scores depend on neither the budget nor batch vs token by token (up to rounding: see the check); "
        "dip-ca's do, so it runs as a user decodes, token by token under the budget, its caches carried over "
        "from token to token.",
        "- ppl ± is the delta-method standard error (tokens taken as independent: an underestimate); acc ± "
        "the binomial standard error. 'first N tok' is the first window alone, the only WikiText figure every "
        "row has.",
    ]
    if not (meta.get("limits") or {}).get("dip_ca_items"):
        lines.append(
            "- dip-ca multiple choice is not run by default: token by token an ARC item costs ~50-100 tokens and "
            "a HellaSwag item ~100-400 (0.4-0.8 s each here), and batch prefill is not what a user of dip-ca "
            "gets (its choices depend on the cache state token by token); without a budget dip-ca's cache "
            "holds everything and it is no longer dip-ca. `--dip-ca-items N` runs N items token by token.")
    if state.get("checks"):
        lines += ["", "Batch prefill vs token by token (WikiText-2, the first tokens; token by token through the "
                  "runtime's caches under the stated budget, against the batch-prefill row, run without one):", "",
                  "| source | density | budget | tokens | ppl token by token | ppl batch prefill | "
                  "first token with abs ΔNLL > 1e-3 | mean abs ΔNLL | max abs ΔNLL |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for ch in state["checks"].values():
            first = "none" if ch.get("first_apart") is None else str(ch["first_apart"])
            lines.append(f"| {ch['source']} | {ch['density']:.0%} | {ch['budget'] or 'none'} | {ch['tokens']} | "
                         f"{ch['ppl_token_by_token']:.3f} | {ch['ppl_batch']:.3f} | {first} | "
                         f"{ch.get('mean_abs_nll_diff', float('nan')):.1e} | {ch['max_abs_nll_diff']:.1e} |")
        lines += ["", "The two ways compute the same thing in exact arithmetic (every token's mask is a function of "
                  "its own FFN input), but not the same float32 rounding (GEMM over a window vs GEMV per token, "
                  "sums over cache and scratch parts). A top-k whose k-th and (k+1)-th scores are that close "
                  "(e.g. |x| 0.0859968 vs 0.0859972: dip 50 %, no budget, layer 18, token 9) flips, the flip changes the "
                  "FFN output by two borderline neurons, and at these densities the model amplifies it: from "
                  "then on the two runs are different samples of the same noise. Identical when no tie flips "
                  "(tests/test_quality_table.py, tiny model); on SmolLM2 within the rows' standard errors."]
    lines += predictor_markdown(state)
    return "\n".join(lines) + "\n"


def _cap_note(pr):
    if not pr:
        return ""
    th = [r["threshold"] for r in pr["layers"]]
    pd = [r["predicted_density"] for r in pr["layers"]]
    return (f" Here the thresholds are {min(th):.2f}-{max(th):.2f} and select {min(pd):.0%}-{max(pd):.0%} of "
            "each layer's neurons (WikiText probe below), so wherever the cap is below that, the predictor row "
            "is the top-k of p.")


def predictor_markdown(state):
    pr = state.get("predictor")
    lines = []
    checks = [c for c in state.get("checks", {}).values() if c["source"] == "predictor"]
    if not pr and not checks:
        return lines
    lines += ["", "## The predictor", ""]
    if checks:
        lines.append("Overhead in time (token by token, the runtime's `predict_ms` over the whole token; "
                     "paper App. B.3: 2.4-4.8 %):")
        lines.append("")
        lines.append("| density | budget | tokens | ms/token | predict ms | % of token | % of token without I/O |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for c in checks:
            tot, pm, io_ = c["mean_total_ms"], c["mean_predict_ms"], c["mean_io_ms"] + c["mean_mem_ms"]
            lines.append(f"| {c['density']:.0%} | {c['budget'] or 'none'} | {c['n_tokens']} | {tot:.1f} | {pm:.2f} | "
                         f"{100 * pm / tot:.1f} % | {100 * pm / max(tot - io_, 1e-9):.1f} % |")
        lines.append("")
    if pr:
        mb = next((r["model_bytes"] for r in list(state["rows"].values()) + checks if r.get("model_bytes")), None)
        mem = f"Memory: the predictors hold {pr['resident_bytes'] / 1e6:.1f} MB in DRAM (float32; file " \
              f"{(pr['file_bytes'] or 0) / 1e6:.1f} MB)"
        if mb:
            mem += f", {100 * pr['resident_bytes'] / mb:.1f} % of the model's {mb / 1e6:.0f} MB of float32 weights"
            mem += f" ({100 * pr['resident_bytes'] / (mb / 2):.0f} % of a 50 % budget)"
        lines += [mem + ".", ""]
        ds = sorted({k.split("@")[1] for k in pr["layers"][0] if k.startswith("pred_overlap@")}, key=float)
        lines.append(
            f"Per layer: calibration's figures (the manifest: {pr['cal_held_out_tokens']} held-out tokens of "
            f"{pr['cal_data']}, target the top-{pr['cal_density']:.0%} |GLU| set) and the same re-measured on the "
            f"first {pr['tokens']} tokens of WikiText-2 test (never seen in calibration). FN = missed active "
            "neurons / active, FP = selected inactive / inactive, density = selected / all. 'overlap @ d': of the "
            "oracle's top-d neurons, the fraction the predictor capped at d (and the gate's top-d, the "
            "threshold source) also picks.")
        lines.append("")
        head = "| layer | rank | threshold | cal. FN | cal. FP | cal. pred / true density | WikiText FN | " \
               "WikiText FP | WikiText pred / true density | " + " | ".join(
                   f"overlap @ {float(d):.0%}: predictor / gate" for d in ds) + " |"
        lines += [head, "|" + " --- |" * (9 + len(ds))]
        f = lambda v: "—" if v is None else f"{v:.3f}"
        for r in pr["layers"]:
            lines.append(
                f"| {r['layer']} | {r['rank']} | {r['threshold']:.2f} | {f(r['cal_fn_rate'])} | {f(r['cal_fp_rate'])} | "
                f"{f(r['cal_predicted_density'])} / {f(r['cal_true_density'])} | {f(r['fn_rate'])} | {f(r['fp_rate'])} | "
                f"{f(r['predicted_density'])} / {f(r['true_density'])} | " + " | ".join(
                    f"{r['pred_overlap@' + d]:.3f} / {r['gate_overlap@' + d]:.3f}" for d in ds) + " |")
        mean = lambda k: float(np.mean([r[k] for r in pr["layers"] if r.get(k) is not None] or [float("nan")]))
        lines.append(
            f"| mean | | | {mean('cal_fn_rate'):.3f} | {mean('cal_fp_rate'):.3f} | {mean('cal_predicted_density'):.3f} / "
            f"{mean('cal_true_density'):.3f} | {mean('fn_rate'):.3f} | {mean('fp_rate'):.3f} | "
            f"{mean('predicted_density'):.3f} / {mean('true_density'):.3f} | " + " | ".join(
                f"{mean('pred_overlap@' + d):.3f} / {mean('gate_overlap@' + d):.3f}" for d in ds) + " |")
    return lines


def write_outputs(state, out):
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out.with_suffix(".json"), json.dumps(state, indent=1, default=_jsonable))
    _write_csv(out.with_suffix(".csv"), csv_rows(state))
    if state.get("predictor"):
        _write_csv(out.with_name(out.name + "_predictor.csv"), state["predictor"]["layers"])
    _atomic_write(out.with_suffix(".md"), markdown(state))


def _jsonable(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--out", default="results/quality", help="writes <out>.md, .csv, .json, _predictor.csv")
    p.add_argument("--densities", default="0.75,0.5,0.25")
    p.add_argument("--mc-densities", default="0.5",
                   help="densities that also run the multiple-choice tasks (each costs ~5 min per source here)")
    p.add_argument("--budget", default="50%", help="dip-ca's memory budget (and the checks')")
    p.add_argument("--tokens", type=int, default=2048, help="WikiText-2 tokens, dense and batch-prefill rows")
    p.add_argument("--context", type=int, default=512, help="perplexity window")
    p.add_argument("--arc-easy", type=int, default=100, help="ARC-Easy test items (from the start)")
    p.add_argument("--arc-challenge", type=int, default=80, help="ARC-Challenge test items (from the start)")
    p.add_argument("--hellaswag", type=int, default=50, help="HellaSwag validation items (spread over the split)")
    p.add_argument("--dip-ca-tokens", type=int, default=512, help="WikiText-2 tokens for dip-ca, token by token")
    p.add_argument("--dip-ca-items", type=int, default=0,
                   help="multiple-choice items for dip-ca, token by token (default none: slow)")
    p.add_argument("--check-tokens", type=int, default=256,
                   help="tokens of the token-by-token checks (predictor and dip at 50%%); 0: none")
    p.add_argument("--probe-tokens", type=int, default=2048,
                   help="WikiText-2 tokens to re-measure the predictor per layer; 0: none")
    p.add_argument("--data-dir", default=None, help="data sets (default $MLX_FLASH_DATA or ../shared/data)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in <out>.json")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)

    densities = [float(d) for d in a.densities.split(",") if d]
    mc_densities = [float(d) for d in a.mc_densities.split(",") if d]
    items = {"arc_easy": a.arc_easy, "arc_challenge": a.arc_challenge, "hellaswag": a.hellaswag}
    configs = plan_configs(densities, mc_densities, a.budget, a.tokens, items, a.dip_ca_tokens, a.dip_ca_items)
    need = {t for c in configs for t, n in c["limits"].items() if n} | {"wikitext"}
    tasks = {t: load_task(t, data_dir=a.data_dir) for t in TASKS if t in need}
    checks = []
    if a.check_tokens and 0.5 in densities:
        checks = [("predictor", 0.5, a.budget, a.check_tokens), ("predictor", 0.5, None, a.check_tokens),
                  ("dip", 0.5, a.budget, a.check_tokens)]
    meta = dict(
        command="python scripts/quality_table.py" + "".join(  # --resume does not change what the table holds
            f" {x}" for x in (argv if argv is not None else sys.argv[1:]) if x != "--resume"),
        model=a.model, machine=f"{platform.machine()} {platform.system()} ({platform.platform()}, {os.cpu_count()} CPUs)",
        blas=blas_info(), mlx=mx.__version__, dtype="float32" if mx.default_device() == mx.cpu else "flash dtype",
        context=a.context, budget=a.budget, densities=densities, mc_densities=mc_densities, spread=True,
        limits=dict(tokens=a.tokens, dip_ca_tokens=a.dip_ca_tokens, dip_ca_items=a.dip_ca_items, **items,
                    check_tokens=a.check_tokens, probe_tokens=a.probe_tokens))
    t0 = time.perf_counter()
    state = run_table(a.model, a.out, tasks, configs, checks, a.probe_tokens, densities, a.context,
                      spread=True, resume=a.resume, progress=not a.no_progress, meta=meta)
    print(markdown(state))
    print(f"wrote {a.out}.md/.csv/.json in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

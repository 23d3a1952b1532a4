"""The quality table's outputs: owns <out>.md, <out>.csv, <out>_predictor.csv and <out>.json.

Writers only (markdown(), csv_rows(), write_outputs(), row_line()): what a
table state holds, as mlx_flash.eval.table builds it, turned into files. The
table's columns (TASKS) and the notes on each source live here too.
"""

import csv
import io
import json
import math
import os
from pathlib import Path

import numpy as np

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
    "calibrated": "DIP's two sides with per-layer thresholds searched on C4 (mlx_flash.calibrate)",
    "calibrated-ca": "calibrated with cache-aware masking (gamma 0.2, LFU)",
    "calibrated-uniform": "calibrated's thresholds at --density for every layer (the search's ablation)",
}


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
        sp = (state.get("speed") or {}).get("rows", {}).get(key) or {}
        d["decode_ms_per_token"] = sp.get("ms_per_token", "")
        d["ffn_bytes_read_per_token"] = sp.get("bytes_per_token", "")
        d["ffn_share_used"] = sp.get("ffn_share", "") if sp.get("ffn_share") is not None else ""
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
    lines += [f"- **{s}**: {t}." for s, t in source_notes(state).items()]
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
    lines += speed_markdown(state)
    lines += predictor_markdown(state)
    return "\n".join(lines) + "\n"


def _wikitext_ppl(row):
    w = (row or {}).get("tasks", {}).get("wikitext")
    return w["metrics"]["perplexity"] if w else None


def speed_points(state):
    """[(key, source, density, ppl, speed row)] of the decode-speed measurement; hybrid is
    exact, so its perplexity is the dense row's."""
    sp = state.get("speed")
    if not sp:
        return []
    out = []
    for key, r in sp["rows"].items():
        row = state["rows"].get("dense" if key == "hybrid" else key)
        source, density = (key, 1.0) if key in ("dense", "hybrid") else (row["source"], row["density"])
        out.append((key, source, density, _wikitext_ppl(row), r))
    return out


def speed_markdown(state):
    sp = state.get("speed")
    if not sp:
        return []
    a = sp["args"]
    hybrid = sp["rows"].get("hybrid", {}).get("ms_per_token")
    lines = ["", f"## Decode speed under --memory-budget {a['budget']}", "",
             f"Each configuration loaded once (dense without a budget, the others in their mode under the budget: "
             f"hybrid, the best exact mode, and every sparse row in flash mode); {a['rounds']} rounds of "
             f"{a['tokens']} greedy tokens after the same prompt, the order rotated by round; the median of the "
             "rounds' means. FFN bytes read from flash per token; the share of the FFN's weights a token used "
             "(DIP-store sources). Perplexity: the row's WikiText-2 figure above (hybrid is exact: dense's).", "",
             "| configuration | WikiText-2 ppl | ms/token | tokens/s | vs hybrid | FFN MB read/token | "
             "FFN weights used | weights in DRAM MB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, _, _, ppl, r in speed_points(state):
        p = "—" if ppl is None else _ppl(ppl)
        if "error" in r:
            lines.append(f"| {key} | {p} | not measured: {r['error']} | | | | | |")
            continue
        ms = r["ms_per_token"]
        rel = f"{hybrid / ms:.2f}×" if hybrid else "—"
        used = "" if r.get("ffn_share") is None else f"{100 * r['ffn_share']:.1f} %"
        lines.append(f"| {key} | {p} | {ms:.1f} | {1e3 / ms:.1f} | {rel} | {r['bytes_per_token'] / 1e6:.3f} | "
                     f"{used} | {r['weights_in_dram_bytes'] / 1e6:.1f} |")
    return lines


def write_plot(state, out, log=print):
    """<out>.png: WikiText-2 perplexity against decode tokens/s, one curve per source (its
    densities), dense and hybrid as points. Nothing (a line says so) without matplotlib."""
    points = [p for p in speed_points(state) if p[3] is not None and "error" not in p[4]]
    if not points:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no plot: matplotlib is not installed (pip install 'mlx-flash[bench]')")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for source in dict.fromkeys(p[1] for p in points):
        pts = sorted((p for p in points if p[1] == source), key=lambda p: p[2])
        xs, ys = [1e3 / p[4]["ms_per_token"] for p in pts], [p[3] for p in pts]
        if source in ("dense", "hybrid"):
            ax.scatter(xs, ys, marker="*" if source == "dense" else "s", s=90, label=source, zorder=3)
            continue
        ax.plot(xs, ys, marker="o", label=source)
        for x, y, p in zip(xs, ys, pts):
            ax.annotate(f"{p[2]:.0%}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel(f"decode tokens/s (--memory-budget {state['speed']['args']['budget']})")
    ax.set_ylabel("WikiText-2 perplexity")
    ax.set_title(f"Quality against speed: {Path(state['meta'].get('model', '')).name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(out).with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def source_notes(state):
    """SOURCE_NOTES, and for a row's source the notes lack (a newer source of the registry), the
    first line of its class's docstring."""
    notes = dict(SOURCE_NOTES)
    for r in state["rows"].values():
        if r["source"] not in notes:
            from ..sparsity import sources

            doc = (getattr(sources().get(r["source"]), "__doc__", None) or "").strip()
            notes[r["source"]] = doc.splitlines()[0].rstrip(".") if doc else "a sparsity source"
    return notes


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

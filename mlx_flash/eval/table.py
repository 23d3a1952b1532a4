"""The quality table: owns its configurations (plan_configs), running them (run_config, the
token-by-token checks, the predictor probe), resume, and the whole run (quality_table);
the files it writes are mlx_flash.eval.table_report's.

    mlx_flash.eval --table out/quality                # SmolLM2, about 45 minutes here
    mlx_flash.eval --table out/quality --resume       # continue: rows already in the JSON are kept

Writes out/quality.md, out/quality.csv (one row per configuration),
out/quality_predictor.csv (one row per layer) and out/quality.json
(everything, with per-task timings and the runtime's statistics).

Rows: dense once, then per density (--densities) every sparsity source of the
registry (mlx_flash.sparsity.source_names()): oracle (exact top-k |GLU|),
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
- dip-ca (a cache-aware source): token by token under --budget; its choices
  depend on what its caches hold, so only the real decode path measures it. At
  ~0.3-0.5 s/token here that is WikiText only by default (--dip-ca-tokens);
  --dip-ca-items N adds the first N items of each multiple-choice task, token
  by token.

Second table: the predictor per layer — false-negative / false-positive rate
and predicted vs true density, from calibration (the manifest's held-out C4
tokens) and re-measured on WikiText-2 test tokens it never saw; the overlap of
its density-capped choice with the oracle's top-k (and the gate's); its time
(the runtime's predict_ms over the token time, token by token) and memory.

Everything is measured through the public runtime: mlx_flash.load(), the model's
`model.runtime` (stats(), wrap_store() for the probe), nothing inside a store.
"""

import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_flash

from ..blas import blas_info
from ..errors import FlashError
from ..layout import read_manifest
from ..models.ffn import layer_ffn
from ..sparsity import source_class, source_names, top_k_mask
from ..sparsity.predictor import PredictorSource
from .harness import evaluate, load_task, prefix_token, tokenize_stream, windows
from .speed import decode_speed
from .table_report import SOURCE_NOTES, TASKS, markdown, row_line, write_outputs, write_plot  # noqa: F401


def _sources():
    """The registry's sources, in the table's order: those SOURCE_NOTES describes first, in its
    order (exact, learned, gate, inputs, cache-aware), then any other source by name."""
    order = list(SOURCE_NOTES)
    names = source_names()
    return tuple(sorted(names, key=lambda s: (order.index(s) if s in order else len(order), s)))


SOURCES = _sources()


def cache_aware(source):
    """A source whose choices depend on what its caches hold: only the real decode path measures it."""
    return bool(getattr(source_class(source), "cache_aware", False))


# --- what to run


def plan_configs(densities, mc_densities, budget, tokens, items, dip_ca_tokens, dip_ca_items, sources=None):
    """Every row of the table, in order: a key, how to load it, and its per-task limits.

    sources: the sparsity sources (default SOURCES: every source of the registry); a
    cache-aware one (dip-ca) runs token by token under `budget`, on dip_ca_tokens / dip_ca_items."""
    def limits(n_tokens, n_items, mc):
        return {t: (n_tokens if t == "wikitext" else (n_items.get(t, 0) if mc else 0)) for t in TASKS}

    configs = [dict(key="dense", source="dense", density=1.0, load=dict(mode="dense"), budget=None,
                    way="one pass", limits=limits(tokens, items, True))]
    for d in densities:
        mc = any(abs(d - m) < 1e-9 for m in mc_densities)
        for s in SOURCES if sources is None else sources:
            c = dict(key=f"{s}@{d:g}", source=s, density=d)
            if cache_aware(s):  # only the real decode path, under the budget, measures it
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
    rt = model.runtime
    summary = rt.stats()["summary"]
    row = dict(key=c["key"], source=c["source"], density=c["density"], budget=c["budget"], way=c["way"],
               limits=c["limits"], tasks={})
    row["resident_bytes"] = summary["resident_bytes"]
    row["source_bytes"] = summary["source_bytes"]
    row["model_bytes"] = rt.model_bytes
    row["budget_bytes"] = rt.budget_bytes
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
    row["stats"] = rt.stats()["summary"]
    return row


def run_check(model_path, source, density, budget, n, context, batch_row, tasks, progress):
    """Token by token (under `budget`) against the batch-prefill row: every token's NLL."""
    model, tok = mlx_flash.load(model_path, mode="flash", sparsity=source, density=density,
                                memory_budget=budget)
    res = evaluate(model, tok, "wikitext", limit=n, context=context, incremental=True,
                   loaded=tasks["wikitext"], progress=progress)
    rt = model.runtime
    s = rt.stats()["summary"]
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
                source_bytes=s["source_bytes"], model_bytes=rt.model_bytes, budget_bytes=rt.budget_bytes)


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
    rt = model.runtime
    manifest = rt.manifest
    cal = manifest.calibration
    source = PredictorSource(rt.folder, manifest, 1.0, mx.float32)
    ffns = [layer_ffn(layer) for layer in model.layers]
    pcal = cal["predictors"]
    probe = rt.wrap_store(lambda store: _Probe(store, ffns, source, pcal.get("target", "topk"),
                                               pcal.get("density") or 0.5, densities))
    p = prefix_token(tok)
    head = [p] if p is not None else []
    seq = head + tokenize_stream(tok, text, n_tokens - len(head))
    t0 = time.perf_counter()
    try:
        for s, e in tqdm(windows(len(seq), context), desc="predictor probe", leave=False, disable=not progress):
            mx.eval(model(mx.array([seq[s:e]])))
    finally:
        rt.unwrap_store()
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


def speed_configs(configs, budget):
    """The decode-speed measurement's configurations: dense without a budget, the best exact mode
    (hybrid: half the FFN resident, the rest read per token) and every sparse row in flash mode,
    under `budget`."""
    out = {"dense": dict(mode="dense"), "hybrid": dict(mode="hybrid", memory_budget=budget)}
    for c in configs:
        if c["source"] != "dense":
            out[c["key"]] = c["load"] | dict(memory_budget=budget)
    return out


def flash_weights(manifest):
    """What the FFN rows are on flash: a dtype, or bits, group and scales"""
    q = manifest.layout.quant
    return manifest.dtype if q is None else f"{q.bits}-bit group {q.group_size} ({q.scale_dtype} scales)"


def open_state(path, resume, meta, context, configs, model_path):
    """The table's state: the JSON of an earlier run (with resume) or a new one, its meta
    completed and the order of `configs`."""
    state = json.loads(path.read_text()) if resume and path.exists() else {}
    state.setdefault("rows", {})
    state.setdefault("checks", {})
    state["meta"] = dict(state.get("meta") or {}, **(meta or {}))
    state["meta"].setdefault("started", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    state["meta"].setdefault("context", context)
    state["meta"].setdefault("budget", next((c["budget"] for c in configs if c.get("budget")), None))
    state["meta"].setdefault("flash_dtype", flash_weights(read_manifest(Path(model_path))))
    state["order"] = [c["key"] for c in configs]
    return state


def run_rows(state, configs, todo_keys, model_path, tasks, context, spread, progress, bar, save, log):
    """Every configuration of `todo_keys` run (one failing is its row's error, not the table's),
    each row saved as it ends; the others kept."""
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


def run_checks(state, checks, check_keys, model_path, context, tasks, progress, bar, save, log):
    """The token-by-token checks not yet in the state, each against its source's batch row."""
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


def run_probe(state, model_path, tasks, probe_tokens, context, probe_densities, progress, bar, save):
    """The predictor probe on `probe_tokens` WikiText tokens, into the state."""
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


def run_speed(state, configs, speed, model_path, out, save, log):
    """The decode-speed measurement of every row (speed: (tokens, rounds, budget)), unless the
    state holds one of the same arguments; then its plot."""
    tokens, rounds, budget = speed
    plan = speed_configs(configs, budget)
    args = dict(tokens=tokens, rounds=rounds, budget=budget, configs=list(plan))
    if state.get("speed", {}).get("args") != args:
        log(f"decode speed: {len(plan)} configurations under --memory-budget {budget}, {rounds} alternating "
            f"rounds of {tokens} tokens")
        state["speed"] = dict(args=args, rows=decode_speed(model_path, plan, tokens, rounds, log=log))
        save()
    else:
        log("[resume] decode speed: kept")
    write_plot(state, out)


def run_table(model_path, out, tasks, configs, checks=(), probe_tokens=0, probe_densities=(0.5,),
              context=512, spread=True, resume=False, progress=True, meta=None, log=print, speed=None):
    """Run every configuration not already in <out>.json (with resume), write .json/.csv/.md after each.

    tasks: {name: load_task() result}; configs: plan_configs(); checks: (source, density, budget,
    tokens) run token by token against that source's batch row at the same density; speed:
    (tokens, rounds, budget) of the decode-speed measurement of every row (speed_configs), or None.
    """
    from tqdm import tqdm

    out = Path(out)
    state = open_state(out.with_suffix(".json"), resume, meta, context, configs, model_path)
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
    probe = probe_tokens and state.get("predictor", {}).get("tokens_asked") != probe_tokens
    steps = (sum(sum(1 for v in c["limits"].values() if v) for c in todo)
             + sum(k not in state["checks"] for k in check_keys) + (1 if probe else 0))
    bar = tqdm(total=steps, desc="quality table", unit="step", disable=not progress, file=sys.stderr,
               mininterval=5)
    run_rows(state, configs, {c["key"] for c in todo}, model_path, tasks, context, spread, progress, bar, save, log)
    run_checks(state, checks, check_keys, model_path, context, tasks, progress, bar, save, log)
    if probe:
        run_probe(state, model_path, tasks, probe_tokens, context, probe_densities, progress, bar, save)
    bar.close()
    if speed:
        run_speed(state, configs, speed, model_path, out, save, log)
    state["meta"]["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    save()
    return state




# --- the whole run, as `mlx_flash.eval --table OUT` makes it


def quality_table(model_path, out, densities=(0.75, 0.5, 0.25), mc_densities=(0.5,), budget="50%",
                  tokens=2048, context=512, arc_easy=100, arc_challenge=80, hellaswag=50, dip_ca_tokens=512,
                  dip_ca_items=0, check_tokens=256, probe_tokens=2048, data_dir=None, resume=False,
                  progress=True, command=None, log=print, sources=None, speed_tokens=0, speed_rounds=3):
    """The table of every source at `densities`, written to <out>.md/.csv/.json (and
    <out>_predictor.csv); returns its state. FlashError for a mistake in the arguments, a
    missing model or data set, before any configuration runs.

    mc_densities: those that also run the multiple-choice tasks (arc_easy / arc_challenge
    items from the start, hellaswag spread over the split); budget: dip-ca's memory budget
    and the checks'; tokens: WikiText-2 tokens of the dense and batch-prefill rows; the
    checks (predictor and dip at 50 %, check_tokens, token by token) need 0.5 in densities;
    probe_tokens: WikiText-2 tokens of the predictor's per-layer probe (0: none); command:
    the line the markdown shows; sources: the sparsity sources of the rows (default every
    source of the registry); speed_tokens: decode every row (and hybrid, the best exact mode)
    in flash mode under `budget` for that many tokens, speed_rounds alternating rounds, and
    plot perplexity against tokens/s (<out>.png); 0: no speed measurement."""
    from ..loader import resolve_model_path
    from ..sizes import parse_share

    densities, mc_densities = [float(d) for d in densities], [float(d) for d in mc_densities]
    for d in densities + mc_densities:
        if not 0 < d <= 1:
            raise FlashError(f"densities must be in (0, 1], got {d:g}")
    if not densities:
        raise FlashError("no densities to run")
    parse_share(budget, "--budget")
    if context < 1:
        raise FlashError(f"--context must be at least 1, not {context}")
    if tokens < 1:
        raise FlashError(f"--tokens must be at least 1, not {tokens}")
    counts = dict(arc_easy=arc_easy, arc_challenge=arc_challenge, hellaswag=hellaswag,
                  dip_ca_tokens=dip_ca_tokens, dip_ca_items=dip_ca_items, check_tokens=check_tokens,
                  probe_tokens=probe_tokens)
    if sources is not None:
        unknown = [x for x in sources if x not in SOURCES]
        if unknown or not sources:
            raise FlashError(f"--sources: unknown {', '.join(unknown) or '(none given)'} (choose from "
                             f"{', '.join(SOURCES)})")
    if speed_tokens < 0 or speed_rounds < 1:
        raise FlashError(f"--speed-tokens must be 0 or more and --speed-rounds 1 or more (got {speed_tokens}, "
                         f"{speed_rounds})")
    for name, v in counts.items():
        if v < 0:
            raise FlashError(f"--{name.replace('_', '-')} must be 0 or more, not {v}")
    folder = resolve_model_path(model_path)  # a Hub repo / HF folder: converted once, as load() does

    items = {"arc_easy": arc_easy, "arc_challenge": arc_challenge, "hellaswag": hellaswag}
    configs = plan_configs(densities, mc_densities, budget, tokens, items, dip_ca_tokens, dip_ca_items, sources)
    need = {t for c in configs for t, n in c["limits"].items() if n} | {"wikitext"}
    tasks = {t: load_task(t, data_dir=data_dir) for t in TASKS if t in need}
    checks = []
    if check_tokens and 0.5 in densities:
        checks = [(s, 0.5, b, check_tokens) for s, b in (("predictor", budget), ("predictor", None), ("dip", budget))
                  if sources is None or s in sources]
    meta = dict(
        command=command, model=str(model_path),
        machine=f"{platform.machine()} {platform.system()} ({platform.platform()}, {os.cpu_count()} CPUs)",
        blas=blas_info(), mlx=mx.__version__, dtype="float32" if mx.default_device() == mx.cpu else "flash dtype",
        context=context, budget=budget, densities=densities, mc_densities=mc_densities, spread=True,
        limits=dict(tokens=tokens, dip_ca_tokens=dip_ca_tokens, dip_ca_items=dip_ca_items, **items,
                    check_tokens=check_tokens, probe_tokens=probe_tokens, speed_tokens=speed_tokens,
                    speed_rounds=speed_rounds))
    if sources is not None and "predictor" not in sources:
        probe_tokens = 0
    return run_table(folder, out, tasks, configs, checks, probe_tokens, densities, context,
                     spread=True, resume=resume, progress=progress, meta=meta, log=log,
                     speed=(speed_tokens, speed_rounds, budget) if speed_tokens else None)

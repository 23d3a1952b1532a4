"""The peers benchmark's output: peers.md (markdown), peers.csv, peers.json, and the
formatting helpers the runs' log lines use. Imports systems (MB) only."""

import csv
import json
import statistics
from pathlib import Path

from .systems import MB


def _status(runs):
    kinds = [r.status for r in runs]
    if not kinds:
        return "none"
    if all(k == kinds[0] for k in kinds):
        return kinds[0]
    return ", ".join(f"{k} {kinds.count(k)}/{len(kinds)}" for k in dict.fromkeys(kinds))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _mb(n):
    return "none" if n is None else f"{n / MB:.0f} MB"


def _limit_text(limit, of="float32"):
    kind, v = limit
    if kind == "none":
        return "none"
    if kind == "fraction":
        what = "float32 weights" if of == "float32" else "weights as stored (its files' bytes)"
        return f"each runtime's baseline RSS + {v * 100:g}% of the model's {what}"
    return f"{v / MB:.0f} MB for every system"


def _flash_budget_text(fb):
    how, v = fb
    if how == "auto":
        return ("auto: limit - (peak RSS - weights held) of one unconstrained run of the same system at "
                "the full budget - 5% of the limit")
    if how == "full":
        return "full: limit - the runtime's baseline"
    if how == "limit":
        return "limit: mlx_flash's own --memory-limit set to the cgroup's limit (it plans what is not weights)"
    return f"{v * 100:g}% of the float32 model" if how == "fraction" else f"{v / MB:.0f} MB"


def _summary_line(r):
    if r.status == "ok":
        return (f"decode {r.decode_tps:.3g} tok/s, prompt {r.prompt_tps:.3g} tok/s, load {r.load_s:.1f} s, "
                f"cgroup peak {_mb(r.cgroup_peak_bytes)}, RSS peak {_mb(r.rss_peak_bytes)}, "
                f"read {_mb(r.read_per_token_bytes)}/token")
    return f"{r.status.upper()}: {r.message} (cgroup peak {_mb(r.cgroup_peak_bytes)})"


# --- output ---

COLUMNS = [
    ("system", "system", None),
    ("limit_bytes", "limit MB", "mb"),
    ("memory_budget_bytes", "budget MB", "mb"),
    ("status", "status", None),
    ("decode_tps", "decode tok/s", "3g"),
    ("decode_vs_reference", "vs ref", "2"),
    ("prompt_tps", "prompt tok/s", "3g"),
    ("load_s", "load s", "1"),
    ("cgroup_peak_bytes", "cgroup peak MB", "mb"),
    ("rss_peak_bytes", "RSS peak MB", "mb"),
    ("read_per_token_bytes", "read MB/token", "mb1"),
    ("streamed_attention_bytes", "of it attention MB", "mb"),
    ("major_faults_per_token", "major faults/token", "1"),
    ("plan_mode", "mode run", None),
    ("predicted_ms", "predicted ms/token", "1"),
    ("measured_over_predicted", "measured / predicted", "2"),
    ("disk_gbs_256k", "disk GB/s at the run", "2"),
    ("decode_disk_gbs", "disk GB/s in decode", "2"),
    ("measured_over_predicted_run_disk", "measured / predicted at it", "2"),
    ("oom", "OOM", None),
    ("same_tokens_as_reference", "tokens = ref", None),
]


def _fmt(v, how):
    if v is None:
        return "–"
    if how == "mb":
        return f"{v / MB:.0f}"
    if how == "mb1":
        return f"{v / MB:.1f}"
    if how in ("0", "1", "2"):
        return f"{v:.{how}f}"
    if how == "3g":  # three significant digits: 0.447 tok/s (a 7B from flash) as well as 153
        return f"{v:.3g}"
    return str(v)


def markdown(res):
    i = res["info"]
    m = i["machine"]
    lines = [
        "# mlx_flash.benchmark peers",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {(m['ram_bytes'] or 0) / 2**30:.0f} GiB RAM, {m['os']}",
        f"- BLAS (mlx): {i['blas']}",
    ]
    if i.get("llama_cpp"):
        ll = i["llama_cpp"]
        lines.append(f"- llama.cpp: llama-cpp-python {ll['version']}, {ll.get('threads')} threads, mmap, "
                     + " ".join(f"{k}={v}" for k, v in (ll.get("env") or {}).items())
                     + f" ({ll['system_info']})")
    lines += [
        f"- model: {i['model']} ({i['model_float32_bytes'] / MB:.0f} MB of float32 weights"
        + (f", {i['model_stored_bytes'] / MB:.0f} MB as stored)" if i.get("model_stored_bytes") else ")"),
        f"- dtype: {i['dtype']}",
        f"- limit: {i['limit']} (memory cgroup {i['cgroup']}, page cache counted)",
        f"- mlx_flash's memory_budget (weights only): {i['flash_budget']}",
        "- baselines (RSS after imports, no weights): "
        + ", ".join(f"{rt} {b['rss_bytes'] / MB:.0f} MB" for rt, b in i["baselines"].items()),
    ]
    for spec, c in (i.get("calibration") or {}).items():
        lines.append(f"- sizing {spec} (no limit, memory_budget {c['full_budget_bytes'] / MB:.0f} MB): peak RSS "
                     f"{c['rss_peak_bytes'] / MB:.0f} MB = weights {c['weights_bytes'] / MB:.0f} MB + the rest "
                     f"{c['other_bytes'] / MB:.0f} MB -> memory_budget {c['budget_bytes'] / MB:.0f} MB")
    lines += [
        f"- prompt {i['prompt_tokens']} tokens (the same ids for all), {i['decode_tokens']} greedy decode tokens "
        f"(end tokens forbidden), {i['rounds']} rounds alternating the order, "
        + ("page cache dropped before every run" if i["cold"] else "warm page cache"),
        *([f"- context {i['context']} tokens (--ctx-size): llama.cpp's n_ctx and the KV cache mlx_flash's "
           "--memory-limit plans for"] if i.get("ctx_size_given") else []),
        *(["- predicted ms/token: the cost model with the machine profile's rates, the disk's measured just before "
            "each run ('disk GB/s at the run': uncached 256 KiB reads of the profile's probe file; this VM's disk "
            "varies ~2x between hours)"] if any(r.get("disk_gbs_256k") for r in res["rows"]) else []),
        *(["- 'disk GB/s in decode': what the device holding the model delivered while the decode ran (its own "
           "counters: bytes read over the time it was busy; every system); 'measured / predicted at it': the cost "
           "model with that rate, the same curve scaled, so its error apart from the disk's drift since the probe "
           "(the rate is at the queue depth the run kept: for a disk-bound row this checks how I/O and compute "
           "combine more than the disk term)"]
          if any(r.get("decode_disk_gbs") for r in res["rows"]) else []),
        f"- medians over the runs that finished; 'vs ref' is the median per-round ratio of decode speed to "
        f"{i['reference']}; 'tokens = ref' counts the leading tokens equal to its output",
        f"- {i['started']}; `{i['command']}`" if i.get("command") else f"- {i['started']}",
    ]
    if i.get("loadavg") and i["loadavg"][0] is not None:
        lines.append(f"- 1-minute load average around the runs: {i['loadavg'][0]:.1f} to {i['loadavg'][1]:.1f} "
                     f"on {m['cores']} cores (a shared machine: compare ratios within this run)")
    for n in i.get("notes") or []:
        lines.append(f"- note: {n}")
    lines += ["", "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
              "| " + " | ".join("---" for _ in COLUMNS) + " |"]
    for row in res["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(k), how) for k, _, how in COLUMNS) + " |")
    msgs = [(r["system"], r["message"]) for r in res["rows"] if r.get("message")]
    if msgs:
        lines += [""] + [f"- {s}: {msg}" for s, msg in msgs]
    return "\n".join(lines) + "\n"


def write_csv(res, path):
    keys = ["system", "runtime", "status", "runs", "ok", "oom", "limit_bytes", "memory_budget_bytes",
            "decode_tps", "decode_vs_reference", "prompt_tps", "load_s", "cgroup_peak_bytes", "rss_peak_bytes",
            "read_per_token_bytes", "major_faults_per_token", "read_prefill_bytes", "read_load_bytes",
            "same_tokens_as_reference",
            "plan_mode", "streamed_attention_bytes", "predicted_ms", "measured_over_predicted",
            "disk_gbs_256k", "decode_disk_gbs", "predicted_run_disk_ms", "measured_over_predicted_run_disk", "message"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for row in res["rows"]:
            w.writerow(row)


def write_json(res, path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)

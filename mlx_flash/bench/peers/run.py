"""The benchmark itself: Peers prepares the peers' files, probes each runtime's baseline,
sizes mlx_flash's budget, alternates the runs (each child.py in its own cgroup) and
builds the result; RunRecord and record_from turn a child's events into one run.
Imports systems, cgroup, files and report. One file past 500 lines: the run is one sequence, from preparation to
the record."""

import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ...errors import FlashError
from .cgroup import CgroupUnavailable, MemoryCgroupRunner, UnconstrainedRunner, drop_caches, loadavg
from .files import (
    ensure_gguf,
    ensure_hf_export,
    llama_cpp_python,
    model_float32_bytes,
    model_stored_bytes,
    peers_home,
    prompt_ids,
    source_gguf,
)
from .report import (
    _common_prefix,
    _flash_budget_text,
    _limit_text,
    _max,
    _mb,
    _median,
    _status,
    _summary_line,
)
from .systems import LIMIT_OF, MB, RUNTIMES, parse_flash_budget, parse_limit, parse_systems

CHILD = Path(__file__).with_name("child.py")
DISK_NOW_SIZES = (65536, 262144, 1048576)  # the read sizes disk_now measures (the profile's curve interpolates)
DISK_NOW_SECONDS = 1.0  # ... each
BLAS_MODULE = Path(__file__).resolve().parents[2] / "blas.py"
DEVICE_MODULE = Path(__file__).resolve().parents[2] / "io" / "device.py"  # (the child loads both by path)


# --- the benchmark ---


@dataclass
class RunRecord:
    system: str
    round: int
    limit_bytes: int = None
    memory_budget_bytes: int = None
    status: str = ""  # ok | oom | error | timeout | refused | skipped
    phase: str = ""  # the last phase reached
    message: str = ""
    returncode: int = None
    oom_killed: bool = False
    load_s: float = None
    prompt_tokens: int = None
    prompt_tps: float = None
    decode_tokens: int = None
    decode_tps: float = None
    cgroup_peak_bytes: int = None
    rss_peak_bytes: int = None
    limit_hits: int = None
    read_load_bytes: int = None
    read_prefill_bytes: int = None
    read_decode_bytes: int = None
    read_per_token_bytes: float = None
    major_faults_per_token: float = None  # in the decode: the process's own pages read back from disk
    wall_s: float = None
    loadavg: list = None  # 1-minute load average before and after the run (a shared machine)
    tokens: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def read_events(path):
    out = []
    try:
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by the kill
    except OSError:
        pass
    return out


def _delta(a, b):
    return b - a if a is not None and b is not None else None


def record_from(system, rnd, res, events, log_tail, limit, budget):
    ev = {e["event"]: e for e in events}
    last = events[-1]["event"] if events else "not started"
    rec = RunRecord(system.spec, rnd, limit, budget, returncode=res.returncode,
                    oom_killed=res.oom_killed, phase=last, cgroup_peak_bytes=res.peak_bytes,
                    limit_hits=res.limit_hits, wall_s=res.wall_s)
    hwm = [e.get("hwm") for e in events if e.get("hwm")]
    # a killed process reports no final peak: the last one it wrote would understate it
    rec.rss_peak_bytes = max(hwm) if hwm and last in ("done", "error") else None
    if "loaded" in ev:
        rec.load_s = ev["loaded"].get("load_s")
        rec.read_load_bytes = _delta(ev.get("loading", {}).get("read_bytes"), ev["loaded"].get("read_bytes"))
    if "first_token" in ev:
        rec.read_prefill_bytes = _delta(ev.get("loaded", {}).get("read_bytes"), ev["first_token"].get("read_bytes"))
    if "done" in ev:
        d = ev["done"]
        rec.tokens = d.get("tokens", [])
        rec.prompt_tokens = d.get("prompt_tokens")
        if d.get("prefill_s"):
            rec.prompt_tps = rec.prompt_tokens / d["prefill_s"]
        rec.decode_tokens = d.get("decode_tokens")
        if d.get("decode_s"):
            rec.decode_tps = rec.decode_tokens / d["decode_s"]
        rec.read_decode_bytes = _delta(ev.get("first_token", {}).get("read_bytes"), d.get("read_bytes"))
        if rec.read_decode_bytes is not None and rec.decode_tokens:
            rec.read_per_token_bytes = rec.read_decode_bytes / rec.decode_tokens
        faults = _delta(ev.get("first_token", {}).get("major_faults"), d.get("major_faults"))
        if faults is not None and rec.decode_tokens:
            rec.major_faults_per_token = faults / rec.decode_tokens
        rec.extra = {k: v for k, v in d.items() if k.startswith(("lib_", "mlx_", "flash_", "decode_disk_"))}
    if "loaded" in ev:
        rec.extra.update({k: v for k, v in ev["loaded"].items()
                          if k in ("memory_budget_bytes", "plan_weights_bytes", "threads", "mmap",
                                   "memory_limit_bytes", "runtime_bytes", "kv_bytes", "activation_bytes",
                                   "plan_mode", "predicted_ms", "streamed_attention_layers",
                                   "streamed_attention_bytes", "disk_gbs_256k")})
    if "flash_predicted_ms" in rec.extra:  # the prediction after the decode, its context known
        rec.extra["predicted_ms"] = rec.extra.pop("flash_predicted_ms")
    if "flash_predicted_run_disk_ms" in rec.extra:  # ... at the disk's rate during the decode
        rec.extra["predicted_run_disk_ms"] = rec.extra.pop("flash_predicted_run_disk_ms")
    if res.oom_killed:
        rec.status = "oom"
        rec.message = f"OOM-killed while {_doing(last)}"
    elif res.timed_out:
        rec.status = "timeout"
        rec.message = f"timed out while {_doing(last)}"
    elif "error" in ev:
        e = ev["error"]
        refused = e.get("phase") == "load" and system.runtime == "mlx_flash" and res.returncode == 2
        rec.status = "refused" if refused else "error"
        rec.message = e.get("message", "")
    elif res.returncode != 0 or "done" not in ev:
        rec.status = "error"
        sig = f"signal {res.signal}" if res.signal else f"exit {res.returncode}"
        rec.message = f"{sig} while {_doing(last)}" + (f": {log_tail}" if log_tail else "")
    else:
        rec.status = "ok"
    return rec


def _doing(phase):
    return {"not started": "starting", "start": "importing", "imported": "importing",
            "loading": "loading", "loaded": "prefilling", "first_token": "decoding",
            "done": "exiting", "error": "failing"}.get(phase, phase)


def machine_info():
    from ...plan.profile import cpu_name

    cpu = cpu_name()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": mem,
            "os": f"{platform.system()} {platform.release()} {platform.machine()}",
            "python": platform.python_version()}


class Peers:
    """One benchmark: prepare the peers' files, probe baselines, alternate the runs."""

    def __init__(self, model, systems, limit="50%", prompt_tokens=160, tokens=128, rounds=3,
                 gguf=None, llama_python=None, timeout=1800, cold=True, reference=None,
                 flash_budget="limit", limit_of="float32", ctx_size=None, disk_probe=True, log=print):
        self.model = Path(model)
        if not (self.model / "manifest.json").is_file():
            raise FlashError(f"{model}: not a converted mlx_flash folder (build the default one with `make model`)")
        systems = parse_systems(systems) if isinstance(systems, str) else list(systems)
        self.limit_texts = [t.strip() for t in str(limit).split(",") if t.strip()] or ["50%"]
        for t in self.limit_texts:
            parse_limit(t)
        self.limit = parse_limit(self.limit_texts[0])
        if len(self.limit_texts) > 1:  # every system without a limit of its own, at every limit
            systems = [s if s.limit else replace(s, spec=f"{s.spec}@{t}", limit="none" if t.lower() == "none" else t)
                       for s in systems for t in (self.limit_texts if not s.limit else [None])]
            systems = list({s.spec: s for s in systems}.values())
        self.systems = systems
        if limit_of not in LIMIT_OF:
            raise FlashError(f"--limit-of: '{limit_of}' is not one of {', '.join(LIMIT_OF)}")
        self.limit_of = limit_of
        self.flash_budget = parse_flash_budget(flash_budget)
        self.calibration = {}  # spec -> the unconstrained run that sized mlx_flash's budget
        self.prompt_tokens, self.tokens, self.rounds = prompt_tokens, tokens, rounds
        if tokens < 2:
            raise FlashError("--tokens must be at least 2 (decode speed is timed after the first token)")
        if rounds < 1:
            raise FlashError("--rounds must be at least 1")
        self.ctx_size = ctx_size  # the context both hold a KV cache for (None: prompt + tokens + 16)
        self.disk_probe = disk_probe  # the disk's rates measured before each mlx_flash run (disk_now)
        self.gguf_given, self.llama_python_given = gguf, llama_python
        self.timeout, self.cold, self.log = timeout, cold, log
        self.reference = reference or next((s.spec for s in self.systems if s.spec == "mlx_flash:dense@none"),
                                           self.systems[0].spec)
        if self.reference not in {s.spec for s in self.systems}:
            raise FlashError(f"--reference {self.reference} is not one of the systems")
        self.skipped = {}  # spec -> why
        self.paths = {}  # spec -> weights path
        self.baselines = {}  # runtime -> probe record
        self.notes = []

    # preparation

    def prepare(self):
        self.home = peers_home(self.model)
        self.home.mkdir(parents=True, exist_ok=True)
        self.f32_bytes = model_float32_bytes(self.model)
        self.stored_bytes = model_stored_bytes(self.model)
        self.prompt, self.prompt_text, self.suppress = prompt_ids(self.model, self.prompt_tokens)
        self.log(f"[peers] model {self.model}: {self.f32_bytes / MB:.0f} MB of float32 weights; "
                 f"prompt {len(self.prompt)} tokens, {self.tokens} decode tokens, {self.rounds} rounds")
        need = len(self.prompt) + self.tokens
        if self.ctx_size is not None and self.ctx_size < need:
            raise FlashError(f"--ctx-size {self.ctx_size} is shorter than the prompt ({len(self.prompt)} tokens) and "
                             f"the {self.tokens} decode tokens")
        self.context = self.ctx_size or need + 16
        if len(self.prompt) > self.prompt_tokens:
            self.notes.append(f"the prompt has {len(self.prompt)} tokens, not {self.prompt_tokens}: "
                              "the chat template and instruction alone are longer")
        self.python = {"mlx_flash": sys.executable, "mlx_lm": sys.executable}
        need_llama = [s for s in self.systems if s.runtime == "llama.cpp"]
        if need_llama:
            py, why = llama_cpp_python(self.llama_python_given)
            src = source_gguf(self.model, self.gguf_given)
            if py is None:
                for s in need_llama:
                    self.skip(s, why)
            elif src is None:
                for s in need_llama:
                    self.skip(s, f"no source GGUF for {self.model} (pass --gguf)")
            else:
                self.python["llama.cpp"] = py
                self.llama_cpp_version = why
                for s in need_llama:
                    self.paths[s.spec] = str(ensure_gguf(src, self.home, s.gguf, self.log))
        for s in self.systems:
            if s.runtime == "mlx_lm":
                self.paths[s.spec] = str(ensure_hf_export(self.model, self.home, self.log))
            elif s.runtime == "mlx_flash":
                self.paths[s.spec] = str(self.model)

    def skip(self, system, why):
        self.skipped[system.spec] = why
        self.log(f"[peers] {system.spec}: skipped: {why}")

    # runs

    def runner(self):
        try:
            r = MemoryCgroupRunner()
            self.log(f"[peers] memory cgroup {r.version} at {r.path}")
            return r
        except CgroupUnavailable as e:
            msg = f"{e}; running every system WITHOUT a memory limit"
            self.notes.append(msg)
            self.log(f"[peers] warning: {msg}")
            return UnconstrainedRunner(str(e))

    def _config(self, system, workdir, probe=False, budget=None, limit=None, disk=None):
        # --flash-budget limit: mlx_flash gets the cgroup's limit as its --memory-limit (its KV
        # cache planned for `context`, the tokens llama.cpp's context holds too)
        memory_limit = (limit if limit is not None and system.runtime == "mlx_flash"
                        and self.flash_budget[0] == "limit" else None)
        cfg = {"runtime": system.runtime, "path": self.paths.get(system.spec), "mode": system.mode,
               "sparsity": system.sparsity, "density": system.density, "memory_budget": budget,
               "memory_limit": memory_limit, "context": self.context,
               "resident_dtype": system.resident_dtype,
               "prompt_ids": self.prompt, "tokens": self.tokens, "suppress_ids": self.suppress,
               "probe": probe, "threads": os.cpu_count(), "blas_module": str(BLAS_MODULE),
               "device_module": str(DEVICE_MODULE),
               "events": str(workdir / "events.jsonl"),
               "disk_gbs": None if disk is None else {str(k): v for k, v in disk.items()}}
        (workdir / "config.json").write_text(json.dumps(cfg))
        return workdir / "config.json"

    def disk_now(self):
        """The disk's uncached rates now ({read size: GB/s}; a few seconds, from this process,
        outside any cgroup): the cost model predicts each mlx_flash run with the rates of its
        moment, because this machine's disk was measured to vary ~2x from hour to hour."""
        from ...plan.measure import probe_file, disk_curve

        return disk_curve([probe_file()], DISK_NOW_SIZES, seconds=DISK_NOW_SECONDS)

    def _launch(self, runner, system, limit=None, budget=None, probe=False):
        with tempfile.TemporaryDirectory(prefix="mlx_flash_peers_") as tmp:
            tmp = Path(tmp)
            disk = self.disk_now() if system.runtime == "mlx_flash" and not probe and self.disk_probe else None
            cfg = self._config(system, tmp, probe=probe, budget=budget, limit=limit, disk=disk)
            if self.cold and not drop_caches() and "drop" not in " ".join(self.notes):
                self.notes.append("could not drop the page cache (not root): runs are not cold")
            with open(tmp / "log.txt", "wb") as logf:
                res = runner.run([self.python[system.runtime], str(CHILD), str(cfg)], limit_bytes=limit,
                                 timeout=self.timeout, stdout=logf, stderr=subprocess.STDOUT,
                                 env=_child_env(system.runtime), cwd=os.getcwd())
            events = read_events(tmp / "events.jsonl")
            tail = (tmp / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
        return res, events, " | ".join(tail)

    def probe(self, runner):
        """Each runtime's baseline: the RSS after its imports, before any weights."""
        for rt in RUNTIMES:
            systems = [s for s in self.systems if s.runtime == rt and s.spec not in self.skipped]
            if not systems:
                continue
            res, events, tail = self._launch(runner, systems[0], probe=True)
            ev = {e["event"]: e for e in events}
            if "imported" not in ev:
                why = ev.get("error", {}).get("message") or tail or f"exit {res.returncode}"
                for s in systems:
                    self.skip(s, f"the {rt} runtime did not start: {why}")
                continue
            imp = ev["imported"]
            self.baselines[rt] = {"rss_bytes": imp["rss"], "cgroup_peak_bytes": res.peak_bytes,
                                  **{k: v for k, v in imp.items() if k in ("blas", "version", "system_info")}}
            self.log(f"[peers] {rt} baseline (RSS after imports): {imp['rss'] / MB:.0f} MB"
                     + (f"; BLAS {imp['blas']}" if imp.get("blas") else ""))

    def limits(self, system):
        """(cgroup limit, mlx_flash memory_budget) in bytes for a system."""
        kind, value = parse_limit(system.limit) if system.limit else self.limit
        if kind == "none":
            return None, None
        base = self.baselines[system.runtime]["rss_bytes"]
        share = self.stored_bytes if self.limit_of == "stored" else self.f32_bytes
        limit = int(base + value * share) if kind == "fraction" else int(value)
        budget = None
        if system.runtime == "mlx_flash":
            how, v = self.flash_budget
            if how == "fraction":
                budget = int(v * self.f32_bytes)
            elif how == "bytes":
                budget = int(v)
            elif how == "limit":  # the product's own --memory-limit: mlx_flash plans within it
                return limit, None
            elif how == "auto" and system.spec in self.calibration:
                budget = self.calibration[system.spec]["budget_bytes"]
            else:  # full, or auto without a calibration: the weights get what the runtime leaves
                budget = limit - base
            budget = max(budget, 1 << 20)
        return limit, budget

    def calibrate(self, runner):
        """--flash-budget auto: mlx_flash's memory_budget counts weights only, so each limited
        mlx_flash system first runs once without a limit at the full budget (limit - baseline);
        its peak RSS minus the weights its plan holds is everything else it needs (imports,
        load-time copies, MLX's buffer cache, KV cache, activations, reader staging), and the
        budget becomes limit - that - 5 % of the limit."""
        if self.flash_budget[0] != "auto":
            return
        for s in self.systems:
            if s.runtime != "mlx_flash" or s.mode == "dense" or s.spec in self.skipped:
                continue
            limit, full = self.limits(s)
            if limit is None:
                continue
            self.log(f"[peers] sizing {s.spec}'s budget: one run without a limit at memory_budget {_mb(full)} ...")
            res, events, tail = self._launch(runner, s, limit=None, budget=full)
            rec = record_from(s, -1, res, events, tail, None, full)
            weights = rec.extra.get("plan_weights_bytes")
            if rec.status != "ok" or not weights or not rec.rss_peak_bytes:
                self.log(f"[peers]   {rec.status}: {rec.message}; {s.spec} keeps memory_budget {_mb(full)}")
                continue
            other = rec.rss_peak_bytes - weights
            budget = int(limit - other - 0.05 * limit)
            self.calibration[s.spec] = {"full_budget_bytes": full, "rss_peak_bytes": rec.rss_peak_bytes,
                                        "weights_bytes": weights, "other_bytes": other, "budget_bytes": budget,
                                        "decode_tps": rec.decode_tps}
            self.log(f"[peers]   peak RSS {_mb(rec.rss_peak_bytes)} = weights {_mb(weights)} + the rest "
                     f"{_mb(other)}; memory_budget under the limit: {_mb(budget)}")

    def run(self):
        self.prepare()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        runs = []
        try:  # kill -TERM (or -INT, ignored in background jobs) still kills the child, removes the cgroup
            old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:  # not the main thread
            old = {}
        try:
            return self._run(runs, started)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _run(self, runs, started):
        with self.runner() as runner:
            self.cgroup = runner.version
            self.probe(runner)
            self.calibrate(runner)
            active = [s for s in self.systems if s.spec not in self.skipped]
            for r in range(self.rounds):
                order = active if r % 2 == 0 else active[::-1]
                for i, s in enumerate(order):
                    limit, budget = self.limits(s)
                    if runner.version is None:
                        limit = None
                    self.log(f"[peers] round {r + 1}/{self.rounds} ({i + 1}/{len(order)}) {s.spec}: "
                             f"limit {_mb(limit)}" + (f", memory_budget {_mb(budget)}" if budget else "")
                             + " ...")
                    load0 = loadavg()
                    res, events, tail = self._launch(runner, s, limit=limit, budget=budget)
                    rec = record_from(s, r, res, events, tail, limit, budget)
                    rec.loadavg = [load0, loadavg()]
                    runs.append(rec)
                    self.log("[peers]   " + _summary_line(rec))
        return self.report(runs, started)

    # the report

    def report(self, runs, started):
        ok_specs = [s.spec for s in self.systems if any(r.system == s.spec and r.status == "ok" for r in runs)]
        if self.reference not in ok_specs and ok_specs:  # (e.g. refused: too little memory)
            self.notes.append(f"the reference {self.reference} never ran to the end: speeds are compared "
                              f"to {ok_specs[0]}")
            self.reference = ok_specs[0]
        ref_runs = {r.round: r for r in runs if r.system == self.reference and r.status == "ok"}
        rows = []
        for s in self.systems:
            mine = [r for r in runs if r.system == s.spec]
            row = {"system": s.spec, "runtime": s.runtime}
            if s.spec in self.skipped:
                row.update(status="skipped", message=self.skipped[s.spec])
                rows.append(row)
                continue
            limit, budget = self.limits(s)
            if not self.cgroup:
                limit = None
            ok = [r for r in mine if r.status == "ok"]
            row.update(limit_bytes=limit, memory_budget_bytes=budget, runs=len(mine), ok=len(ok),
                       oom=sum(r.oom_killed for r in mine),
                       status=_status(mine), message="; ".join(dict.fromkeys(r.message for r in mine if r.message)))
            med = lambda key: _median([getattr(r, key) for r in ok])  # noqa: E731
            row.update(load_s=med("load_s"), prompt_tps=med("prompt_tps"), decode_tps=med("decode_tps"),
                       read_per_token_bytes=med("read_per_token_bytes"), read_prefill_bytes=med("read_prefill_bytes"),
                       read_load_bytes=med("read_load_bytes"), major_faults_per_token=med("major_faults_per_token"))
            row["cgroup_peak_bytes"] = _max([r.cgroup_peak_bytes for r in mine])
            row["rss_peak_bytes"] = _max([r.rss_peak_bytes for r in mine])
            ratios = [r.decode_tps / ref_runs[r.round].decode_tps for r in ok
                      if r.round in ref_runs and r.decode_tps and ref_runs[r.round].decode_tps]
            row["decode_vs_reference"] = _median(ratios)
            modes = sorted({r.extra["plan_mode"] for r in ok if r.extra.get("plan_mode")})
            row["plan_mode"] = ",".join(modes) or None
            # the attention read from flash every token (runtime/stores/attention.py), if any
            row["streamed_attention_bytes"] = _median([r.extra["streamed_attention_bytes"] for r in ok
                                                       if r.extra.get("streamed_attention_bytes")])
            # the cost model against the measured decode (ms per token), per run, then the median:
            # with the disk's rates probed just before the run, and at the rate the device
            # delivered during the decode (the model's error apart from the disk's drift)
            for key, of in (("predicted_ms", "measured_over_predicted"),
                            ("predicted_run_disk_ms", "measured_over_predicted_run_disk")):
                errs = [1e3 / r.decode_tps / r.extra[key] for r in ok if r.decode_tps and r.extra.get(key)]
                row[key] = _median([r.extra.get(key) for r in ok if r.extra.get(key)])
                row[of] = _median(errs)
            for key in ("disk_gbs_256k", "decode_disk_gbs"):
                row[key] = _median([r.extra.get(key) for r in ok if r.extra.get(key)])
            if ok and ref_runs:
                ref_tokens = next(iter(ref_runs.values())).tokens
                row["same_tokens_as_reference"] = _common_prefix(ok[0].tokens, ref_tokens)
            rows.append(row)
        info = {
            "command": None, "started": started, "machine": machine_info(),
            "blas": (self.baselines.get("mlx_flash") or self.baselines.get("mlx_lm") or {}).get("blas"),
            "llama_cpp": ({"version": self.baselines["llama.cpp"].get("version"),
                           "system_info": self.baselines["llama.cpp"].get("system_info"),
                           "env": {k: _child_env("llama.cpp")[k] for k in LLAMA_ENV},
                           "threads": os.cpu_count()}
                          if "llama.cpp" in self.baselines else None),
            "model": str(self.model), "model_float32_bytes": self.f32_bytes,
            "model_stored_bytes": self.stored_bytes, "limit_of": self.limit_of,
            "dtype": _dtype_text(self.model),
            "limit": "; ".join(_limit_text(parse_limit(t), self.limit_of) for t in self.limit_texts),
            "cgroup": self.cgroup or "none",
            "flash_budget": _flash_budget_text(self.flash_budget), "calibration": self.calibration,
            "baselines": self.baselines, "prompt_tokens": len(self.prompt), "decode_tokens": self.tokens,
            "context": self.context, "ctx_size_given": self.ctx_size is not None,
            "rounds": self.rounds, "reference": self.reference, "cold": self.cold, "notes": self.notes,
            "prompt_text": self.prompt_text,
            "loadavg": [min((x for r in runs for x in (r.loadavg or []) if x is not None), default=None),
                        max((x for r in runs for x in (r.loadavg or []) if x is not None), default=None)],
        }
        return {"info": info, "rows": rows, "runs": [asdict(r) for r in runs]}


# llama.cpp's OpenMP threads spin while they wait for each other. On a shared
# 2-core machine one of the two is often descheduled and the spinning one burns
# its slice: llama.cpp F16 decoded 0.3 tok/s with 2 threads under a load of 4,
# 28 tok/s with OMP_WAIT_POLICY=passive, 25 with 1 thread. MLX's
# OpenBLAS threads yield instead. A value set by the caller is kept.
LLAMA_ENV = {"OMP_WAIT_POLICY": "passive"}


def _child_env(runtime=None):
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if runtime == "llama.cpp":
        for k, v in LLAMA_ENV.items():
            env.setdefault(k, v)
    return env


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _dtype_text(folder):
    """What the systems hold, from the flash folder's manifest."""
    from ...layout.format import read_manifest

    q = read_manifest(folder).layout.quant
    if q is None:
        return ("mlx: float16 on flash, float32 compute (mlx_lm: float32 export of the same values); "
                "llama.cpp: F32 / F16 GGUF of the same float16-rounded values")
    return (f"mlx_flash: {q.bits}-bit group {q.group_size} ({q.scale_dtype} scales) on flash and in DRAM, "
            "float32 compute; llama.cpp: the GGUF those values came from, at its own blocks (q4_1 / q4_0: "
            "the same values); F32 / F16 systems: the values dequantized")

"""One run of one system for `mlx_flash.benchmark peers`, in its own process.

    python child.py CONFIG.json

Run as a plain script (not `-m`): the llama.cpp peer runs it with the
interpreter of `.venv-peers`, where mlx_flash is not installed, so this file
imports nothing from mlx_flash at the top and only the runtime it measures
below. The parent has already moved this process into the memory cgroup before
exec, so everything here (the interpreter, the imports) is counted.

Progress goes to CONFIG["events"] as JSON lines, flushed one by one: when the
process is OOM-killed the last line says how far it got.

Phases: start -> imported (the runtime's baseline RSS; a probe stops here) ->
loading -> loaded -> first_token (prefill done) -> done. Timings, /proc/self/io
read_bytes and RSS are taken at every phase boundary, in this process: reads
of the reader's threads and O_DIRECT reads are counted in read_bytes too.
"""

import json
import os
import sys
import time


def proc_status():
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def read_bytes():
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def major_faults():
    """Page faults that read from disk, this process's (/proc/self/stat's majflt): under a tight
    cgroup the kernel evicts the process's file pages (its libraries' code, mapped weights) and
    each touch reads them back."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rpartition(")")[2].split()[9])
    except (OSError, ValueError, IndexError):
        return None


def _device_module(cfg):
    """io/device.py (the disk's rate during the decode), or None: the rate is a bonus, never
    the run's failure."""
    try:
        return load_module(cfg["device_module"], "_peers_device")
    except Exception:
        return None


class Events:
    def __init__(self, path):
        self.f = open(path, "a", buffering=1)

    def emit(self, name, **fields):
        st = proc_status()
        rec = {"event": name, "t": time.time(), "rss": st.get("VmRSS"), "hwm": st.get("VmHWM"),
               "rss_anon": st.get("RssAnon"), "rss_file": st.get("RssFile"),
               "read_bytes": read_bytes(), "major_faults": major_faults(), **fields}
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()  # in the kernel now: a SIGKILL after this loses nothing


def load_module(path, name):
    """One of mlx_flash's files by path, without importing mlx_flash (the llama.cpp peer's
    environment has none): blas.py (OpenBLAS for mlx_lm too), io/device.py (the disk's rate)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- runtimes: import(), load(), generate() -> iterator of token ids ---


class MLXFlashRuntime:
    def imports(self, cfg):
        import mlx_flash
        from mlx_flash.blas import blas_info

        self.mlx_flash = mlx_flash
        return {"blas": blas_info(), "version": mlx_flash.__version__}

    profile = None  # the machine profile the predictions use (load())

    def load(self, cfg):
        self.model, self.tok = self.mlx_flash.load(
            cfg["path"], mode=cfg["mode"], sparsity=cfg.get("sparsity") or "oracle",
            density=cfg.get("density") or 1.0, memory_budget=cfg.get("memory_budget"),
            memory_limit=cfg.get("memory_limit"), ctx_size=cfg["context"] if cfg.get("memory_limit") else None,
            resident_dtype=cfg.get("resident_dtype"), progress=False)
        rt = self.model.runtime
        out = {"memory_budget_bytes": rt.budget_bytes, "plan_mode": rt.mode}
        if not hasattr(rt, "plan"):  # a mixture of experts (runtime/moe.py): its expert buffer, no cost model
            s = rt.stats()["summary"]
            return out | {"plan_weights_bytes": s["weights_in_dram_bytes"], "expert_slots": s["expert_slots"],
                          "experts_total": s["experts_total"]} | self._limit(rt)
        out["plan_weights_bytes"] = rt.plan.weights_bytes
        if rt.attention is not None:  # the layers whose attention it reads from flash every token
            out["streamed_attention_layers"] = list(rt.attention.order)
            out["streamed_attention_bytes"] = rt.attention.streamed_bytes
        from mlx_flash.plan.profile import load_profile

        profile = load_profile()  # the cost model's, where this machine was profiled
        if profile is not None and cfg.get("disk_gbs"):  # the disk's rates measured just before this run
            profile.disk = {int(k): float(v) for k, v in cfg["disk_gbs"].items()}
            out["disk_gbs_256k"] = profile.disk_gbs(256 * 1024)
        self.profile = profile
        prediction = rt.predict(profile) if profile is not None else None
        if prediction is not None:
            out["predicted_ms"] = prediction.total_ms
        return out | self._limit(rt)

    @staticmethod
    def _limit(rt):
        """--memory-limit's plan: what it set aside besides the weights."""
        m = rt.memory
        if m is None:
            return {}
        return {"memory_limit_bytes": m.limit, "runtime_bytes": m.baseline, "kv_bytes": m.kv,
                "activation_bytes": m.activations}

    def stream_generate(self):
        return self.mlx_flash.stream_generate

    def generate(self, cfg):
        import mlx.core as mx

        bias = _eos_bias(mx, cfg["suppress_ids"])
        self.last = None
        for resp in self.stream_generate()(self.model, self.tok, cfg["prompt_ids"],
                                           max_tokens=cfg["tokens"], logits_processors=[bias]):
            self.last = resp
            yield int(resp.token)

    def lib_stats(self):
        """The library's own figures for the last generation (mlx_lm's response fields)."""
        if self.last is None:
            return {}
        return dict(lib_prompt_tps=self.last.prompt_tps, lib_decode_tps=self.last.generation_tps,
                    mlx_peak_memory=int(self.last.peak_memory * 1e9))

    def extra(self, disk_gbs=None):
        out = self.lib_stats()
        try:
            stats = self.model.runtime.stats()
            if "expert_slots" in stats["summary"]:  # a mixture of experts: its buffer's use
                keep = ("hit_rate", "experts_asked", "experts_read", "bytes_read", "io_s", "read_s", "hidden_share",
                        "prefetch")
                out["expert_stats"] = {k: stats["summary"].get(k) for k in keep}
                return out
            if self.model.runtime.store.stats is not None:
                out["flash_stats"] = {k: v for k, v in stats["summary"].items() if k.startswith("mean_")
                                      or k == "n_tokens"}
            rt = self.model.runtime
            prediction = rt.predict(self.profile) if self.profile is not None else None
            if prediction is not None:  # (after the decode: the KV cache on flash's reads counted)
                out["flash_predicted_ms"] = prediction.total_ms
                # and at the rate the disk delivered during this decode (none where it gave no rate)
                from mlx_flash.plan.cost import predict_at_disk_rate

                at = predict_at_disk_rate(rt.work(), self.profile, disk_gbs)
                if at is not None:
                    out["flash_predicted_run_disk_ms"] = at.total_ms
        except Exception as e:  # the stats are a bonus, never the result
            out["flash_stats_error"] = repr(e)
        return out


class MLXLMRuntime(MLXFlashRuntime):
    def imports(self, cfg):
        blas = load_module(cfg["blas_module"], "_peers_blas").setup_blas()  # before mlx is imported
        import mlx_lm

        self.mlx_lm = mlx_lm
        return {"blas": blas, "version": getattr(mlx_lm, "__version__", "?")}

    def load(self, cfg):
        self.model, self.tok = self.mlx_lm.load(cfg["path"])
        return {}

    def stream_generate(self):
        return self.mlx_lm.stream_generate

    def extra(self, disk_gbs=None):
        return self.lib_stats()


def _eos_bias(mx, ids):
    """A logits processor that forbids the end tokens, so every system decodes N tokens."""
    cache = {}

    def proc(tokens, logits):
        v = logits.shape[-1]
        if v not in cache:
            b = [0.0] * v
            for i in ids:
                if 0 <= i < v:
                    b[i] = float("-inf")
            cache[v] = mx.array(b, dtype=logits.dtype)
        return logits + cache[v]

    return proc


class LlamaCppRuntime:
    def imports(self, cfg):
        import llama_cpp

        self.llama_cpp = llama_cpp
        try:
            info = llama_cpp.llama_print_system_info()
            info = info.decode() if isinstance(info, bytes) else str(info)
        except Exception:
            info = "?"
        return {"version": llama_cpp.__version__, "system_info": info.strip()}

    def load(self, cfg):
        threads = cfg.get("threads") or os.cpu_count()
        self.llm = self.llama_cpp.Llama(
            model_path=cfg["path"], n_ctx=cfg["context"],
            n_batch=512, n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
        return {"threads": threads, "mmap": True}

    def generate(self, cfg):
        import numpy as np

        ids = [i for i in cfg["suppress_ids"] if 0 <= i < self.llm.n_vocab()]

        def forbid(input_ids, scores):
            scores[ids] = -np.inf
            return scores

        procs = self.llama_cpp.LogitsProcessorList([forbid])
        n = 0
        # generate() reuses the list it is given as its own buffer: pass a copy
        for tok in self.llm.generate(list(cfg["prompt_ids"]), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, logits_processor=procs, reset=True):
            yield int(tok)
            n += 1
            if n >= cfg["tokens"]:
                break

    def extra(self, disk_gbs=None):
        return {}


RUNTIMES = {"mlx_flash": MLXFlashRuntime, "mlx_lm": MLXLMRuntime, "llama.cpp": LlamaCppRuntime}


def main(argv):
    with open(argv[1]) as f:
        cfg = json.load(f)
    ev = Events(cfg["events"])
    ev.emit("start", pid=os.getpid(), python=sys.executable)
    rt = RUNTIMES[cfg["runtime"]]()
    try:
        info = rt.imports(cfg)
    except ImportError as e:
        ev.emit("error", phase="import", message=f"{cfg['runtime']} is not importable: {e}")
        return 3
    ev.emit("imported", **info)
    if cfg.get("probe"):
        return 0
    flash_error = getattr(sys.modules.get("mlx_flash"), "FlashError", None)
    phase = "load"
    try:
        ev.emit("loading")
        t0 = time.perf_counter()
        info = rt.load(cfg)
        ev.emit("loaded", load_s=time.perf_counter() - t0, **info)

        phase = "generate"
        device = _device_module(cfg)
        tokens, times = [], []
        rb0 = read_bytes()
        t0 = time.perf_counter()
        disk0 = None
        for tok in rt.generate(cfg):
            times.append(time.perf_counter())
            tokens.append(tok)
            if len(tokens) == 1:
                ev.emit("first_token", prefill_s=times[0] - t0)
                disk0 = device.counters(cfg["path"]) if device else None
        t_end = time.perf_counter()
        # the disk's rate during the decode (its reads, from the device's own counters)
        disk_gbs = device.rate(disk0, device.counters(cfg["path"])) if device and len(tokens) > 1 else None
        ev.emit("done", tokens=tokens, prompt_tokens=len(cfg["prompt_ids"]),
                prefill_s=times[0] - t0 if times else None,
                decode_s=times[-1] - times[0] if len(times) > 1 else None,
                decode_tokens=len(tokens) - 1, total_s=t_end - t0, read_bytes_start=rb0,
                decode_disk_gbs=disk_gbs, **rt.extra(disk_gbs))
    except Exception as e:
        if flash_error is not None and isinstance(e, flash_error):
            ev.emit("error", phase=phase, message=str(e))
            return 2
        import traceback

        ev.emit("error", phase=phase, message=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc()[-2000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

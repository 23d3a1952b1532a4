"""The peers benchmark: mlx_flash, mlx_lm and llama.cpp in one run, under one memory limit.

Every run of every system is its own process, started inside a fresh memory
cgroup (v1 `memory.limit_in_bytes`, or v2 `memory.max`) by a two-line shell
launcher that writes its own pid into `cgroup.procs` and then execs the
system, so the interpreter and the imports are counted from the first byte.
The page cache is dropped before every run (cold start), and the cgroup's
limit counts page cache too: a peer that memory-maps its weights (llama.cpp)
keeps re-reading them from disk when they do not fit, one that reads them
into anonymous memory (mlx_lm) is OOM-killed, and mlx_flash's planner is
told, through `memory_budget`, how much of the limit its weights may take.

The limit: "50%" (the default) gives each runtime its own baseline (the RSS of
a process that has imported the runtime but loaded no weights, measured once
per runtime in a probe run) plus 50 % of the model's float32 weights; a byte
count gives every system that limit; several limits ("50%,100%") run every
system at each. `system@none` runs a system without a limit (still in a
cgroup, so its peak is measured the same way).

mlx_flash's `memory_budget` counts weights only. By default (`--flash-budget
auto`) each limited mlx_flash system first runs once without a limit at the
full budget (limit - baseline); its peak RSS minus the weights its plan held is
what it needs besides weights, and its budget under the limit is the limit
minus that, minus 5 %. `full` passes limit - baseline as is.

Systems (the same prompt token ids for all, greedy, the end tokens forbidden
so that every system decodes exactly N tokens):

  mlx_flash:dense | mlx_flash:naive | mlx_flash:hybrid
  mlx_flash:flash:<sparsity>:<density>   e.g. mlx_flash:flash:dip:0.5
  mlx_lm                                 the flash folder exported to float32 HF
  llama.cpp-f32 | llama.cpp-f16 | llama.cpp-q4_1
                                         llama-cpp-python in .venv-peers
                                         (`make peers-setup`); F32/F16 GGUFs
                                         written from the source GGUF with the
                                         same float16-rounded values as the
                                         flash folder

Per system: decode and prompt tokens/s, the cgroup's peak (page cache
included) and the process's peak RSS, bytes read from disk per decode token
(/proc/<pid>/io read_bytes, which counts O_DIRECT and mmap page-fault reads),
and whether the kernel's OOM killer ended it. Rounds alternate the order of
the systems; speeds are also given as the median per-round ratio to a
reference system.
"""

import csv
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import FlashError
from ..sizes import MiB, parse_share

MB = 1e6
RUNTIMES = ("mlx_flash", "mlx_lm", "llama.cpp")
MLX_FLASH_MODES = ("dense", "naive", "hybrid", "flash")
SPARSITIES = ("oracle", "threshold", "dip", "dip-ca", "predictor")
GGUF_TYPES = ("f32", "f16", "q4_1")
DEFAULT_SYSTEMS = ("mlx_flash:dense@none,mlx_flash:hybrid:f16,mlx_flash:naive:f16,mlx_flash:flash:dip:0.5:f16,"
                   "mlx_lm,llama.cpp-f32,llama.cpp-f16")
DEFAULT_MODEL = "models/smollm2-135m-instruct"
DEFAULT_GGUF = "models/download/SmolLM2-135M-Instruct.Q4_1.gguf"
CHILD = Path(__file__).with_name("peer_child.py")
BLAS_MODULE = Path(__file__).resolve().parent.parent / "blas.py"
REPO = Path(__file__).resolve().parents[2]

SPEC_HELP = ("mlx_flash:dense, mlx_flash:naive, mlx_flash:hybrid, mlx_flash:flash:<sparsity>:<density> "
             "(e.g. mlx_flash:flash:dip:0.5), each with ':f16' to hold the weights at float16 in DRAM "
             "(e.g. mlx_flash:hybrid:f16), mlx_lm, llama.cpp-f32, llama.cpp-f16, llama.cpp-q4_1; "
             "append @none for no memory limit or @<size> (e.g. @400MB) for a limit of its own")


# --- systems ---


@dataclass(frozen=True)
class System:
    spec: str  # as written on the command line
    runtime: str  # mlx_flash | mlx_lm | llama.cpp
    mode: str = None  # mlx_flash
    sparsity: str = None  # mlx_flash flash mode
    density: float = None
    gguf: str = None  # llama.cpp: f32 | f16 | q4_1
    limit: str = None  # None: the run's --limit; "none": no limit; else a size
    resident_dtype: str = None  # mlx_flash: "float16" holds the weights at 16 bits (":f16")

    @property
    def name(self):
        return self.spec.split("@")[0]


def parse_system(spec):
    """'mlx_flash:flash:dip:0.5@none' -> System; FlashError naming the valid forms otherwise."""
    text = spec.strip()
    if not text:
        raise FlashError(f"empty system spec (valid: {SPEC_HELP})")
    base, at, limit = text.partition("@")
    if at:
        if limit.lower() == "none":
            limit = "none"
        else:
            parse_limit(limit, what=f"system '{text}': limit")
    else:
        limit = None

    def bad(why):
        return FlashError(f"system '{text}': {why} (valid: {SPEC_HELP})")

    parts = base.split(":")
    head = parts[0]
    if head == "mlx_flash":
        held = None
        if len(parts) > 2 and parts[-1] == "f16":  # weights held at float16 in DRAM
            held, parts = "float16", parts[:-1]
        if len(parts) < 2:
            raise bad("mlx_flash needs a mode")
        mode = parts[1]
        if mode not in MLX_FLASH_MODES:
            raise bad(f"unknown mlx_flash mode '{mode}' (modes: {', '.join(MLX_FLASH_MODES)})")
        if mode != "flash":
            if len(parts) > 2:
                raise bad(f"mode {mode} takes no sparsity or density")
            return System(text, "mlx_flash", mode=mode, limit=limit, resident_dtype=held)
        if len(parts) != 4:
            raise bad("the flash mode needs a sparsity source and a density, e.g. mlx_flash:flash:dip:0.5")
        sparsity, density = parts[2], parts[3]
        if sparsity not in SPARSITIES:
            raise bad(f"unknown sparsity '{sparsity}' (sources: {', '.join(SPARSITIES)})")
        try:
            d = float(density)
        except ValueError:
            raise bad(f"density '{density}' is not a number")
        if not 0 < d <= 1:
            raise bad(f"density {density} is not in (0, 1]")
        return System(text, "mlx_flash", mode="flash", sparsity=sparsity, density=d, limit=limit,
                      resident_dtype=held)
    if head == "mlx_lm":
        if len(parts) > 1:
            raise bad("mlx_lm takes no options")
        return System(text, "mlx_lm", limit=limit)
    m = re.fullmatch(r"llama\.cpp-([a-z0-9_]+)", base)
    if m:
        if m.group(1) not in GGUF_TYPES:
            raise bad(f"unknown llama.cpp weights '{m.group(1)}' (choose from {', '.join(GGUF_TYPES)})")
        return System(text, "llama.cpp", gguf=m.group(1), limit=limit)
    raise bad(f"unknown system '{base}'")


def parse_systems(text):
    systems = [parse_system(s) for s in str(text).split(",") if s.strip()]
    if not systems:
        raise FlashError(f"no systems given (valid: {SPEC_HELP})")
    seen = set()
    for s in systems:
        if s.spec in seen:
            raise FlashError(f"system '{s.spec}' is given twice")
        seen.add(s.spec)
    return systems


def parse_limit(text, what="--limit"):
    """'50%' -> ('fraction', 0.5); '400MB' -> ('bytes', 400e6); 'none' -> ('none', None)."""
    if str(text).strip().lower() == "none":
        return ("none", None)
    kind, v = parse_share(text, what, max_percent=1000, examples="50%, 400MB, 512MiB, none")
    if kind == "bytes" and v < MiB:
        raise FlashError(f"{what}: {text} is under 1 MiB")
    return (kind, v)


# --- memory cgroups ---


V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(FlashError):
    pass


def cgroup_support(v1_root=V1_ROOT, v2_root=V2_ROOT):
    """('v2', root) or ('v1', root) when this process can make memory cgroups; else (None, why)."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return None, "not root: creating a memory cgroup needs root"
    v1_root, v2_root = Path(v1_root), Path(v2_root)
    ctl = v2_root / "cgroup.controllers"
    if ctl.exists():
        try:
            if "memory" in ctl.read_text().split():
                return "v2", v2_root
        except OSError:
            pass
    if (v1_root / "memory.limit_in_bytes").exists():
        return "v1", v1_root
    return None, (f"no memory cgroup: neither {ctl} listing 'memory' (v2) nor "
                  f"{v1_root / 'memory.limit_in_bytes'} (v1) exists")


@dataclass
class CgroupRun:
    returncode: int
    oom_killed: bool
    limit_bytes: int = None
    peak_bytes: int = None  # the cgroup's peak, page cache included (None without a cgroup)
    limit_hits: int = None  # v1 memory.failcnt / v2 memory.events "max"
    oom_kills: int = None
    timed_out: bool = False
    wall_s: float = 0.0
    cgroup: str = None  # v1 | v2 | None

    @property
    def signal(self):
        return -self.returncode if self.returncode < 0 else None


ENTERED_FAILED = 97  # the launcher's exit status when it cannot enter the cgroup
# $0 is cgroup.procs; the shell writes its own pid (which the exec keeps) there.
LAUNCHER = 'echo $$ > "$0" || exit 97; exec "$@"'


class MemoryCgroupRunner:
    """Runs commands one at a time, each in a fresh memory cgroup under
    <root>/mlx_flash_peers_<pid>/run<k>, with an optional byte limit.

        with MemoryCgroupRunner() as runner:
            r = runner.run([sys.executable, "-c", "..."], limit_bytes=64 << 20)
            r.oom_killed, r.peak_bytes
    """

    def __init__(self, name=None, v1_root=V1_ROOT, v2_root=V2_ROOT):
        version, where = cgroup_support(v1_root, v2_root)
        if version is None:
            raise CgroupUnavailable(where)
        self.version = version
        self.path = Path(where) / (name or f"mlx_flash_peers_{os.getpid()}")
        try:
            self.path.mkdir(exist_ok=True)
            if version == "v2":
                _write(self.path / "cgroup.subtree_control", "+memory")
        except OSError as e:
            raise CgroupUnavailable(f"cannot create the memory cgroup {self.path}: {e}")
        self._n = 0
        self.current = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, cmd, limit_bytes=None, timeout=None, **popen_kwargs):
        self._n += 1
        cg = self.path / f"run{self._n}"
        cg.mkdir()
        try:
            self._set_limit(cg, limit_bytes)
            t0 = time.monotonic()
            launcher = ["/bin/sh", "-c", LAUNCHER, str(cg / "cgroup.procs"), *map(str, cmd)]
            rc, timed_out = _wait(subprocess.Popen(launcher, **popen_kwargs), timeout, self)
            wall = time.monotonic() - t0
            if rc == ENTERED_FAILED:
                raise CgroupUnavailable(f"could not move the child into {cg} (launcher exit {rc})")
            peak, hits, ooms = self._stats(cg)
        finally:
            self._remove(cg)
        oom = ooms > 0 if ooms is not None else (rc == -signal.SIGKILL and bool(hits))
        return CgroupRun(rc, oom, limit_bytes, peak, hits, ooms, timed_out, wall, self.version)

    def _set_limit(self, cg, limit):
        if self.version == "v1":
            if limit is not None:
                _write(cg / "memory.limit_in_bytes", str(int(limit)))
                # with swap accounting, also forbid swapping past the limit
                _try_write(cg / "memory.memsw.limit_in_bytes", str(int(limit)))
        else:
            _write(cg / "memory.max", str(int(limit)) if limit is not None else "max")
            if limit is not None:
                _try_write(cg / "memory.swap.max", "0")

    def _stats(self, cg):
        if self.version == "v1":
            peak = _read_int(cg / "memory.max_usage_in_bytes")
            hits = _read_int(cg / "memory.failcnt")
            ooms = _read_keyed(cg / "memory.oom_control").get("oom_kill")
        else:
            peak = _read_int(cg / "memory.peak")
            events = _read_keyed(cg / "memory.events")
            hits, ooms = events.get("max"), events.get("oom_kill")
        return peak, hits, ooms

    def _remove(self, cg):
        if self.version == "v1":
            _try_write(cg / "memory.force_empty", "0")  # give the page cache charges back
        for _ in range(50):
            try:
                cg.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)  # the last task is still leaving
        print(f"[peers] warning: could not remove {cg}", file=sys.stderr)

    def close(self):
        if self.path is None:
            return
        for child in sorted(self.path.glob("run*")):
            if child.is_dir():
                self._remove(child)
        try:
            self.path.rmdir()
        except OSError as e:
            print(f"[peers] warning: could not remove {self.path}: {e}", file=sys.stderr)
        self.path = None


class UnconstrainedRunner:
    """The same interface without a cgroup (not root, or no memory controller)."""

    version = None

    def __init__(self, reason):
        self.reason = reason
        self.current = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def run(self, cmd, limit_bytes=None, timeout=None, **popen_kwargs):
        t0 = time.monotonic()
        rc, timed_out = _wait(subprocess.Popen([str(c) for c in cmd], **popen_kwargs), timeout, self)
        return CgroupRun(rc, False, None, None, None, None, timed_out, time.monotonic() - t0, None)

    def close(self):
        pass


def _wait(proc, timeout, owner):
    owner.current = proc
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(), True
    except BaseException:
        proc.kill()  # interrupted: never leave a child behind
        proc.wait()
        raise
    finally:
        owner.current = None


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _try_write(path, text):
    try:
        _write(path, text)
        return True
    except OSError:
        return False


def _read_int(path):
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_keyed(path):
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def loadavg():
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def drop_caches():
    """Empty the page cache (root): the next run reads its weights from disk. False if not allowed."""
    try:
        os.sync()
        _write("/proc/sys/vm/drop_caches", "3")
        return True
    except OSError:
        return False


# --- the model and what each peer needs ---


def model_float32_bytes(folder):
    """The model's weights in float32: resident tensors plus every FFN neuron (what dense holds)."""
    from ..layout.format import read_manifest
    from ..layout.safetensors_io import SafetensorsFile

    folder = Path(folder)
    manifest = read_manifest(folder)
    st = SafetensorsFile(folder / manifest.resident["file"])
    resident = sum(_prod(st.shape(n)) for n in st.names())
    lay = manifest.layout
    ffn = len(manifest.ffn_files) * len(lay.kinds) * lay.d_model * lay.n_neurons
    return 4 * (resident + ffn)


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def peers_home(folder):
    """Where the exported HF folder and GGUFs of a model are kept ($MLX_FLASH_HOME/peers/...)."""
    from ..layout.format import read_manifest
    from ..loader import default_home

    m = read_manifest(folder)
    tag = (m.resident.get("sha256") or "nosha")[:10]
    return default_home() / "peers" / f"{Path(folder).resolve().name}-{tag}"


def ensure_hf_export(folder, home, progress=print):
    """The flash folder as a float32 Hugging Face folder for mlx_lm, exported once."""
    from ..layout.export import export_hf

    out = Path(home) / "hf-float32"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    progress(f"[peers] exporting {folder} to a float32 HF folder for mlx_lm: {out}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(folder, tmp, dtype="float32")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def source_gguf(folder, given=None):
    """The GGUF the flash folder was converted from (or --gguf), or None."""
    if given:
        p = Path(given)
        if not p.is_file():
            raise FlashError(f"--gguf {given}: no such file")
        return p
    from ..layout.format import read_manifest

    src = read_manifest(folder).source or ""
    for cand in (src, DEFAULT_GGUF):
        if cand and cand.lower().endswith(".gguf") and Path(cand).is_file():
            return Path(cand)
    return None


def write_float_gguf(src, dst, kind):
    """A F32 or F16 copy of a (quantized) GGUF, for llama.cpp.

    Every tensor is dequantized (gguf.quants) and rounded to float16, which is
    what `mlx_flash.convert --dtype float16` stores: the F16 file holds exactly
    the flash folder's values, the F32 file the same values widened. 1-D
    tensors (norms) stay F32 as llama.cpp's own converter keeps them (with the
    float16-rounded values). Metadata is copied, general.file_type updated.
    Written to a temporary name, then renamed.
    """
    import gguf
    import numpy as np

    if kind not in ("f32", "f16"):
        raise FlashError(f"cannot write a {kind} GGUF (f32 or f16)")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    file_type = gguf.LlamaFileType.ALL_F32 if kind == "f32" else gguf.LlamaFileType.MOSTLY_F16
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = int(file_type) if f.name == gguf.Keys.General.FILE_TYPE else f.contents()
        writer.add_key_value(f.name, value, vtype, sub_type=sub)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(int(file_type))

    def values(t):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
        if len(t.shape) == 1 or kind == "f32":
            return w.astype(np.float32)
        return w

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        dtype = np.float32 if (len(t.shape) == 1 or kind == "f32") else np.float16
        writer.add_tensor_info(t.name, shape, np.dtype(dtype), _prod(shape) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(np.ascontiguousarray(values(t)))
    writer.close()
    tmp.rename(dst)
    return dst


def ensure_gguf(src, home, kind, progress=print):
    if kind == "q4_1":
        return Path(src)
    out = Path(home) / f"{Path(src).stem.split('.')[0]}-{kind.upper()}.gguf"
    if not out.exists():
        progress(f"[peers] writing the {kind.upper()} GGUF for llama.cpp from {src}: {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        write_float_gguf(src, out, kind)
    return out


def llama_cpp_python(given=None):
    """(interpreter, version) that imports llama_cpp, or (None, why not)."""
    tried = []
    if given:
        cands = [given]
    else:
        cands = [os.environ.get("MLX_FLASH_PEERS_PYTHON"), ".venv-peers/bin/python",
                 str(REPO / ".venv-peers" / "bin" / "python"), sys.executable]
    for c in dict.fromkeys(c for c in cands if c):
        if not Path(c).exists():
            tried.append(f"{c} (not found)")
            continue
        ok, out = check_import(c, "llama_cpp")
        if ok:
            return c, out
        tried.append(f"{c} ({out})")
    return None, ("llama_cpp is not importable by " + "; ".join(tried)
                  + ". Build it with `make peers-setup` (llama-cpp-python from its sdist, "
                  "in .venv-peers) or pass --llama-python")


def check_import(python, module):
    try:
        r = subprocess.run([python, "-c", f"import {module} as m; print(getattr(m, '__version__', '?'))"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if r.returncode == 0:
        return True, r.stdout.strip()
    last = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
    return False, last


PASSAGE = (
    "The lighthouse keeper of the northern island kept a log of every ship that passed, every storm "
    "that broke against the rocks and every bird that rested on the rail of the lamp room. For "
    "thirty years the entries were short: the wind, the sea, the hours the lamp was lit. Then, one "
    "autumn, the supply boat stopped coming. At first she thought the weather had kept it in the "
    "harbour, but the sea was calm for a week and the radio answered only with static. She counted "
    "what was left in the store room: flour for a month, oil for the lamp for two, a crate of "
    "apples, salt fish, candles and the seeds her predecessor had left in a tin marked for spring. "
    "She decided to keep the lamp burning every night, whatever happened on the mainland, because "
    "a light that goes out is a promise broken. She mended the nets, dug a garden in the thin soil "
    "behind the tower, caught fish from the landing and wrote longer entries in the log, as if "
    "someone would one day read them and want to know how she had spent the days. In the third "
    "week a small boat appeared on the horizon, moving slowly against the current, with a patched "
    "sail and a single figure at the tiller. She watched it through the telescope until dusk, lit "
    "the lamp, and went down to the landing with a lantern to wait. The figure was a boy of about "
    "twelve, soaked and exhausted, who said that the town had been emptied by a fever and that he "
    "had followed the light because it was the only one still burning along the whole coast."
)
INSTRUCTION = "Read this passage, then continue the story in detail: what do they do next?\n\n"


def prompt_ids(folder, n_tokens):
    """A fixed prompt of about n_tokens (chat template included) as token ids, and its text."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    config = json.loads((Path(folder) / "config.json").read_text())
    tok = load_tokenizer(Path(folder), eos_token_ids=config.get("eos_token_id"))
    words = PASSAGE.split()
    while len(words) < 4 * n_tokens:
        words = words + PASSAGE.split()

    def ids(k):
        text = INSTRUCTION + " ".join(words[:k])
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            out = tok.encode(text)
        return list(out), text

    lo, hi = 0, len(words)
    while lo < hi:  # the most words whose prompt fits n_tokens
        mid = (lo + hi + 1) // 2
        if len(ids(mid)[0]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    out, text = ids(lo)
    eos = sorted(int(i) for i in (getattr(tok, "eos_token_ids", None) or [tok.eos_token_id]))
    return out, text, eos


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
        rec.extra = {k: v for k, v in d.items() if k.startswith(("lib_", "mlx_", "flash_"))}
    if "loaded" in ev:
        rec.extra.update({k: v for k, v in ev["loaded"].items()
                          if k in ("memory_budget_bytes", "plan_weights_bytes", "threads", "mmap")})
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
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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
                 flash_budget="auto", log=print):
        self.model = Path(model)
        if not (self.model / "manifest.json").is_file():
            raise FlashError(f"{model}: not a converted mlx_flash folder (build the default one with `make model`)")
        systems = parse_systems(systems) if isinstance(systems, str) else list(systems)
        self.limit_texts = [t.strip() for t in str(limit).split(",") if t.strip()] or ["50%"]
        for t in self.limit_texts:
            parse_limit(t)
        self.limit = parse_limit(self.limit_texts[0])
        if len(self.limit_texts) > 1:  # every system without a limit of its own, at every limit
            systems = [s if s.limit else System(f"{s.spec}@{t}", s.runtime, s.mode, s.sparsity, s.density,
                                                s.gguf, "none" if t.lower() == "none" else t)
                       for s in systems for t in (self.limit_texts if not s.limit else [None])]
            systems = list({s.spec: s for s in systems}.values())
        self.systems = systems
        self.flash_budget = parse_flash_budget(flash_budget)
        self.calibration = {}  # spec -> the unconstrained run that sized mlx_flash's budget
        self.prompt_tokens, self.tokens, self.rounds = prompt_tokens, tokens, rounds
        if tokens < 2:
            raise FlashError("--tokens must be at least 2 (decode speed is timed after the first token)")
        if rounds < 1:
            raise FlashError("--rounds must be at least 1")
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
        self.prompt, self.prompt_text, self.suppress = prompt_ids(self.model, self.prompt_tokens)
        self.log(f"[peers] model {self.model}: {self.f32_bytes / MB:.0f} MB of float32 weights; "
                 f"prompt {len(self.prompt)} tokens, {self.tokens} decode tokens, {self.rounds} rounds")
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

    def _config(self, system, workdir, probe=False, budget=None):
        cfg = {"runtime": system.runtime, "path": self.paths.get(system.spec), "mode": system.mode,
               "sparsity": system.sparsity, "density": system.density, "memory_budget": budget,
               "resident_dtype": system.resident_dtype,
               "prompt_ids": self.prompt, "tokens": self.tokens, "suppress_ids": self.suppress,
               "probe": probe, "threads": os.cpu_count(), "blas_module": str(BLAS_MODULE),
               "events": str(workdir / "events.jsonl")}
        (workdir / "config.json").write_text(json.dumps(cfg))
        return workdir / "config.json"

    def _launch(self, runner, system, limit=None, budget=None, probe=False):
        with tempfile.TemporaryDirectory(prefix="mlx_flash_peers_") as tmp:
            tmp = Path(tmp)
            cfg = self._config(system, tmp, probe=probe, budget=budget)
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
        limit = int(base + value * self.f32_bytes) if kind == "fraction" else int(value)
        budget = None
        if system.runtime == "mlx_flash":
            how, v = self.flash_budget
            if how == "fraction":
                budget = int(v * self.f32_bytes)
            elif how == "bytes":
                budget = int(v)
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
                       read_load_bytes=med("read_load_bytes"))
            row["cgroup_peak_bytes"] = _max([r.cgroup_peak_bytes for r in mine])
            row["rss_peak_bytes"] = _max([r.rss_peak_bytes for r in mine])
            ratios = [r.decode_tps / ref_runs[r.round].decode_tps for r in ok
                      if r.round in ref_runs and r.decode_tps and ref_runs[r.round].decode_tps]
            row["decode_vs_reference"] = _median(ratios)
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
            "dtype": ("mlx: float16 on flash, float32 compute (mlx_lm: float32 export of the same values); "
                      "llama.cpp: F32 / F16 GGUF of the same float16-rounded values"),
            "limit": "; ".join(_limit_text(parse_limit(t)) for t in self.limit_texts),
            "cgroup": self.cgroup or "none",
            "flash_budget": _flash_budget_text(self.flash_budget), "calibration": self.calibration,
            "baselines": self.baselines, "prompt_tokens": len(self.prompt), "decode_tokens": self.tokens,
            "rounds": self.rounds, "reference": self.reference, "cold": self.cold, "notes": self.notes,
            "prompt_text": self.prompt_text,
            "loadavg": [min((x for r in runs for x in (r.loadavg or []) if x is not None), default=None),
                        max((x for r in runs for x in (r.loadavg or []) if x is not None), default=None)],
        }
        return {"info": info, "rows": rows, "runs": [asdict(r) for r in runs]}


# llama.cpp's OpenMP threads spin while they wait for each other. On a shared
# 2-core machine one of the two is often descheduled and the spinning one burns
# its slice: llama.cpp F16 decoded 0.3 tok/s with 2 threads under a load of 4,
# 28 tok/s with OMP_WAIT_POLICY=passive, 25 with 1 thread (2026-11-22). MLX's
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


def _limit_text(limit):
    kind, v = limit
    if kind == "none":
        return "none"
    if kind == "fraction":
        return f"each runtime's baseline RSS + {v * 100:g}% of the model's float32 weights"
    return f"{v / MB:.0f} MB for every system"


def parse_flash_budget(text):
    """--flash-budget: auto | full | N% (of the float32 model) | a size."""
    t = str(text).strip().lower()
    if t in ("auto", "full"):
        return (t, None)
    kind, v = parse_limit(text, what="--flash-budget")
    if kind == "none":
        raise FlashError("--flash-budget: none is not a budget (auto, full, 40%, 200MB)")
    return (kind, v)


def _flash_budget_text(fb):
    how, v = fb
    if how == "auto":
        return ("auto: limit - (peak RSS - weights held) of one unconstrained run of the same system at "
                "the full budget - 5% of the limit")
    if how == "full":
        return "full: limit - the runtime's baseline"
    return f"{v * 100:g}% of the float32 model" if how == "fraction" else f"{v / MB:.0f} MB"


def _summary_line(r):
    if r.status == "ok":
        return (f"decode {r.decode_tps:.1f} tok/s, prompt {r.prompt_tps:.0f} tok/s, load {r.load_s:.1f} s, "
                f"cgroup peak {_mb(r.cgroup_peak_bytes)}, RSS peak {_mb(r.rss_peak_bytes)}, "
                f"read {_mb(r.read_per_token_bytes)}/token")
    return f"{r.status.upper()}: {r.message} (cgroup peak {_mb(r.cgroup_peak_bytes)})"


# --- output ---

COLUMNS = [
    ("system", "system", None),
    ("limit_bytes", "limit MB", "mb"),
    ("memory_budget_bytes", "budget MB", "mb"),
    ("status", "status", None),
    ("decode_tps", "decode tok/s", "1"),
    ("decode_vs_reference", "vs ref", "2"),
    ("prompt_tps", "prompt tok/s", "0"),
    ("load_s", "load s", "1"),
    ("cgroup_peak_bytes", "cgroup peak MB", "mb"),
    ("rss_peak_bytes", "RSS peak MB", "mb"),
    ("read_per_token_bytes", "read MB/token", "mb1"),
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
        f"- model: {i['model']} ({i['model_float32_bytes'] / MB:.0f} MB of float32 weights)",
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
            "read_per_token_bytes", "read_prefill_bytes", "read_load_bytes", "same_tokens_as_reference", "message"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for row in res["rows"]:
            w.writerow(row)


def write_json(res, path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)

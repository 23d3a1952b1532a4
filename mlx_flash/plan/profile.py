"""This machine's rates, measured once and cached: what the cost model (plan/cost.py) divides by.

- disk: uncached random reads (O_DIRECT / F_NOCACHE, the reader's thread pool), GB/s by
  read size, from 2 KiB to 1 MiB; and what a small batch of them (a layer's) costs beyond its
  bytes at that rate: its first read's latency, which a deep queue's throughput hides;
- per layer and per token: what a decode token costs apart from its bytes (MLX's dispatch,
  the store's syncs; not the time it waits for its reads, which the I/O term holds), by mode
  and model width, from 4-bit probe models of 4 and
  36 layers decoded through the real runtime without prefetch (convert/random_model.py): the
  slope between the two depths is the per-layer cost, the rest what a token costs once
  (embedding, lm_head, sampling, Python);
- convert: what a read costs besides the disk when its rows arrive as float32 (dequantized or
  converted on the way into a float cache), per value;
- overlap: the share of min(I/O, compute) that prefetch (the next layer read while this one
  computes) hides here, from the deeper probe decoded with and without it: near 1 where the
  reader's threads have cores of their own, less where they share two with the compute;
- compute: GB/s of weights consumed by one decode step's matrix-vector products, for
  each form a weight can be held in: float32 (BLAS), 16-bit held (on the CPU the native
  kernels read the 16-bit rows as they are, else a float32 arena, then BLAS: models/half.py;
  a held dense or hybrid FFN's rows too) and 4-/8-bit quantized (the native kernels on the CPU, MLX's quantized matmul
  elsewhere: models/quantized.py); and on the CPU an FFN's packed rows (q4-rows, q8-rows:
  the row and column kernels models/ffn.py runs on them) and its rows held at 16 bits
  (float16-rows: gather_mv, then gather_axpy for the down rows);
- read_steal: the seconds of compute a GB read meanwhile costs: a batch step's FFN matrix
  through the pass kernels timed alone and while the reader streams uncached reads, plus the
  reads' CRC32C checks' CPU time spread over the cores (0 when not measured);
- read_busy: the other way round, the share of their rate alone that the same reads keep
  beside a decode token's compute (4-bit one-position products past the CPU's caches, without
  pause): its threads hold the cores and its weights the memory bus that the reads' block-layer
  work, completions, checks and DMA need (0.92-0.995 here, the nearer 1 the slower the disk; 1
  when not measured);
- place_s: the seconds a GB the reader adds placing rows as they are (a layer's reads into a
  store's rows, against the same reads thrown away, as the disk probe reads: ~0.04 at a disk of
  2.2-3.4 GB/s here, ~0 at 1.4; 0 when not measured; benchmarks/cost-model/);
- pass_compute: the same forms' rates for a batch's decode step of 8 to 64 sequences (one new
  position each: the pass kernels, or dequantized chunks + BLAS where those do not run; the
  quick probe: 16 and 32, at a 7B matrix only); without them a batch's step is priced as that
  many one-position steps.

Here: the profile and its cache. plan/measure.py measures it (it decodes probe models through
the runtime, imported inside its functions); `mlx_flash.benchmark profile` writes it into
$MLX_FLASH_HOME/profile.json; load_profile() reads that, and the commands that need it
(generate --explain) run plan/measure.py's quick probe (about 45 s here, in a child process,
said on stderr) when it is missing or was measured on another machine or MLX.
"""

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

import mlx.core as mx

from ..errors import FlashError
from ..home import default_home
from ..kernels import SMALL_PASS

VERSION = 8  # the profile's format and probe: a cached profile of another version is measured again


@dataclass
class Profile:
    disk: dict  # read size (bytes) -> GB/s, uncached, `threads` readers
    threads: int
    compute: dict  # weight form ("float32", ..., "q4", "q8") -> {matrix elements: GB/s consumed}
    layer_ms: dict  # mode -> {d_model: ms a decode token spends per layer besides its bytes (dispatch, syncs, store)}
    token_ms: dict  # mode -> {d_model: ms a decode token spends once besides its bytes and layers}
    overlap: float  # the share of min(I/O, compute) that prefetch hides (0: none, 1: all but one layer's)
    machine: str
    mlx: str
    device: str
    measured: str  # when
    quick: bool = False
    version: int = VERSION
    notes: list = field(default_factory=list)
    convert_ns: float = 0.0  # ns the reader spends a value it dequantizes / converts into float32 rows
    batch_ms: float = 0.0  # ms a batch of reads costs beyond its bytes at the curve's rate (latency)
    # weight form -> {matrix elements: {sequences: GB/s consumed by a batch's decode step}}
    pass_compute: dict = field(default_factory=dict)
    read_steal: float = 0.0  # s of compute lost a GB read meanwhile (prefetch's reads during a layer's compute)
    read_busy: float = 1.0  # the share of their rate alone the reads keep while compute runs beside them
    place_s: float = 0.0  # s a GB the reader adds placing rows as they are, beyond the reads thrown away

    def disk_gbs(self, read_bytes):
        """GB/s at a read size: interpolated on log(size) between the measured ones."""
        return curve_gbs(self.disk, read_bytes)

    def with_disk_rate(self, gbs, read_bytes):
        """A copy whose disk curve is this one scaled so that reads of `read_bytes` run at `gbs`
        (a rate the disk was measured at later, e.g. during a run: this machine's disk drifts
        ~2x within an hour, its curve's shape much less)."""
        f = gbs / self.disk_gbs(read_bytes)
        return replace(self, disk={k: v * f for k, v in self.disk.items()})

    def at_run_disk(self, gbs, read_bytes):
        """with_disk_rate for a rate the device's own counters gave during a run (io/device.py:
        bytes over the time the device was busy, at the queue depth the run kept). What the
        run's I/O path cost its reads, the compute beside them (read_busy) and the placing of
        their rows (place_s), is in that rate already (reads submitted late by a busy CPU keep
        fewer in flight): both left out (1.0, 0), not counted twice."""
        return replace(self.with_disk_rate(gbs, read_bytes), read_busy=1.0, place_s=0.0)

    def compute_gbs(self, form, elements=None):
        """GB/s of `form` weights consumed by a matrix of `elements` (rows x cols): interpolated on
        log(elements) between the measured sizes (a small matrix's fixed costs weigh more:
        576 x 1536 runs at a third of a 7B FFN matrix's rate here); None: the largest."""
        rates = _of_form(self.compute, form)
        if rates is None:
            raise FlashError(f"the machine profile has no compute rate for {form} weights "
                             f"(it has {', '.join(self.compute)}): run mlx_flash.benchmark profile")
        return _at_size(rates, elements)

    def step_ms(self, form, nbytes, elements=None, positions=1):
        """ms a decode step of `positions` sequences spends on `nbytes` of `form` weights: one
        position at compute_gbs; more, the one-position time times what a step of that many cost
        against one position at the sizes pass_compute measured (interpolated on log(size): the
        quick probe measures a 7B matrix only, whose ratio a small model's step then takes, not
        its absolute rate), linearly in the step's time between the measured batch sizes and in
        proportion beyond the largest. Where the native kernels run (a form other than float32
        on the CPU), up to SMALL_PASS sequences are that many one-position products (what the
        runtime runs) and more than that but fewer than the smallest measured cost what it
        costs (the tiles pad to 16); elsewhere (MLX multiplies the pass at once) from one
        position's time. Without the rates it needs: `positions` one-position products (an
        older profile's; priced_step says so)."""
        one = 1e3 * nbytes / (self.compute_gbs(form, elements) * 1e9)
        rates = self._pass_rates(form)
        kernels = self._position_by_position(form)
        if positions == 1 or rates is None or (kernels and positions <= SMALL_PASS):
            return positions * one
        points = []
        for p, r in sorted(rates.items()):
            slower = {n: self.compute_gbs(form, n) / gbs for n, gbs in r.items()}  # a step of p against one position
            points.append((p, one * _at_size(slower, elements)))
        if kernels and positions < points[0][0]:
            return points[0][1]
        points = points if kernels else [(1, one)] + points
        if positions >= points[-1][0]:
            return points[-1][1] * positions / points[-1][0]
        return float(np.interp(positions, [p for p, _ in points], [t for _, t in points]))

    def _position_by_position(self, form):
        """Whether a pass of up to SMALL_PASS positions runs position by position (the native
        kernels: every form but float32, on the CPU), not as one matrix product."""
        return self.device == "cpu" and form != "float32"

    def priced_step(self, form, positions):
        """Whether step_ms prices a step of `positions` of `form` from measurement (one position,
        the native kernels' position-by-position passes, or the form's batch rates)."""
        return (positions == 1 or (self._position_by_position(form) and positions <= SMALL_PASS)
                or self._pass_rates(form) is not None)

    def _pass_rates(self, form):
        """{positions: {elements: GB/s}} of a batch's step for `form`, or None (not measured)."""
        table = _of_form(self.pass_compute, form)
        if not table:
            return None
        out = {}
        for n, by_p in table.items():
            for p, gbs in by_p.items():
                out.setdefault(p, {})[n] = gbs
        return out

    def layer_cost(self, mode, d_model=None):
        """ms per layer besides the bytes, for `mode` at a model width: interpolated between the
        probed widths, the ends held beyond them (None: the widest probed)."""
        return _at_width(self.layer_ms, mode, d_model)

    def token_cost(self, mode, d_model=None):
        """ms a token costs once besides its bytes and layers, as layer_cost interpolates."""
        return _at_width(self.token_ms, mode, d_model)


    def as_dict(self):
        d = asdict(self)
        d["disk"] = {str(k): v for k, v in self.disk.items()}
        d["compute"] = {f: {str(n): v for n, v in r.items()} for f, r in self.compute.items()}
        for key in ("layer_ms", "token_ms"):
            d[key] = {m: {str(w): v for w, v in r.items()} for m, r in getattr(self, key).items()}
        d["pass_compute"] = {f: {str(n): {str(p): v for p, v in by_p.items()} for n, by_p in r.items()}
                             for f, r in self.pass_compute.items()}
        return d

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        d["disk"] = {int(k): float(v) for k, v in d["disk"].items()}
        d["compute"] = {f: {int(n): float(v) for n, v in r.items()} for f, r in d["compute"].items()}
        for key in ("layer_ms", "token_ms"):
            d[key] = {m: {int(w): float(v) for w, v in r.items()} for m, r in d[key].items()}
        d["pass_compute"] = {f: {int(n): {int(p): float(v) for p, v in by_p.items()} for n, by_p in r.items()}
                             for f, r in d.get("pass_compute", {}).items()}
        return cls(**d)


def curve_gbs(curve, read_bytes):
    """A disk curve ({read size: GB/s}) at a read size: interpolated on log(size)."""
    sizes = sorted(int(k) for k in curve)
    return float(np.interp(np.log(max(read_bytes, 1)), np.log(sizes), [curve[s] for s in sizes]))


def _of_form(table, form):
    """table[form], an FFN's packed rows (q4-rows) falling back to their bits' matrices (q4): the
    rows' own rates are measured only where the native kernels run. None: neither."""
    if form not in table and form.endswith("-rows"):
        form = form[: -len("-rows")]
    return table.get(form)


def _at_size(rates, elements):
    """{matrix elements: value (GB/s, or a ratio)} at a matrix size: interpolated on log(elements)
    (None: the largest)."""
    sizes = sorted(rates)
    if elements is None:
        return rates[sizes[-1]]
    return float(np.interp(np.log(max(elements, 1)), np.log(sizes), [rates[n] for n in sizes]))


def _at_width(table, mode, d_model):
    """table[mode] (dense's for a mode not probed) at a model width: interpolated between the
    probed widths, the ends held beyond them (None: the widest probed)."""
    costs = table.get(mode) or table["dense"]
    widths = sorted(costs)
    if d_model is None:
        return costs[widths[-1]]
    return float(np.interp(d_model, widths, [costs[w] for w in widths]))


def cpu_name():
    """The CPU's model name (Linux: /proc/cpuinfo, which platform.processor() leaves empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def machine_key():
    """What a profile is valid for: this machine's CPU and the MLX that computes."""
    cpu = cpu_name() or platform.machine()
    return f"{platform.system()} {platform.machine()} {cpu}, {os.cpu_count()} CPUs"


def profile_path():
    return default_home() / "profile.json"


def _device():
    return "cpu" if mx.default_device() == mx.cpu else "gpu"


def load_profile(path=None, measure=None, log=None):
    """The cached profile of this machine; when none is cached (or it was measured on another
    machine, MLX or device): None, or with `measure` (plan/measure.py's) a quick one measured
    now, said on stderr, and cached."""
    path = Path(path or profile_path())
    try:
        p = Profile.from_dict(json.loads(path.read_text()))
        if p.version == VERSION and p.machine == machine_key() and p.mlx == mx.__version__ \
                and p.device == _device():
            return p
        why = "it was measured on another machine, MLX or device"
    except FileNotFoundError:
        why = "none is cached"
    except (OSError, ValueError, TypeError, KeyError) as e:
        why = f"{path} is unreadable ({e})"
    if measure is None:
        return None
    (log or _say)(f"machine profile: {why}; a quick probe now (about 45 s; "
                  "`mlx_flash.benchmark profile` measures it fully)")
    p = measure(quick=True)
    save_profile(p, path)
    return p


def save_profile(p, path=None):
    path = Path(path or profile_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(p.as_dict(), indent=1))
    tmp.replace(path)  # never a half-written profile
    return path


def _say(text):
    print(f"[mlx_flash] {text}", file=sys.stderr)

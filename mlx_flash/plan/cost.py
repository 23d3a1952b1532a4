"""The cost model: one decode token's time under a plan, from this machine's profile.

    I/O      = bytes read from flash / the disk's uncached throughput at the read size, + the
               reader's cost of the values it dequantizes / converts into float32 rows on the way,
               or of the bytes it places into rows as they are (its copy out of a thread's
               staging slot, their checks: the profile's place_s a GB, measured at its disk's
               rate: ~0.04 s here at 2.2-3.4 GB/s, 1.08-1.14x the time of the same reads thrown
               away, as the disk probe reads; ~0 at 1.4, the copies hidden behind other reads),
               + the batches of reads a token issues (a layer's FFN rows, its streamed
               attention, its KV cache) x what a batch costs beyond its bytes (its first read's
               latency and the reader's pool waking: 0.2-0.5 ms here, which the throughput of a
               deep queue leaves out; a layer of hybrid's reads, 3 of 256 KiB, waited 1.15 ms
               for 0.8 ms of bytes)
    compute  = sum over the forms weights are held in of bytes consumed / that form's rate at
               the model's matrix size (one FFN matrix; small matrices run slower per byte);
               a batch's decode step (B sequences, one position each): the one-position time
               times what a step of B cost against one position in the profile
               (Profile.step_ms: the pass kernels' tiles of 16, or chunks + BLAS), the step's
               reads the same as one token's
    layers   = the layers x the mode's cost per layer besides its bytes (MLX's dispatch, the
               store's syncs), + what a token costs once (embedding, sampling, Python): the
               profile's probe models at two widths and two depths, less what this model
               predicts for their bytes, at the model's width
    mem      = bytes of rows a cache moves within itself (flash mode's overlap: rows swapped into
               the holes of those that left, so new ones append) / the float32 matrix rate
    total    = I/O + compute + layers + mem, less with prefetch (the next layer read while this one
               computes) the share of min(I/O, compute + layers) the profile measured it to
               hide here, over all layers but one (the first layer's read, or the last
               layer's compute, that nothing hides): overlap 1 and reads that run beside
               compute as fast as alone give max(I/O, C) + min/L;
               flash mode's overlap (a layer's missing rows read while its cached rows
               compute) hides reads behind those rows' compute only (Work.hideable); the reads
               that land during that compute slow it (the block layer's work for them, their
               checksums, their DMA into memory: the profile's read_steal, seconds a GB), for
               the share of the reads the compute spans (read_busy x hideable / I/O, at most
               all): nothing for a disk-bound token whose compute is short; here 0.14 s a GB, ~0.17 s of a
               4-bit OPT-6.7B batch step of 16 at 50 %, which reads 1.2 GB while it computes
               for 1.5 s (a hybrid step took 0.25-0.3 s longer than a dense one); and the
               compute slows the reads that land during it: they keep only the share
               read_busy of their rate alone (the profile's; 0.92-0.995 here), so the reads a
               layer's compute hides are at most those it spans at that rate: min(I/O,
               read_busy x compute) hidden, not min(I/O, compute). A token whose reads
               outlast its compute then takes I/O + (1 - read_busy) x compute, not about I/O
               (a hybrid 4-bit OPT-6.7B token at 50 %: ~25 ms more of ~600 at read_busy 0.92;
               benchmarks/cost-model/)

Weights consumed per token: every resident matrix a token multiplies by (attention,
lm_head; the embedding table only when it is the lm_head too) and, in the exact modes, every
FFN row, each at the rate of the form it is held in (plan/profile.py). FlexGen (§4.3) models
the same three terms per layer; here they are per token, as `--stats` measures them.
"""

from dataclasses import dataclass

from ..runtime.work import Work, converts, exact_work  # noqa: F401  (what the model prices)


@dataclass
class Prediction:
    io_ms: float
    compute_ms: float  # the weights' bytes and the per-layer overhead
    total_ms: float
    mem_ms: float = 0.0  # memory management: rows moved within a cache
    positions: int = 1  # a batch's step: the times are the step's (positions tokens)
    batch_priced: bool = True  # a batch's step priced from the profile's batch rates (False: as one-position steps)

    def describe(self):
        mem = f", memory management {self.mem_ms:.0f}" if self.mem_ms else ""
        unit = "ms/token" if self.positions == 1 else f"ms a step of {self.positions} sequences"
        unpriced = "" if self.batch_priced else ", as one-position steps: the profile has no batch rates"
        return f"{self.total_ms:.0f} {unit} (I/O {self.io_ms:.0f}, compute {self.compute_ms:.0f}{mem}{unpriced})"

    def as_dict(self):
        d = {"io_ms": self.io_ms, "compute_ms": self.compute_ms, "mem_ms": self.mem_ms, "total_ms": self.total_ms}
        return d if self.positions == 1 else d | {"positions": self.positions, "batch_priced": self.batch_priced}


def predict(work, profile):
    io = 1e3 * work.read_bytes / (profile.disk_gbs(work.read_size) * 1e9) if work.read_bytes else 0.0
    if work.kv_read_bytes:
        io += 1e3 * work.kv_read_bytes / (profile.disk_gbs(work.kv_read_size) * 1e9)
    io += work.converted_values * profile.convert_ns * 1e-6
    io += 1e3 * work.placed_bytes / 1e9 * profile.place_s
    io += work.read_batches * profile.batch_ms
    size = work.matrix_elements or None

    def of(computed):
        return sum(profile.step_ms(form, b, size, work.positions) for form, b in computed.items() if b)

    compute = of(work.computed)
    L, width = max(work.n_layers, 1), work.d_model or None
    compute += work.n_layers * profile.layer_cost(work.mode, width)
    total = io + compute
    if work.overlapped:
        hideable = compute if work.hideable is None else of(work.hideable)
        steal = read_steal_ms(profile, work.read_bytes + work.kv_read_bytes, hideable, io)
        compute, hideable, total = compute + steal, hideable + steal, total + steal
        total -= profile.overlap * min(io, profile.read_busy * hideable) * (L - 1) / L
    # rows moved within a cache: a pass over their bytes at the float32 matrix rate (both stream
    # memory); never hidden (a layer's rows move before its reads start)
    mem = 1e3 * work.moved_bytes / (profile.compute_gbs("float32", size) * 1e9) if work.moved_bytes else 0.0
    once = profile.token_cost(work.mode, width)
    priced = all(profile.priced_step(f, work.positions) for f, b in work.computed.items() if b)
    return Prediction(io, compute + once, total + mem + once, mem, work.positions, priced)


def read_steal_ms(profile, read_bytes, compute_ms, io_ms):
    """ms the reads landing during `compute_ms` of overlapped compute take from it (the profile's
    read_steal a GB, for the share of the reads the compute spans at their rate beside it:
    read_busy x compute / I/O, at most all)."""
    if not (read_bytes and io_ms > 0 and compute_ms > 0 and profile.read_steal):
        return 0.0
    return 1e3 * profile.read_steal * read_bytes / 1e9 * min(1.0, profile.read_busy * compute_ms / io_ms)


def predict_at_disk_rate(work, profile, disk_gbs):
    """The prediction with the disk at `disk_gbs`, a rate measured during the run (io/device.py),
    the profile's curve scaled (Profile.at_run_disk: the run's own I/O path in that rate, not
    again in read_busy and place_s): the model's error apart from the disk's drift since the
    profile. A plan that reads nothing: the plain prediction; no rate: None."""
    if not work.read_bytes:
        return predict(work, profile)
    return None if disk_gbs is None else predict(work, profile.at_run_disk(disk_gbs, work.read_size))

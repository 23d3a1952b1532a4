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

import mlx.nn as nn


@dataclass
class Work:
    """What one decode token does under a plan."""

    read_bytes: int  # from flash
    read_size: int  # bytes per read (contiguous streams coalesce up to the reader's max read)
    computed: dict  # weight form (profile.compute's keys: q4 a resident matrix, q4-rows an FFN's packed rows) -> bytes
    overlapped: bool  # reads run while the previous layer computes (prefetch)
    n_layers: int
    mode: str  # whose per-layer overhead applies
    matrix_elements: int = 0  # one FFN matrix's (d_model x d_ff): the size the compute rates are read at
    d_model: int = 0  # the width the per-layer overhead is read at
    kv_read_bytes: int = 0  # the KV cache on flash: keys and values read back per token
    kv_read_size: int = 0  # ... bytes per read
    converted_values: int = 0  # values the reader dequantizes / converts into float32 rows on the way
    placed_bytes: int = 0  # bytes read that the reader places into rows as they are (not converted)
    moved_bytes: int = 0  # memory management: bytes of rows a cache moves within itself per token
    hideable: dict | None = None  # the bytes (by form) whose compute the reads overlap (None: all of it)
    read_batches: int = 0  # batches of reads a token issues (one a layer and store that reads)
    positions: int = 1  # sequences a decode step advances (a batch's step): each weight read once for all


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


def resident_computed(model):
    """{form: bytes} of the resident matrices one token multiplies by (FFNs excluded)."""
    from ..models.ffn import FlashFFN
    from ..models.half import HalfEmbedding, HalfLinear
    from ..models.quantized import NativeQuantizedEmbedding, NativeQuantizedLinear, StreamedQuantizedLinear

    tied = not any(name.endswith("lm_head") for name, _ in model.named_modules())
    out = {}

    def add(form, nbytes):
        out[form] = out.get(form, 0) + nbytes

    def walk(m):
        if isinstance(m, FlashFFN):
            return
        if isinstance(m, StreamedQuantizedLinear):  # read from flash, then computed at its bits
            add(f"q{m.bits}", m.n_out * m.n_in * m.bits // 8 + 2 * m.n_out * (m.n_in // m.group_size) * 2)
            return
        quantized = isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, NativeQuantizedLinear,
                                   NativeQuantizedEmbedding))
        embedding = isinstance(m, (nn.Embedding, nn.QuantizedEmbedding, HalfEmbedding, NativeQuantizedEmbedding))
        if quantized or isinstance(m, (nn.Linear, HalfLinear)) or embedding:
            if embedding and not tied:
                return  # one row per token
            w = m.weight
            if quantized:
                add(f"q{m.bits}", w.nbytes + m.scales.nbytes + m.biases.nbytes)
            else:
                add(str(w.dtype).replace("mlx.core.", ""), w.nbytes)
            return
        for child in m.children().values():
            for c in (child if isinstance(child, list) else [child]):
                if isinstance(c, nn.Module):
                    walk(c)

    walk(model)
    return out


def converts(layout, packed):
    """Whether the reader converts the rows it reads into float32 on the way: a 16-bit or
    quantized layout read into float rows (not held at their bits: `packed`)."""
    return not packed and (layout.quant is not None or layout.dtype != "float32")


def exact_work(plan, layout, packed, resident, max_read, attention_read=(0, 0), kv_read=(0, 0, 0), bundled=True,
               positions=1):
    """Work of an exact plan (dense, naive, hybrid): every FFN row computed; the rows no cache
    holds read every token, as one contiguous stream per layer. packed: rows at their bits
    (form q<bits>-rows: the FFN's row kernels), else float32, and a float16-held cache's rows
    at float16 (form float16-rows: the kernels that read them in place, or float16's where the
    profile has no such rate); streamed float rows of a 16-bit or quantized layout are
    converted on the way.
    attention_read: (bytes, batches) of resident weights read from flash every token (streamed
    attention, a batch a layer; a streamed input embedding's row, a batch a tensor).
    kv_read: (bytes, bytes per read, batches) of the KV cache on flash read back per token (at
    the decode's mean context: an input, like the prompt; its batches are its chunks, several a
    layer at a long context). Each layer that reads issues one batch per store otherwise (FFN
    rows, attention), or unbundled (--unbundled), one a weight kind for its FFN rows. positions: a
    batch's decode step of that many sequences (the step's work; its reads are one token's)."""
    L, n = plan.n_layers, plan.n_neurons
    held = plan.layer_capacity(0) if plan.mode != "naive" else 0
    streamed = n - held
    values = len(layout.kinds) * layout.d_model
    computed = dict(resident)

    def add(form, nbytes):
        computed[form] = computed.get(form, 0) + nbytes

    if packed:  # (the FFN's row kernels: their own rate, models/ffn.py)
        add(f"q{layout.quant.bits}-rows", L * n * layout.bundle_bytes)
    else:  # held at float16: a decode step's rows through the native kernels (dense's, a hybrid cache's)
        form = "float16-rows" if plan.held_neuron_bytes else "float32"  # (held rows: the FFN's in-place kernels)
        add(form, L * held * values * (2 if plan.held_neuron_bytes else 4))
        add("float32", L * streamed * values * 4)
    ffn_read = L * streamed * layout.stride
    size = min(max_read, max(streamed * layout.stride, 1)) if ffn_read else max_read
    converted = L * streamed * values if converts(layout, packed) else 0
    kv_bytes, kv_size, kv_batches = kv_read
    batches = (L * (1 if bundled else len(layout.kinds)) if ffn_read else 0) + attention_read[1] + kv_batches
    # (rows converted on the way: their placing is in convert_ns, measured against reads thrown away too)
    placed = (0 if converted else ffn_read) + attention_read[0] + kv_bytes
    return Work(ffn_read + attention_read[0], size, computed,
                plan.prefetch, L, plan.mode, layout.d_model * n, layout.d_model, kv_bytes, kv_size,
                converted_values=converted, placed_bytes=placed, read_batches=batches, positions=positions)

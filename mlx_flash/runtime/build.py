"""The one place that turns a manifest + a FlashConfig into a model's runtime.

build_runtime(): the budget -> the plan, the sparsity source (by name from the
registry, or an object the benchmarks pass), the reader, the store; attaches
the store to every FlashFFN and the Runtime to `model.runtime`.

One file past 500 lines because it is the runtime's one assembly point: each store (neuron
caches, DIP, streamed attention and embeddings) is built here beside the accounting of the
memory it takes, which the plan that sizes it reads back.
"""

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

import mlx.core as mx

from ..errors import BudgetTooSmall, FlashError
from ..io import FlashReader
from ..layout.format import check_file, read_checksums, read_tables
from ..layout.quant import value_shapes
from ..models.ffn import layer_ffn
from ..sparsity import SourceContext, source_class
from .budget import Plan, budget_too_small, make_plan, parse_budget
from .config import FlashConfig, keep_quantized, packed_ffn_rows, staged_caches
from .stores.attention import buffer_shape
from .stores.embedding import check_streamable, input_embedding
from .stores.head import head_dram_bytes, output_head
from .stores.base import cpu_kernels, read_layer_file
from .work import exact_work, resident_computed

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class ResidentWeights:
    """What the loader put in DRAM outside the FFN: the bytes held (16-bit weights and
    their float32 arena included), the same weights at the compute dtype (what "50%"
    is of), and the model's parameters as --stats counts them."""

    held_bytes: int
    compute_bytes: int
    parameter_bytes: int
    quantized: bool = False  # a quantized model's, held at their bits
    extra_bytes: int = 0  # of the above, the store's scale tables and checksums (_with_extra)
    attention_bytes: int = 0  # of the above, the streamed attention's buffers (_with_streamed)
    embedding_bytes: int = 0  # of the above, the streamed embedding's buffers and checksums (_with_streamed)
    head_bytes: int = 0  # of the above, the streamed output head's buffers and checksums (_with_streamed)


@dataclass
class Runtime:
    """A loaded model's per-token runtime: `model.runtime`."""

    config: FlashConfig
    folder: Path
    manifest: object  # layout.format.Manifest
    compute_dtype: str
    resident_dtype: str  # what embeddings and attention are held at
    resident: ResidentWeights
    store: object  # stores.base.Store
    plan: Plan
    budget_bytes: int | None
    model_bytes: int  # the whole model at the compute dtype
    source: object = None  # the sparsity source (flash mode)
    sparsity: str | None = None
    density: float | None = None
    ffns: list = field(default_factory=list, repr=False)  # the FlashFFNs the store is attached to
    memory: object = None  # memory.MemoryPlan under --memory-limit (set by load())
    choice: object = None  # plan.choose.Choice: what --mode auto compared and chose
    resident_work: dict = None  # {weight form: bytes} a token multiplies by outside the FFN (cost.py)
    attention: object = None  # stores.attention.AttentionStore: the layers whose attention is streamed
    streamed: list = field(default_factory=list, repr=False)  # the streamed modules it serves (attention, embedding)
    kv: object = None  # stores.kv.FlashKV: the KV cache on flash last made (its reads join the prediction)
    batch: int = 1  # the sequences its --memory-limit plan decodes together (auto priced their decode step)
    embedding: object = None  # stores.embedding.EmbeddingStore: the input embedding read from flash
    head: object = None  # stores.head.HeadStore: the output head read from flash
    tied_embeddings: bool = False  # the input embedding is the output head too (held whole)
    # the planner (mlx_flash.plan, handed in by the loader: the runtime never imports it): its cost
    # model predicts this runtime's token, its chooser picks --mode auto's plan
    planner: object = None

    @property
    def mode(self):
        return self.config.mode

    def work(self, plan=None, packed=None, positions=1):
        """cost.Work of a decode token under `plan` (default this runtime's; an exact mode's), or
        of a batch's decode step of `positions` sequences, or None (flash mode: its reads depend
        on the sparsity, not on the plan alone)."""
        from ..io.reader import DEFAULT_MAX_READ

        plan = plan or self.plan
        if plan.mode == "flash" or self.resident_work is None:
            return None
        packed = bool(getattr(self.store, "packed", False)) if packed is None else packed
        return exact_work(plan, self.manifest.layout, packed, self.resident_work, DEFAULT_MAX_READ,
                          _streamed_read(self.attention, self.embedding, self.head),
                          kv_read=_kv_read(self.kv, DEFAULT_MAX_READ),
                          bundled=self.config.bundled, positions=positions)

    def predict(self, profile):
        """The cost model's prediction for this runtime's plan (None in flash mode, or with no
        planner handed in)."""
        work = self.work()
        return None if work is None or self.planner is None else self.planner.predict(work, profile)

    def stats(self, disk_gbs=None):
        """{"tokens": per-pass rows, "summary": ...}: the paper's Table 3 columns, the budget,
        the weights in DRAM, the peak RSS. What --stats, eval and the benchmarks show.
        disk_gbs: the rate the disk delivered during the decode (io/device.py), to predict at
        it too (the model's error apart from the disk's drift since the profile)."""
        from .memory import peak_rss

        store = self.store
        source = getattr(self.source, "resident_bytes", 0) or 0
        summary = {"mode": self.mode, "sparsity": self.sparsity, "density": self.density,
                   "memory_budget_bytes": self.budget_bytes, "model_bytes": self.model_bytes,
                   "resident_bytes": self.resident.parameter_bytes, "source_bytes": source,
                   "plan_weights_bytes": self.plan.weights_bytes,
                   "ffn_dram_bytes": store.weights_bytes,
                   "weights_in_dram_bytes": self.resident.parameter_bytes + source + store.weights_bytes,
                   "peak_rss_bytes": peak_rss()}
        if self.attention is not None:
            summary["streamed_attention"] = {"layers": list(self.attention.order),
                                             "bytes_per_token": self.attention.streamed_bytes,
                                             "buffer_bytes": self.attention.weights_bytes}
        if self.embedding is not None:
            summary["streamed_embedding"] = {"table_bytes": self.embedding.streamed_bytes,
                                             "row_bytes": self.embedding.span.row_bytes,
                                             "buffer_bytes": self.embedding.weights_bytes}
        if self.head is not None:
            summary["streamed_head"] = {"bytes_per_token": self.head.streamed_bytes,
                                        "buffer_bytes": self.head.weights_bytes}
        if self.memory is not None:
            summary["memory_limit"] = self.memory.as_dict()
        # (a cached profile: --stats never measures the machine)
        profile = self.planner.load_profile() if self.planner is not None else None
        try:
            prediction = self.predict(profile) if profile is not None else None
        except FlashError:  # (a profile without this weight form's rate: no prediction)
            prediction = None
        if prediction is not None:
            summary["predicted"] = prediction.as_dict()
            work = self.work()
            if disk_gbs is not None and work.read_bytes:
                at = self.planner.predict_at_disk_rate(work, profile, disk_gbs)
                summary["predicted_at_run_disk"] = at.as_dict() | {
                    "disk_gbs": disk_gbs, "profile_disk_gbs": profile.disk_gbs(work.read_size)}
        rows = []
        if store.stats is not None:
            store.stats.end()
            rows = store.stats.rows
            summary.update(store.stats.summary())
        return {"tokens": rows, "summary": summary}

    def rewind(self, n):
        """Speculative decoding: the last n positions of the last pass were rejected (their keys
        and values are trimmed). A store with a window forgets the neurons only they needed, so
        the window keeps the accepted prefix's (FlashStore.rewind); other stores keep nothing
        per position."""
        rewind = getattr(self.store, "rewind", None)
        if n > 0 and rewind is not None:
            rewind(n)

    def wrap_store(self, make):
        """Put `make(store)` (anything with rows(layer, x)) between the FFNs and the store: a
        probe that records what the rows compute, as calibration and the quality table do.
        Returns it; unwrap_store() puts the store back."""
        wrapper = make(self.store)
        for f in self.ffns:
            f.store = wrapper
        return wrapper

    def unwrap_store(self):
        for f in self.ffns:
            f.store = self.store

    def close(self):
        """Detach the store from the FFNs and close it (its reader, worker, caches); idempotent."""
        for f in self.ffns:
            f.store = None
        if self.store is not None:
            self.store.close()
        self.store = None
        for m in self.streamed:
            m.attach(None, None)
        if self.attention is not None:
            self.attention.close()
        self.attention = None
        if self.embedding is not None:
            self.embedding.close()
        self.embedding = None
        if self.head is not None:
            self.head.close()
        self.head = None
        if self.kv is not None:  # (the KV cache on flash last made: its reader and its file)
            self.kv.close()
        self.kv = None


def check_resident_fits(folder, manifest, config, streamed=()):
    """Refuse a budget the resident weights alone exceed, from the file's header, before
    reading them (else the process can be killed by a memory limit before the planner speaks).
    streamed: the layers whose attention stays on flash (attention_to_stream)."""
    if config.memory_budget is None or config.mode == "dense":  # dense says what it needs instead
        return
    resident, budget, spans, _ = _header_resident(folder, manifest, config, streamed)
    resident += _attention_buffers(spans, streamed, config.prefetch)
    if budget < resident:
        raise budget_too_small(budget, resident)
    if (config.mode in ("naive", "hybrid", "auto") and not config.sparse_options) or dip_flash(config, manifest):
        least = _least_ffn(manifest, config)  # (else found only once the weights have loaded)
        if budget < resident + least:
            reason = (f"the resident weights take {resident / 1e6:.1f} MB and "
                      f"{_least_ffn_what(config, manifest)} {least / 1e6:.1f} MB")
            raise BudgetTooSmall(f"memory budget {budget / 1e6:.0f} MB is too small: {reason}", budget,
                                 resident + least, reason)


def dense_need(folder, manifest, config, rows16=True):
    """What --mode dense would hold in DRAM (the resident weights, every FFN row as the plan
    holds it, a quantized layout's scale tables), from the headers before the weights load.
    rows16: its FFN rows may be held at float16 where the resident weights are not (--mode auto's
    variant of dense; an explicit --mode dense keeps them at the compute dtype)."""
    resident, _, _, _ = _header_resident(folder, manifest, config)
    dtype = compute_dtype(config, manifest)
    held_ffn = config.held_dtype(manifest.dtype, dtype) == "float16"
    # (auto compares dense with float16 rows too where the resident weights stay at float32)
    rows = {held_ffn, held_ffn or (rows16 and may_hold_float16(config, manifest))}
    dense = min(exact_plan("dense", manifest, config, DTYPES[dtype], ResidentWeights(resident, 0, 0), None,
                           r)[0].weights_bytes for r in rows)
    return dense + manifest.layout.table_bytes * len(manifest.ffn_files)


def _least_ffn(manifest, config):
    """The least DRAM the FFN takes: an exact plan's, naive's streaming buffers; flash mode's DIP
    store's, the scratch of one token's rows (calibrated thresholds: a whole layer's); beside them
    the scale tables (about their files' size) and the bundles' checksums."""
    from ..io import native_available

    lay, n = manifest.layout, len(manifest.ffn_files)
    checked = config.verify and native_available()  # (_checksums: held only where reads are checked)
    dtype = DTYPES[compute_dtype(config, manifest)]
    if dip_flash(config, manifest):
        inp, down = manifest.dip["input"]["layout"], manifest.dip["down"]["layout"]
        thresholds = getattr(source_class(config.sparsity), "needs", None) == "thresholds"
        d_in, b_in, d_out, b_out, k_in, k_out = _dip_dims(manifest, config, dtype, thresholds)[0]
        extra = (inp.table_bytes + lay.table_bytes) * n  # (the DIP down rows share the main down table)
        if checked:
            extra += n * (d_in * len(inp.kinds) + d_out * len(down.kinds)) * 4
        return extra + k_in * b_in + k_out * b_out
    extra = lay.table_bytes * n
    if checked:
        extra += n * lay.n_neurons * len(lay.kinds) * 4
    naive, _, _ = exact_plan("naive", manifest, config, dtype, ResidentWeights(0, 0, 0), None, False)
    return extra + naive.ffn_dram_bytes


def _least_ffn_what(config, manifest):
    """What _least_ffn counts, in words."""
    if dip_flash(config, manifest):
        return "the least FFN plan (the DIP store's scratch rows, the scale tables and checksums)"
    return "the least FFN plan (naive's two layer buffers, the scale tables and checksums)"


def dip_flash(config, manifest):
    """Flash mode (asked for, or --mode auto with sparsity options) whose source reads through the
    DIP store (dip, dip-ca, the calibrated sources), on a model with the DIP orientation on flash."""
    if not manifest.dip or not (config.mode == "flash" or (config.mode == "auto" and config.sparse_options)):
        return False
    return getattr(source_class(config.sparsity), "store", "flash") == "dip"


def _header_resident(folder, manifest, config, streamed=()):
    """From the resident file's header: (the bytes its weights will hold in DRAM, the budget in
    bytes, {layer: LayerSpan} of the blocks' quantized projections when held at their bits, the
    SafetensorsFile). Streamed layers' projections are not held."""
    dtype = compute_dtype(config, manifest)
    held = config.held_dtype(manifest.dtype, dtype)
    st, spans = _resident_spans(folder, manifest)
    itemsize = DTYPES[dtype].size
    held_size = itemsize if held is None else DTYPES[held].size
    # a quantized model's weights: their packed words (4 bytes each) when held at their bits
    # (their float16 scales then held so by the native kernels' modules: models/quantized.py),
    # else the values they dequantize to
    quantization = _quantization(folder)
    on_cpu = mx.default_device() == mx.cpu
    kept = keep_quantized(config, on_cpu)
    native = kept and on_cpu and cpu_kernels() is not None
    spans = spans if kept else {}
    table = _streamed_table(st, folder, config)  # (the input embedding, where it stays on flash)
    head = _streamed_head(st, folder, config)  # (the output head, where it stays on flash)
    gone = {n for i in streamed for n in spans[i].names} | (table.names if table is not None else set()) | (
        head.names if head is not None else set())
    shapes = value_shapes(st, {} if kept else quantization)
    resident = full = 0
    if table is not None:  # its read buffers and checksums
        resident += table.dram_bytes(_checked(config))
    if head is not None:  # its two chunk buffers and checksums
        resident += head_dram_bytes(head, _checked(config))
    if native:  # the kernels' float32 arena (models/quantized.py use_native_kernels)
        from ..models.quantized import arena_values

        words = [st.shape(n) for n in st.names() if n.endswith(".weight") and n[:-7] + ".scales" in st.tensors
                 and n not in gone]
        if words:
            bits = {q["bits"] for q in quantization.values() if isinstance(q, dict)} or {32}
            resident += 4 * arena_values([(s[0], s[1] * 32 // min(bits)) for s in words])
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        full += size * itemsize  # what "50%" is of
        if name in gone:
            continue
        if native and name.endswith((".scales", ".biases")) and st.dtype(name) == "F16":
            resident += size * 2
        else:
            resident += size * (held_size if len(shape) == 2 else itemsize)
    if held is not None:  # the float32 arena a prompt converts them into (models/half.py hold_at_16_bits)
        from ..models.half import ARENA_VALUES

        largest = max((int(np.prod(v)) for n, v in shapes.items() if n not in gone and len(v) == 2), default=0)
        resident += 4 * min(ARENA_VALUES, largest)
    budget = parse_budget(config.memory_budget, full + _ffn_bytes(manifest, itemsize))
    return resident, budget, spans, st


def _attention_buffers(spans, streamed, prefetch):
    """The streamed attention's buffers: two (one without prefetch) of its longest layer."""
    if not streamed:
        return 0
    n, chunk = buffer_shape(max(spans[i].nbytes for i in streamed))
    return (2 if prefetch else 1) * n * chunk


def _may_stream(config, manifest):
    """May some layers' attention stay on flash (attention_to_stream) under this config?"""
    # (held at their bits: by default where the kernels run, as keep_quantized says)
    # (flash mode through the DIP store too: its least FFN is its scratch, _least_ffn)
    return ((config.mode in ("auto", "naive", "hybrid") or dip_flash(config, manifest))
            and manifest.layout.quant is not None and config.resident_dtype in (None, "quantized")
            and cpu_kernels() is not None)


def loaded_resident_bytes(folder, manifest, config):
    """The least of the resident file a load reads into memory: all of it, less every layer's
    attention where it may stay on flash, and an untied input embedding table where it may (the
    check before loading under --memory-limit)."""
    check_file(folder, manifest.resident, checksum=False)
    size = manifest.resident["size"]
    st, spans = _resident_spans(folder, manifest)
    if _may_stream(config, manifest):
        size -= sum(s.nbytes for s in spans.values())
    budgeted = config.memory_budget is not None or config.memory_limit is not None
    if config.stream_embeddings == "on" or (config.stream_embeddings == "auto" and budgeted):
        table, tied = input_embedding(st, _quantization(folder))
        if table is not None and not tied:
            size -= table.nbytes
    if _may_stream(config, manifest) and (config.stream_head == "on" or (config.stream_head == "auto" and budgeted)):
        head = output_head(st, _quantization(folder))
        if head is not None:
            size -= head.nbytes
    return size


def _checked(config):
    """Are the streamed weights' reads checked (and their checksums held)?"""
    from ..io import native_available

    return config.verify and native_available()


def _streamed_table(st, folder, config):
    """The input embedding's TableSpan where the config leaves it on flash (stream_embeddings
    "on": refused for a table tied to the output head, or one the store cannot read), else None."""
    if config.stream_embeddings != "on":
        return None
    table, tied = input_embedding(st, _quantization(folder))
    check_streamable(table, tied, folder)
    return table


def _streamed_head(st, folder, config):
    """The output head's TableSpan where the config leaves it on flash (stream_head "on": refused
    for a head that cannot be: tied, not quantized, with a bias, or without the native kernels),
    else None."""
    if config.stream_head != "on":
        return None
    head = output_head(st, _quantization(folder))
    if head is None:
        raise FlashError(f"--stream-head on: {folder}'s output head cannot be read from flash (the kernels "
                         "multiply an untied, quantized lm_head without a bias, held at its bits)")
    if cpu_kernels() is None or config.resident_dtype not in (None, "quantized"):
        raise FlashError("--stream-head on: the output head read from flash is multiplied by the native kernels "
                         "on the CPU, at its bits (not built, MLX computes elsewhere, or --resident-dtype "
                         f"{config.resident_dtype})")
    return head


def head_on_flash(folder, manifest, config):
    """The output head's TableSpan where the config leaves it on flash, else None (the loader
    then loads it with the other resident weights)."""
    if config.stream_head != "on":
        return None
    return _streamed_head(_resident_spans(folder, manifest)[0], folder, config)


def head_may_stream(folder, manifest, config):
    """May --stream-head auto leave the output head on flash under this config (a budget, an
    exact streaming mode of a quantized model held at its bits, the kernels, a head they read)?"""
    if config.stream_head != "auto" or config.memory_budget is None or manifest.experts:
        return False
    if not _may_stream(config, manifest):
        return False
    return output_head(_resident_spans(folder, manifest)[0], _quantization(folder)) is not None


def embedding_on_flash(folder, manifest, config):
    """The input embedding's TableSpan where the config leaves it on flash, else None (the loader
    then loads every other tensor)."""
    if config.stream_embeddings != "on":
        return None
    return _streamed_table(_resident_spans(folder, manifest)[0], folder, config)


def embedding_to_stream(folder, manifest, config):
    """Does the input embedding table stay on flash (a pass reads its tokens' rows: models/
    quantized.py StreamedEmbedding)? Decided from the resident file's header before the weights
    load. stream_embeddings "on": yes (refused for a table tied to the output head, which
    multiplies by every row each token, so it stays whole); "off": no; "auto": under a budget,
    for an untied table, where holding it costs the run something: with --mode naive where the
    resident weights leave the least FFN plan too little, with --mode dense where the model fits
    only with it on flash, in the other modes where the whole model (dense) does not fit with it
    held (its bytes then hold FFN rows). It is the first weight left
    on flash: one small read a token (a row of each of its tensors), where a layer's attention
    is megabytes."""
    if config.stream_embeddings != "auto":
        embedding_on_flash(folder, manifest, config)  # ("on": refused here where it cannot be)
        return config.stream_embeddings == "on"
    if config.memory_budget is None or manifest.experts:
        return False
    table, tied = input_embedding(_resident_spans(folder, manifest)[0], _quantization(folder))
    if table is None or tied or table.dram_bytes(_checked(config)) >= table.nbytes:  # (a tiny table: held)
        return False
    held = replace(config, stream_embeddings="off")
    resident, budget, _, _ = _header_resident(folder, manifest, held)
    if config.mode == "naive":  # (its FFN holds two layers' rows whatever the budget)
        return resident + _least_ffn(manifest, held) > budget
    need = dense_need(folder, manifest, held, rows16=config.mode == "auto")
    if config.mode == "dense":  # (only where it lets dense fit: else the refusal stands either way)
        return budget < need <= budget + table.nbytes - table.dram_bytes(_checked(config))
    return need > budget


def _quantization(folder):
    """config.json's `quantization` (mlx-lm's form: one entry per quantized module), or {}."""
    return json.loads((Path(folder) / "config.json").read_text()).get("quantization") or {}


def _resident_spans(folder, manifest):
    """(the resident SafetensorsFile, {layer: LayerSpan} of its blocks' quantized projections)."""
    from ..layout.safetensors_io import SafetensorsFile
    from .stores.attention import layer_spans

    st = SafetensorsFile(Path(folder) / manifest.resident["file"])
    return st, layer_spans(st, _quantization(folder))


def attention_to_stream(folder, manifest, config):
    """The layers whose attention a quantized model leaves on flash (read every token, models/
    quantized.py StreamedQuantizedLinear), decided from the resident file's header before the
    weights load: none unless the resident weights, beside the least an exact mode needs for
    the FFN (naive's streaming buffers) and the FFN's scale tables and checksums, exceed the
    budget; then the fewest that make them fit. Only for the exact streaming modes (naive,
    hybrid, auto), a quantized model held at its bits, on the CPU with the native kernels.
    -> {layer: stores.attention.LayerSpan} ({}: none)."""
    if config.memory_budget is None or not _may_stream(config, manifest):
        return {}
    resident, budget, spans, st = _header_resident(folder, manifest, config)
    if not spans:
        return {}
    least_ffn = _least_ffn(manifest, config)
    deficit = resident + least_ffn - budget
    if deficit <= 0:
        return {}
    from .stores.attention import layers_to_stream

    layers = layers_to_stream({i: s.nbytes for i, s in spans.items()}, deficit, config.prefetch)
    if layers is None:  # not even streaming every layer's attention makes naive fit
        least = resident - sum(s.nbytes for s in spans.values()) + _attention_buffers(spans, list(spans),
                                                                                      config.prefetch)
        need = least + least_ffn
        on_flash = ["every layer's attention"] + (["the input embeddings"] if config.stream_embeddings == "on"
                                                  else []) + (["the output head"] if config.stream_head == "on" else [])
        kept = [k for k, gone in (("embeddings", config.stream_embeddings == "on"),
                                  ("the output head", config.stream_head == "on")) if not gone] + ["norms"]
        held = (f"{', '.join(on_flash[:-1])} and {on_flash[-1]}" if len(on_flash) > 1 else on_flash[0]) + (
            f" read from flash, the resident weights ({', '.join(kept)}")
        reason = (f"even with {held}, two attention buffers) take {least / 1e6:.0f} MB and "
                  f"{_least_ffn_what(config, manifest)} {least_ffn / 1e6:.0f} MB")
        raise BudgetTooSmall(f"memory budget {budget / 1e6:.0f} MB is too small: {reason}", budget, need, reason)
    return {i: spans[i] for i in layers}


def compute_dtype(config, manifest):
    return config.compute_dtype(manifest.dtype, on_cpu=mx.default_device() == mx.cpu)


def may_hold_float16(config, manifest):
    """A float16 model (not a quantized one: its manifest's dtype is its scales') computed in
    float32, whose held dtype the user left open: --mode auto may hold its weights at float16
    as stored (converted before use: exact)."""
    return (config.resident_dtype is None and manifest.dtype == "float16" and manifest.layout.quant is None
            and compute_dtype(config, manifest) == "float32")


def _ffn_bytes(manifest, itemsize):
    lay = manifest.layout
    return len(lay.kinds) * lay.d_model * lay.n_neurons * len(manifest.ffn_files) * itemsize


def _kv_read(kv, max_read):
    """(bytes, bytes per read, chunks) the KV cache on flash reads back per decode token, on
    average so far ((0, 0, 0): none; a chunk is one batch, read in pieces of the reader's max
    read: a 7B's layer at 2048 positions is 16 chunks)."""
    if kv is None:
        return 0, 0, 0
    nbytes, size = kv.decode_read()
    return nbytes, min(size, max_read), round(nbytes / size) if size else 0


# long: the one assembly point, read top to bottom: each store built beside the accounting of its memory
def build_runtime(model, folder, manifest, config, resident, source=None, progress=False, batch=1, planner=None):
    """-> Runtime, also set as `model.runtime`, its store attached to every FlashFFN.

    source: a sparsity source object for the flash mode instead of config.sparsity's
    (the paper benchmark's traces). batch: the sequences a --memory-limit plan decodes
    together (its MemoryPlan's): --mode auto compares the plans by their decode step.
    planner: mlx_flash.plan (the runtime does not import the planner; the loader hands it in):
    --mode auto's chooser (choose_exact) and the cost model the Runtime's predictions use."""
    from .config import DEFAULTS_BY_NAME

    for name in ("expert_eviction", "expert_predictor"):
        if getattr(config, name) != DEFAULTS_BY_NAME[name]:
            raise FlashError(f"--{name.replace('_', '-')} {getattr(config, name)}: {folder} has no experts (a "
                             "mixture-of-experts model's option)")
    dtype_name = compute_dtype(config, manifest)
    dtype = DTYPES[dtype_name]
    held = config.held_dtype(manifest.dtype, dtype_name)
    # dense / hybrid hold their resident FFN rows at float16 too (NumPy has no bfloat16: a
    # bfloat16 model's FFN rows stay at the compute dtype)
    held_ffn = held == "float16"
    lay, n_layers = manifest.layout, len(manifest.ffn_files)
    # "50%" is of the model at the compute dtype, however its resident part is held
    model_bytes = resident.compute_bytes + _neuron_bytes(lay, dtype, False, False) * lay.n_neurons * n_layers
    budget = parse_budget(config.memory_budget, model_bytes)
    ffns = [layer_ffn(layer) for layer in model.layers]
    name, density = None, None
    # a quantized layout's column scales, per layer: in DRAM with the resident weights
    tables = read_tables(folder, manifest, lay, config.verify)
    # the FFN files' part checksums, read once (--mode auto's plans and the store count them)
    ffn_crcs = functools.cache(lambda: _checksums(folder, manifest, config, "ffn"))
    choice = None
    resident_work = resident_computed(model)
    arena = _resident_arena(model)
    attention, streamed = _attention_store(model, folder, manifest, config, arena)
    resident = _with_streamed(resident, "attention_bytes", attention)
    embedding = _embedding_store(model, folder, manifest, config, dtype, resident, streamed)
    resident = _with_streamed(resident, "embedding_bytes", embedding)
    head = _head_store(model, folder, manifest, config, streamed)
    resident = _with_streamed(resident, "head_bytes", head)
    if config.mode == "auto":
        if planner is None:
            raise FlashError("--mode auto: build_runtime needs the planner (load() passes mlx_flash.plan)")
        rows16 = not held_ffn and may_hold_float16(config, manifest)
        plan_of = _auto_plan_of(manifest, config, dtype, resident, budget, held_ffn, tables, ffn_crcs)
        choice = planner.choose_exact(config, budget, plan_of, rows16, lay, resident_work,
                                      _streamed_read(attention, embedding, head), batch)
        config = replace(config, mode=choice.mode)
        held_ffn = held_ffn or choice.rows16
    if config.mode == "dense":
        resident = _with_extra(resident, tables)
        plan, packed, _ = exact_plan("dense", manifest, config, dtype, resident, budget, held_ffn)
        store = _dense_store(folder, manifest, dtype, config.verify, progress, held_ffn, tables, packed)
    else:
        if config.verify:
            for e in manifest.ffn_files:
                check_file(folder, e, checksum=False)
        if config.mode == "flash":
            name, density = config.sparsity, config.density
            if source is None:
                source = _make_source(folder, manifest, config, dtype, ffns, tables)
            else:
                name = getattr(source, "name", "custom")
        if getattr(source, "store", "flash") == "dip":
            inp = manifest.dip["input"]["layout"]
            # the DIP down rows share the main layout's down table (the same tensor)
            dip_tables = [i | d for i, d in zip(read_tables(folder, manifest, inp, config.verify), tables)]
            crcs = _checksums(folder, manifest, config, "dip")
            resident = _with_extra(resident, dip_tables, crcs)
            plan, store = _dip_store(folder, manifest, config, dtype, resident, budget, ffns, source,
                                     dip_tables, crcs)
        else:
            crcs = ffn_crcs()
            resident = _with_extra(resident, tables, crcs)
            plan, store = _neuron_store(folder, manifest, config, dtype, resident, budget, source,
                                        held_ffn, tables, crcs, hold_most=choice is not None)
    for f in ffns:
        f.store = store
        f.arena = arena  # (a prompt's packed rows dequantized into it: no new pages a chunk)
    if attention is not None:
        attention.stats = store.stats  # (its waits and bytes join the FFN's rows)
    if embedding is not None:
        embedding.stats = getattr(store, "stats", None)  # (its reads join the next pass's row)
    if head is not None:
        head.stats = store.stats  # (its waits and bytes join the FFN's rows)
    resident_dtype = "quantized" if resident.quantized else held or dtype_name
    runtime = Runtime(config, Path(folder), manifest, dtype_name, resident_dtype, resident, store, plan,
                      budget, model_bytes, source, name, density, ffns, choice=choice, resident_work=resident_work,
                      attention=attention, streamed=streamed, batch=batch, embedding=embedding, head=head,
                      tied_embeddings=not any(n.endswith("lm_head") for n, _ in model.named_modules()),
                      planner=planner)
    model.runtime = runtime
    return runtime


def _auto_plan_of(manifest, config, dtype, resident, budget, held_ffn, tables, ffn_crcs):
    """--mode auto: a candidate (plan/choose.py's Candidate) -> (its Plan, whether its rows are
    packed, ...) as exact_plan says, with what that plan holds beside the resident weights."""
    def plan_of(c):
        extra = (tables,) if c.mode == "dense" else (tables, ffn_crcs())
        return exact_plan(c.mode, manifest, config, dtype, _with_extra(resident, *extra), budget,
                          held_ffn or c.rows16, hold_most=True)
    return plan_of


def _resident_arena(model):
    """The float32 arena the quantized resident modules share (models/quantized.py), or None."""
    from ..models.quantized import native_modules

    native = native_modules(model)
    return native[0]._arena if native else None


def _attention_store(model, folder, manifest, config, arena=None):
    """(the AttentionStore of a model whose loader left some layers' attention on flash
    (attention_to_stream), the modules it is attached to); (None, []) when it left none.
    arena: the resident modules' (_resident_arena), else one of its own."""
    from ..models.quantized import streamed_modules
    from .stores.attention import AttentionStore

    modules = streamed_modules(model)
    if not modules:
        return None, []
    kernels = cpu_kernels()
    if kernels is None:
        raise FlashError("streamed attention is computed by the native kernels on the CPU (not built, or "
                         "MLX computes elsewhere)")
    st, spans = _resident_spans(folder, manifest)
    reader = FlashReader(threads=config.threads, direct=True)
    store = AttentionStore(st.path, {i: spans[i] for i in modules}, reader, kernels, verify=config.verify,
                           prefetch=config.prefetch)
    if arena is None:
        from ..models.half import Arena

        arena = Arena()
    flat = [m for layer in modules.values() for m in layer.values()]
    for m in flat:
        m.attach(store, arena)
    return store, flat


def _with_streamed(resident, field, store):
    """The resident weights plus a streamed part's buffers and checksums (`store`: the streamed
    attention's or embedding's, or None; `field`: its ResidentWeights count, replacing a rebuilt
    runtime's)."""
    nbytes = store.weights_bytes if store is not None else 0
    d = nbytes - getattr(resident, field)
    return replace(resident, held_bytes=resident.held_bytes + d, parameter_bytes=resident.parameter_bytes + d,
                   **{field: nbytes})


def _streamed_read(attention, embedding, head=None):
    """(bytes, batches) of resident weights read from flash every token: the streamed attention's
    layers, a batch each, the input embedding's row, a batch of each of its tensors, and the output
    head, a batch of each tensor a chunk ((0, 0): none)."""
    att = (attention.streamed_bytes, len(attention.spans)) if attention is not None else (0, 0)
    emb = (embedding.span.row_bytes, len(embedding.span.parts)) if embedding is not None else (0, 0)
    out = (head.streamed_bytes, len(head.starts) * len(head.span.parts)) if head is not None else (0, 0)
    return att[0] + emb[0] + out[0], att[1] + emb[1] + out[1]


def _head_store(model, folder, manifest, config, streamed):
    """The HeadStore of a model whose loader left its output head on flash (head_on_flash),
    attached to its StreamedHead (added to `streamed`), or None."""
    from ..models.quantized import streamed_head
    from .stores.head import HeadStore

    module = streamed_head(model)
    if module is None:
        return None
    span = head_on_flash(folder, manifest, config)
    st, _ = _resident_spans(folder, manifest)
    store = HeadStore(st.path, span, FlashReader(threads=config.threads, direct=True), cpu_kernels(),
                      verify=config.verify)
    module.attach(store)
    streamed.append(module)
    return store


def _embedding_store(model, folder, manifest, config, dtype, resident, streamed):
    """The EmbeddingStore of a model whose loader left its input embedding on flash
    (embedding_to_stream), attached to its StreamedEmbedding (added to `streamed`), or None. The rows are dequantized as
    the held table would be: scales widened to float32 where the native kernels would hold it
    (a quantized model held at its bits on the CPU), else at the compute dtype."""
    from ..models.quantized import streamed_embedding
    from .stores.embedding import EmbeddingStore

    module = streamed_embedding(model)
    if module is None:
        return None
    st, _ = _resident_spans(folder, manifest)
    table, tied = input_embedding(st, _quantization(folder))
    check_streamable(table, tied, folder)
    native = resident.quantized and cpu_kernels() is not None
    reader = FlashReader(threads=EMBEDDING_READ_THREADS, direct=True)
    store = EmbeddingStore(st.path, table, reader, dtype, mx.float32 if native else dtype, verify=config.verify)
    module.attach(store)
    streamed.append(module)
    return store


EMBEDDING_READ_THREADS = 4  # a decode token reads one row of each tensor; a prompt chunk at most a few hundred


def rebuild_runtime(model, config, source=None):
    """Close `model.runtime`'s store and build another for `config` on the same weights
    (the paper benchmark runs many configurations on one loaded model)."""
    old = model.runtime
    old.close()
    runtime = build_runtime(model, old.folder, old.manifest, config, old.resident, source=source,
                            planner=old.planner)
    runtime.memory = old.memory if config.memory_budget == old.config.memory_budget else None
    return runtime


def _checksums(folder, manifest, config, part):
    """The part checksums of the files of bundles a store reads ("ffn": per layer; "dip": per
    layer (input, down)), which it checks on every read; None with --no-verify or for a
    version 1 folder (which says so once)."""
    n = len(manifest.ffn_files)
    if not config.verify:
        return None
    from ..io import native_available
    from ..io.files import log_once

    if not native_available():  # NumPy's CRC32C takes seconds per token: say so, read unchecked
        log_once("crc-native", "FlashReader: checking reads needs the native extension (not built); "
                 "reads of %s are not checked", folder)
        return None
    if part == "ffn":
        out = [read_checksums(folder, e, manifest.layout) for e in manifest.ffn_files]
    else:
        inp, down = manifest.dip["input"], manifest.dip["down"]
        out = [(read_checksums(folder, i, inp["layout"]), read_checksums(folder, d, down["layout"]))
               for i, d in zip(inp["files"], down["files"])]
    if n and manifest.ffn_files[0].get("crc32c") is None:
        log_once(("unchecked", str(folder)), "%s: a flash layout of version %d has no bundle checksums: "
                 "its reads are not checked (convert it again to have them)", folder, manifest.version)
        return None
    return out


def _with_extra(resident, *arrays):
    """The resident weights plus what a store keeps beside its rows: a quantized layout's
    scale tables, the bundle checksums (nested lists / dicts / tuples of arrays)."""
    def nbytes(x):
        if x is None:
            return 0
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, (list, tuple)):
            return sum(nbytes(v) for v in x)
        return x.nbytes

    extra = nbytes(list(arrays))
    base = resident.extra_bytes  # a rebuilt runtime's: replaced, not added again
    return replace(resident, held_bytes=resident.held_bytes - base + extra,
                   compute_bytes=resident.compute_bytes - base + extra,
                   parameter_bytes=resident.parameter_bytes - base + extra, extra_bytes=extra)


def _dense_store(folder, manifest, dtype, verify, progress, held, tables, packed):
    from tqdm import tqdm

    from .stores.dense import DenseStore

    bar = tqdm(total=len(manifest.ffn_files), desc="load ffn", disable=not progress, leave=False)
    store = DenseStore(folder, manifest, dtype, verify=verify, progress=bar, held=held, tables=tables,
                       packed=packed)
    bar.close()
    return store


def _make_source(folder, manifest, config, dtype, ffns, tables):
    cls = source_class(config.sparsity)
    lay = manifest.layout

    def layer_weights(kinds):
        out = []
        for layer, e in enumerate(manifest.ffn_files):
            rows = read_layer_file(folder, e, lay, config.verify, tables[layer] if tables else None)
            out.append({k: mx.array(rows[k]).astype(dtype) for k in kinds})
            mx.eval(list(out[-1].values()))
        return out

    ctx = SourceContext(folder, manifest, config.density, dtype, ffns[0]._act, ffns[0].gated,
                        "up_bias" in ffns[0], [f.up_bias if "up_bias" in f else None for f in ffns],
                        layer_weights, gate_bias=[f.gate_bias if "gate_bias" in f else None for f in ffns],
                        recovery=config.recovery, verify=config.verify)
    cls.check(ctx)
    return cls.build(ctx)


def exact_plan(mode, manifest, config, dtype, resident, budget, held_ffn, hold_most=False):
    """-> (Plan, packed, staged) of an exact mode (dense, naive, hybrid): what build_runtime
    builds, and what --mode auto compares (raises BudgetTooSmall where the mode does not fit).
    held_ffn: a float16 model held at float16 (dense and hybrid hold their rows so).
    hold_most: hybrid holds as many neurons as the budget allows, not at most half (auto)."""
    lay = manifest.layout
    held = held_ffn and mode in ("dense", "hybrid")
    staged = mode != "dense" and _staged(config, held, dtype)
    packed = not staged and packed_ffn_rows(config, lay.quant is not None, dtype == mx.float32, held,
                                            cpu_kernels() is not None, mode=mode)
    neuron_bytes = _neuron_bytes(lay, dtype, packed, staged)
    plan = make_plan(mode, budget, resident.held_bytes, 0, neuron_bytes, len(manifest.ffn_files), lay.n_neurons,
                     held_neuron_bytes=neuron_bytes // 2 if held else 0,
                     prefetch=config.prefetch and mode != "dense", hold_most=hold_most,
                     align=lay.quant.group_size if packed else 1)
    return plan, packed, staged


def _neuron_store(folder, manifest, config, dtype, resident, budget, source, held_ffn, tables, crcs,
                  hold_most=False):
    from .stores.flash import FlashStore
    from .stores.streamed import StreamedStore

    lay, mode, window = manifest.layout, config.mode, config.window
    if mode != "flash":
        plan, packed, staged = exact_plan(mode, manifest, config, dtype, resident, budget, held_ffn, hold_most)
        reader = FlashReader(threads=config.threads, direct=True)
        store = StreamedStore(folder, manifest, plan, reader, dtype, bundled=config.bundled, tables=tables,
                              crcs=crcs, packed=packed, staged=staged)
        return plan, store
    req = manifest.calibration.get("req")
    if req:  # per-layer capacity from calibration: Req_i at this window
        k = min(8 if window is None else max(window, 1), max(req["windows"]))
        req = ([r[req["windows"].index(k)] for r in req["per_layer"]],
               max(r[0] for r in req["per_layer"]))  # Req_i(k), and the most one token needs
    else:
        req = None
    staged = _staged(config, False, dtype)
    packed = not staged and packed_ffn_rows(config, lay.quant is not None, dtype == mx.float32, False,
                                            cpu_kernels() is not None)
    plan = make_plan(mode, budget, resident.held_bytes, source.resident_bytes if source else 0,
                     _neuron_bytes(lay, dtype, packed, staged), len(manifest.ffn_files), lay.n_neurons,
                     window=10**9 if window is None else window, req=req, prefetch=config.prefetch)
    reader = FlashReader(threads=config.threads, direct=True)
    store = FlashStore(folder, manifest, plan, source, reader, dtype, bundled=config.bundled,
                       overlap=config.overlaps, tables=tables, crcs=crcs, packed=packed, staged=staged)
    return plan, store


def _neuron_bytes(lay, dtype, packed, staged):
    """What a neuron's rows cost in a cache: its bundle's bytes when they stay packed, else its
    values at the compute dtype (twice when staged: its rows on the device and their host
    staging copy)."""
    if packed:
        return sum(lay.kind_bytes(k) for k in lay.kinds)
    return len(lay.kinds) * lay.d_model * dtype.size * (2 if staged else 1)


def _staged(config, held, dtype):
    """Staged caches (config.staged_caches), with what they cannot do refused."""
    staged = staged_caches(config, mx.default_device() == mx.cpu)
    if staged and (held or config.ffn_rows == "quantized"):
        raise FlashError("staged cache writes hold the rows at the compute dtype: not with float16-held "
                         "rows (--resident-dtype float16) or --ffn-rows quantized")
    if staged and dtype == mx.bfloat16:  # the staging rows are NumPy's, which has no bfloat16
        raise FlashError("staged caches of bfloat16 rows are not supported yet: compute at float16 or float32 "
                         "(--dtype)")
    return staged


def _dip_store(folder, manifest, config, dtype, resident, budget, ffns, source, tables, crcs):
    from .stores.dip import DIPStore

    density = config.density
    thresholds = getattr(source, "thresholds", None)
    dims, packed, staged = _dip_dims(manifest, config, dtype, thresholds is not None)
    lay = manifest.layout
    plan = make_plan("flash", budget, resident.held_bytes, source.resident_bytes, len(lay.kinds) * lay.d_model * dtype.size,
                     len(manifest.ffn_files), lay.n_neurons, dip=dims)
    reader = FlashReader(threads=config.threads, direct=True)
    store = DIPStore(folder, manifest, plan, reader, ffns[0]._act, density,
                     cache_aware=source.cache_aware, dtype=dtype, gamma=config.gamma,
                     eviction=config.eviction, tables=tables, crcs=crcs, thresholds=thresholds, packed=packed,
                     score_norms=getattr(source, "score_norms", None),
                     adapters=getattr(source, "adapters", None), staged=staged)
    return plan, store


def _dip_dims(manifest, config, dtype, thresholds):
    """The DIP store's plan dimensions (input dims, their row bytes, neurons, their down rows'
    bytes, the scratch's input dims and down rows), whether its rows stay packed, whether staged.
    thresholds: a calibrated source's, with which a token may need any share of a layer (the
    scratch then holds all of one)."""
    inp, down = manifest.dip["input"]["layout"], manifest.dip["down"]["layout"]
    density = config.density
    k_in, k_out = max(1, round(density * inp.n_neurons)), max(1, round(density * down.n_neurons))
    if thresholds:
        k_in, k_out = inp.n_neurons, down.n_neurons
    staged = _staged(config, False, dtype)
    packed = not staged and packed_ffn_rows(config, inp.quant is not None and down.quant is not None,
                                            dtype == mx.float32, False, cpu_kernels() is not None, dip=True)

    def row_bytes(lay):  # at their bits when packed, else at the compute dtype (twice when staged)
        return sum(lay.kind_bytes(k) if packed else lay.d_model * dtype.size * (1 + staged) for k in lay.kinds)

    return (inp.n_neurons, row_bytes(inp), down.n_neurons, row_bytes(down), k_in, k_out), packed, staged

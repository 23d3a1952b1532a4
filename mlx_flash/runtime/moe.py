"""A mixture-of-experts model's runtime: the expert buffer sized from the budget,
the store that fills it, attached to every layer's ExpertFFN.

Modes: `dense` holds every expert (read once at load); `auto` is dense without a budget, and
under `--memory-budget` an expert buffer of as many slots as the budget leaves after the
resident weights (router, attention, embeddings, shared experts), the routed experts read
as they are asked for, evicted by `--expert-eviction` (EdgeMoE's score by default). The
neuron modes (naive, hybrid, flash) and sparsity sources do not apply to experts: refused.
"""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BudgetTooSmall, FlashError
from ..io import FlashReader
from ..io.reader import DEFAULT_MAX_READ
from ..layout.experts import KINDS, expert_bits
from .budget import parse_budget
from .build import DTYPES, compute_dtype
from .stores.experts import NARROW_STAGING, ExpertStore


@dataclass
class MoERuntime:
    """`model.runtime` of a mixture-of-experts model."""

    config: object  # FlashConfig
    folder: Path
    manifest: object
    compute_dtype: str
    resident_bytes: int
    store: ExpertStore
    mode: str  # dense | experts
    budget_bytes: int | None
    model_bytes: int
    ffns: list = field(default_factory=list, repr=False)
    resident_dtype: str = ""  # what the router, attention and embeddings are held at
    memory: object = None  # memory.MemoryPlan under --memory-limit (set by load())
    read_buffer_bytes: int = 0  # the expert reader's buffers (not in --memory-budget; in --memory-limit)

    def stats(self, disk_gbs=None):
        """{"tokens": [], "summary": ...}: the expert buffer's use, per layer and in all.
        (disk_gbs: as Runtime.stats takes it; no cost model knows experts yet)"""
        from .memory import peak_rss

        s = self.store
        summary = {"mode": self.mode, "memory_budget_bytes": self.budget_bytes, "model_bytes": self.model_bytes,
                   "resident_bytes": self.resident_bytes, "expert_slots": s.slots,
                   "experts_total": len(s.layers) * s.layout.n_experts, "expert_bytes": s.layout.bundle_bytes,
                   "ffn_dram_bytes": s.weights_bytes, "eviction": self.config.expert_eviction,
                   "read_buffer_bytes": self.read_buffer_bytes, "read_threads": s.reader.threads,
                   "weights_in_dram_bytes": self.resident_bytes + s.weights_bytes, "peak_rss_bytes": peak_rss()}
        summary.update(s.stats.summary())
        if self.memory is not None:
            summary["memory_limit"] = self.memory.as_dict()
        return {"tokens": [], "summary": summary}

    def close(self):
        for f in self.ffns:
            f.store = None
        if self.store is not None:
            self.store.close()
            self.store.reader.close()
        self.store = None


def check_moe_config(config):
    """What a MoE model's runtime cannot do, said before anything loads."""
    if config.mode not in ("auto", "dense"):
        raise FlashError(f"--mode {config.mode}: a mixture-of-experts model runs dense (every expert in DRAM) or, "
                         "under --memory-budget, with an expert buffer (--mode auto); the neuron modes do not apply")
    if config.sparse_options:
        raise FlashError("sparsity options (--sparsity, --density, ...) choose neurons; a mixture-of-experts "
                         "model's router chooses its experts: drop them")
    if config.kv_cache == "flash" or config.batch_size > 1:
        raise FlashError("a mixture-of-experts model keeps one sequence's KV cache in DRAM (--kv-cache flash and "
                         "batches under --memory-limit are not written for experts yet)")
    if config.stream_embeddings == "on":
        raise FlashError("--stream-embeddings on: a mixture-of-experts model holds its input embeddings in DRAM "
                         "(reading them from flash is not written for experts yet)")
    if config.stream_head == "on":
        raise FlashError("--stream-head on: a mixture-of-experts model holds its output head in DRAM (reading it "
                         "from flash is not written for experts yet)")
    if config.mode == "dense" and (config.memory_budget is not None or config.memory_limit is not None):
        given = "--memory-budget" if config.memory_budget is not None else "--memory-limit"
        raise FlashError(f"--mode dense holds every expert: {given} does not apply (use --mode auto)")


def build_moe_runtime(model, folder, manifest, config, resident_bytes, resident_dtype):
    """-> MoERuntime (config checked by check_moe_config before the model loaded; resident_dtype:
    what the loader holds the router, attention and embeddings at, for --stats)."""
    lay = manifest.experts["layout"]
    total = sum(e is not None for e in manifest.experts["files"]) * lay.n_experts
    dtype_name = compute_dtype(config, manifest)
    dtype = DTYPES[dtype_name]
    slot = slot_bytes(lay, dtype)
    model_bytes = resident_bytes + total * slot
    budget = parse_budget(config.memory_budget, model_bytes)
    top_k = model.args.num_experts_per_tok
    threads, staging = read_buffers(lay, config.threads, expert_bits(manifest.experts) is not None)
    if budget is None:
        slots, mode = total, "dense"
    else:
        slots, mode = min(total, max(0, (budget - resident_bytes) // slot)), "experts"
        if slots < top_k:
            need = resident_bytes + top_k * slot
            reason = (f"the resident weights ({_mb(resident_bytes)}) and one token's {top_k} experts of a layer "
                      f"({top_k} x {_mb(slot)}) need at least {_mb(need)}")
            raise BudgetTooSmall(f"memory budget {_mb(budget)} is too small: {reason}", budget, need, reason)
        if slots == total:
            mode = "dense"
    reader = FlashReader(threads=threads)
    try:
        store = ExpertStore(folder, manifest, slots, dtype, reader, config.expert_eviction, config.verify,
                            config.prefetch, config.overlaps)
        if mode == "dense":
            store.load_all()
            store.reset_stats()  # (what loading read is not a token's)
    except BaseException:
        reader.close()
        raise
    ffns = list(model.expert_ffns().values())
    for f in ffns:
        f.store = store
    if config.expert_predictor == "paths":
        _use_paths(ffns, folder, manifest, config.verify, model.args.num_experts_per_tok)
    return MoERuntime(config, Path(folder), manifest, dtype_name, resident_bytes, store, mode, budget, model_bytes,
                      ffns, resident_dtype, read_buffer_bytes=staging)


READ_BUFFERS = 256 << 20  # what the expert reader's buffers may hold


def read_buffers(lay, threads, narrow=False):
    """(reader threads, bytes of their buffers). Each thread of the reader keeps a buffer of the
    longest read it made (at least an expert), so experts of tens of MB (Mixtral-8x7B's: 99 MB at
    4-bit) get fewer threads: 32 of them would hold 3 GB. Experts narrower than the buffer's
    (--expert-bits) add the staging they are widened from. --memory-budget counts weights only;
    under --memory-limit these buffers are taken from the weights' share (loader._load_moe)."""
    per = max(lay.bundle_bytes, DEFAULT_MAX_READ) + 4096
    threads = max(1, min(threads, READ_BUFFERS // per))
    return threads, threads * per + (max(NARROW_STAGING, lay.bundle_bytes) if narrow else 0)


def _use_paths(ffns, folder, manifest, verify, k):
    """The look-ahead guesses from EdgeMoE's expert-path statistics (mlx_flash.calibrate) instead of
    the next layer's router."""
    from ..sparsity.expert_paths import load_paths

    predictor, layers = load_paths(folder, manifest, verify)
    if sorted(f.layer for f in ffns) != layers:
        raise FlashError(f"{folder}: the expert paths are of MoE layers {layers}, the model has others: calibrate "
                         "again")
    pos = {layer: i for i, layer in enumerate(layers)}
    for f in ffns:
        if f.lookahead is not None:  # (the last MoE layer has no next one)
            f.lookahead = (f.lookahead[0], lambda residual, inds, p=pos[f.layer]:
                           predictor.predict(p, np.array(inds), k)[None])


def slot_bytes(lay, dtype):
    """DRAM of one expert in the buffer: packed values as stored, scales (or float weights) at the
    compute dtype `dtype` (an MLX dtype)."""
    return sum(int(np.prod(shape)) * (4 if storage == "uint32" else dtype.size)
               for kind in KINDS for _, shape, storage in lay.arrays(kind))


def _mb(n):
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e6:.2f} MB"

"""--memory-limit: the whole process's memory -> the weights budget the planner fills.

A user knows one number, how much memory the model may take. The planner's budget
(budget.py) counts weights only; everything else a process holds is measured or
computed here and taken off the limit first:

  baseline     the process's resident set when the weights are about to load
               (interpreter, imports, MLX, the tokenizer): measured, not guessed
  KV cache     every layer's keys and values for `context` tokens at the compute
               dtype (or --kv-bits), allocated once; or, on flash (where holding it
               would leave the weights too little: runtime/stores/kv.py), its read
               buffers and each layer's last partial block
  activations  the largest prompt chunk's temporaries (FFN hidden states, the
               attention scores, a position's logits); the prompt is fed in chunks
               of `prefill_step` tokens, chosen here so that this stays small
  MLX cache    the buffer cache MLX keeps for reuse, capped under a limit
  margin       allocator slack, streaming temporaries, threads' stacks

weights budget = limit - all of the above. A limit that leaves nothing for the
weights is a clear error naming each part. The prompt plus the tokens to generate
must fit `context` (generate / stream_generate check it before they start).
"""

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import FlashError
from ..kernels import SMALL_PASS, default_threads, passes
from ..sizes import parse_share
from .stores.dip import BLOCK as DIP_BLOCK
from .stores.kv import chunk_positions, flash_kv_dram

MLX_CACHE_LIMIT = 8 << 20  # MLX's buffer cache under a limit or a budget (bytes: 32 MB gave no faster
# prompt or decode on SmolLM2, benchmarks/memory-limit/mlx-cache/cache_ab.py)
MARGIN_FIXED = 16 << 20  # allocator slack, reader / kernel temporaries, thread stacks
MARGIN_SHARE = 0.03  # ... and this share of the limit
DEFAULT_CONTEXT = 2048
PREFILL_STEPS = (512, 256, 128, 64, 32)  # the prompt chunk: the largest whose temporaries fit
BATCH_STEPS = (16, 8, 4, 2, 1)  # ... and for a batch, of each of its sequences
BASELINE_NOISE = 4 << 20  # how far apart two runs measure the same runtime's RSS (restate names a limit for both)


def physical_memory():
    """The machine's RAM in bytes (Linux and macOS)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        raise FlashError("cannot read this machine's RAM size: give --memory-limit in bytes (e.g. 8GB)")


def cgroup_limit():
    """The memory limit of this process's cgroup (Linux, v1 or v2), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"
        elif "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"
        else:
            continue
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def process_rss():
    """This process's resident set now, in bytes (macOS: its peak, which is not less)."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return peak_rss()


def trim_heap():
    """Give the C heap's free pages back to the system (glibc keeps them: a load's per-layer
    temporaries, freed, stayed in the RSS, 52 MB of float16 SmolLM2's dense load; a memory limit
    counts them). A no-op where there is no glibc (macOS)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss():
    """This process's peak resident set, in bytes. On Linux from /proc (VmHWM): getrusage's
    ru_maxrss keeps the high-water mark of the process image before exec, so a child started
    from a large parent (a test runner, a server) would report the parent's peak."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def parse_limit(text):
    """'8GB' / '512MiB' / bytes, or '50%' of the machine's RAM -> bytes."""
    kind, v = parse_share(text, "--memory-limit")
    return int(physical_memory() * v) if kind == "fraction" else int(v)


@dataclass
class Shape:
    """What the non-weight memory depends on (from the built model)."""

    n_layers: int
    d_model: int
    n_ff: int
    n_heads: int
    kv_per_token: int  # keys + values of every layer for one position, in values
    vocab: int
    # a prompt chunk's FFN goes through the DIP store (flash mode's dip / calibrated sources): it
    # also holds h~ on the host twice (the scores and their masks) and a block of dequantized rows
    dip_prompt: bool = False


def model_shape(model, d_model, n_ff):
    """Shape of an mlx_flash model (its layers' key / value projections give the KV width)."""
    attn = [getattr(layer, "self_attn", None) for layer in model.layers]
    if any(a is None or not hasattr(a, "k_proj") for a in attn):
        raise FlashError(f"{type(model).__name__}: cannot size its KV cache for --memory-limit")
    kv = sum(a.k_proj.weight.shape[0] + a.v_proj.weight.shape[0] for a in attn)
    heads = getattr(attn[0], "n_heads", None) or getattr(attn[0], "num_heads", None) or 1
    return Shape(len(attn), d_model, n_ff, heads, kv, _vocab(model))


def _vocab(model):
    for path in ("lm_head", "model.embed_tokens", "model.decoder.embed_tokens", "embed_tokens"):
        m = model
        for part in path.split("."):
            m = getattr(m, part, None)
            if m is None:
                break
        if m is not None and hasattr(m, "weight"):
            return m.weight.shape[0]
    raise FlashError(f"{type(model).__name__}: cannot find its vocabulary size for --memory-limit")


@dataclass
class MemoryPlan:
    limit: int
    baseline: int
    kv: int
    activations: int
    mlx_cache: int
    margin: int
    context: int
    prefill_step: int
    source: str  # where the limit came from, for the log line
    shape: "Shape"
    itemsize: int
    kv_itemsize: float | None = None  # bytes per KV value when quantized (--kv-bits)
    kv_on_flash: bool = False  # the KV cache written to flash and read back each token (kv: its DRAM)
    batch: int = 1  # sequences decoded together (batch_generate), each with a KV cache of `context`

    @property
    def other(self):
        return self.baseline + self.kv + self.activations + self.mlx_cache + self.margin

    @property
    def weights(self):
        return self.limit - self.other

    def restate(self, e):
        """A BudgetTooSmall from the planner (whose budget is this plan's `weights`) in the
        limit's terms: what the limit leaves for weights, why that is short, and the limit
        that would hold it (the smallest: the margin and the prompt chunks grow with the limit),
        for a runtime a little larger than this process measured (another run measures its
        RSS a few MB apart: the named limit must hold there too)."""
        need = self.limit + (e.needed - e.budget)
        baseline = self.baseline + max(BASELINE_NOISE, self.baseline // 50)
        # (at either runtime: a smaller one leaves room for longer prompt chunks, whose temporaries
        # can leave the weights less)
        while min(_plan_at(need, self.source, self.shape, self.itemsize, self.context, b, self.kv_itemsize,
                           self.kv_on_flash, self.batch).weights for b in (baseline, self.baseline)) < e.needed:
            need += 1 << 20
        hint = ""
        if self.kv_on_flash or self.batch > 1:
            pass  # (neither holds a quantized KV cache)
        elif self.kv_itemsize in (None, self.itemsize):  # a float KV cache: would 8 bits make room?
            kv8 = _plan_at(self.limit, self.source, self.shape, self.itemsize, self.context, baseline,
                           kv_value_bytes(self.itemsize, 8), batch=self.batch)
            if kv8.weights >= e.needed:
                hint = (f", or keep it with --kv-bits 8 (the KV cache at 8 bits: {kv8.kv / 1e6:.0f} MB instead of "
                        f"{self.kv / 1e6:.0f}; not exact, close: benchmarks/kv-cache/bits/)")
        return FlashError(f"--memory-limit {self.limit / 1e6:.0f} MB leaves {self.weights / 1e6:.0f} MB for "
                          f"weights (besides them {self.other / 1e6:.0f} MB: {self._besides()}), and {e.reason}: "
                          f"raise --memory-limit to at least {-(-need // 10**6)} MB{hint}{e.hint}")

    def shorter_chunks(self):
        """This plan with each shorter prompt chunk, longest first: each leaves the weights more
        (and a prompt reads the streamed weights more often). The loader tries them before it
        gives up a placement the weights do not fit."""
        return [_plan_at(self.limit, self.source, self.shape, self.itemsize, self.context, self.baseline,
                         self.kv_itemsize, self.kv_on_flash, self.batch, max_step=s)
                for s in _steps(self.context, self.batch) if s < self.prefill_step]

    @property
    def most_weights(self):
        """The weights' share at this plan's shortest prompt chunk (the most it can leave them)."""
        return (self.shorter_chunks() or [self]).pop().weights

    def _besides(self):
        mb = lambda b: f"{b / 1e6:.0f} MB"  # noqa: E731
        kv = (f"KV cache on flash {mb(self.kv)} of buffers ({self.context} tokens: "
              f"{mb(self.context * self.shape.kv_per_token * self.itemsize)} on disk)" if self.kv_on_flash
              else f"KV cache {mb(self.kv)} ({self.context} tokens"
              + (f" x {self.batch} sequences)" if self.batch > 1 else ")"))
        return (f"runtime {mb(self.baseline)} (measured), {kv}, "
                f"activations {mb(self.activations)} (prompt chunks of {self.prefill_step}), MLX cache "
                f"{mb(self.mlx_cache)}, margin {mb(self.margin)}")

    def as_dict(self):
        """What --stats and the benchmarks show of the plan (runtime.stats()["summary"]["memory_limit"])."""
        return {"limit_bytes": self.limit, "weights_bytes": self.weights, "runtime_bytes": self.baseline,
                "kv_bytes": self.kv, "ctx_size": self.context, "activation_bytes": self.activations,
                "prefill_step": self.prefill_step, "mlx_cache_bytes": self.mlx_cache, "margin_bytes": self.margin,
                "kv_on_flash": self.kv_on_flash, "batch": self.batch}

    def describe(self):
        mb = lambda b: f"{b / 1e6:.0f} MB"  # noqa: E731
        return f"memory limit {mb(self.limit)} ({self.source}): weights {mb(self.weights)}; besides them {self._besides()}"


def activation_bytes(shape, chunk, context, itemsize, kv_on_flash=False, sequences=1):
    """Temporaries of one prompt chunk: the FFN's hidden states (3 live at once), a few
    d_model-wide tensors, every head's attention scores over the context (on flash: over a
    chunk read back or the prompt chunk itself, in float32, and the chunk's keys and values as
    rows to write, a few times); and the logits of up to SMALL_PASS positions for each of
    `sequences` (a decode step's, a verify pass's, a prompt's last few; a prompt chunk's own are
    never computed: mlx_lm's prefill drops them, and every lm_head computes a chunk of more
    positions lazily: models/half.py head_product). A decode step of more than SMALL_PASS
    sequences through the pass kernels holds float32 host arrays of the FFN's width for each:
    the gate, the up, their product and x transposed in C (kernels.passes.BATCH_PASS), at least
    that whatever the chunk, and each kernel thread's tile of 64 columns (_matvec.c
    MM16_KBLOCK x d_model floats, rounded up to 16: 1 MiB a thread at d_model 4,096); so does a
    prompt chunk of more than SMALL_PASS and up to kernels.passes.PROMPT_PASS positions (0 unless set), for each."""
    if kv_on_flash:
        width = 2 * shape.n_heads * (chunk_positions(kv_row_bytes(shape, itemsize)) + chunk) * 4 // itemsize
        width += 4 * shape.kv_per_token // shape.n_layers
    else:
        width = 2 * shape.n_heads * context
    per = (5 if shape.dip_prompt else 3) * shape.n_ff + 8 * shape.d_model + width
    # (the DIP store's dequantization block: NumPy's buffer and MLX's copy, gate and up)
    per_chunk = 4 * DIP_BLOCK * shape.n_ff * 4 if shape.dip_prompt else 0
    step = 0
    tiled = max(sequences if sequences > SMALL_PASS else 0, chunk if SMALL_PASS < chunk <= passes.PROMPT_PASS else 0)
    if tiled:
        tiles = default_threads() * 64 * -(-shape.d_model // 16) * 16 * 4  # (a thread's, kept by the pool)
        step = tiled * (4 * shape.n_ff + 2 * shape.d_model) * 4 + tiles
    return (max(chunk * per * itemsize + per_chunk, step)
            + max(2, SMALL_PASS) * sequences * shape.vocab * itemsize)


def kv_row_bytes(shape, itemsize):
    """One layer's keys and values for one position (the KV cache on flash's row)."""
    return shape.kv_per_token // shape.n_layers * itemsize


def effective_limit(text, warn=True):
    """--memory-limit `text` -> (bytes, where it came from): the given limit, or this process's
    cgroup limit where that is lower (said once, with `warn`)."""
    limit = parse_limit(text)
    source = "of this machine's RAM" if parse_share(text, "--memory-limit")[0] == "fraction" else "given"
    cg = cgroup_limit()
    if cg is not None and cg < limit - (1 << 20):  # (a cgroup's limit is the given one rounded to pages)
        if warn:
            print(f"[mlx_flash] --memory-limit {limit / 1e6:.0f} MB is above this process's cgroup limit "
                  f"({cg / 1e6:.0f} MB): planning for the cgroup's", file=sys.stderr)
        return cg, "the cgroup's limit"
    return (limit if cg is None else min(limit, cg)), source


def kv_value_bytes(itemsize, kv_bits=None, group_size=64):
    """Bytes a KV cache holds per key or value: the compute dtype's, or quantized: the packed
    bits plus each group's scale and bias (in the compute dtype, as mlx_lm keeps them)."""
    return itemsize if kv_bits is None else kv_bits / 8 + 2 * itemsize / group_size


def plan_memory(text, shape, itemsize, context=None, baseline=None, kv_itemsize=None, kv_on_flash=False, batch=1,
                warn=True):
    """--memory-limit `text` -> MemoryPlan (its `weights` is the planner's budget). kv_itemsize:
    bytes per KV value (kv_value_bytes; default the compute dtype's); kv_on_flash: the KV cache
    written to flash and read back (its buffers are what DRAM holds); batch: sequences decoded
    together, each with its KV cache and its share of a prompt chunk's temporaries. warn: say
    once where a cgroup's limit is lower than the given one (a second plan of the same limit: not)."""
    limit, source = effective_limit(text, warn)
    context = DEFAULT_CONTEXT if context is None else context
    if context < 1:
        raise FlashError(f"--ctx-size must be at least 1 token, got {context}")
    baseline = process_rss() if baseline is None else baseline
    plan = _plan_at(limit, source, shape, itemsize, context, baseline, kv_itemsize, kv_on_flash, batch)
    if plan.weights <= 0:
        kv = plan.kv
        raise FlashError(f"--memory-limit {limit / 1e6:.0f} MB ({source}): nothing left for the weights: "
                         f"besides them the process needs {plan.other / 1e6:.0f} MB ({plan._besides()}): raise "
                         "--memory-limit" + (" or lower --ctx-size" if kv > plan.limit // 4 else ""))
    return plan


def _steps(context, batch):
    # (no chunk is longer than the context; a batch's chunk is of every sequence: shorter ones allowed)
    return sorted({min(s, context) for s in PREFILL_STEPS + (BATCH_STEPS if batch > 1 else ())}, reverse=True)


def _plan_at(limit, source, shape, itemsize, context, baseline, kv_itemsize=None, kv_on_flash=False, batch=1,
             max_step=None):
    if kv_on_flash:
        kv = flash_kv_dram(shape.n_layers, kv_row_bytes(shape, itemsize))
    else:  # kv_caches (a batch's: batch_generate's one BatchKVCache): allocated once, never grown
        kv = batch * int(context * shape.kv_per_token * (itemsize if kv_itemsize is None else kv_itemsize))
    margin = MARGIN_FIXED + int(MARGIN_SHARE * limit)
    room = limit - baseline - kv - MLX_CACHE_LIMIT - margin
    steps = [s for s in _steps(context, batch) if max_step is None or s <= max_step]
    step = steps[-1]
    for s in steps:  # the largest chunk whose temporaries take at most a quarter of what is left
        if activation_bytes(shape, s * batch, context, itemsize, kv_on_flash, batch) <= max(room, 0) // 4:
            step = s
            break
    return MemoryPlan(limit, baseline, kv, activation_bytes(shape, step * batch, context, itemsize, kv_on_flash, batch),
                      MLX_CACHE_LIMIT, margin, context, step, source, shape, itemsize, kv_itemsize, kv_on_flash,
                      batch)


def kv_caches(n_layers, context=None, bits=None, group_size=64):
    """mlx_lm KV caches for a planned context: each allocates the whole context at its first
    update (step = context), where mlx_lm's default grows by 256 positions, holding old and
    new buffers while it copies (up to twice the cache at a step) and up to 255 positions
    unused. A conversation past the context grows by another context's worth: generate and
    chat stop before it. context None: mlx_lm's growth (no plan). bits (--kv-bits):
    QuantizedKVCaches, quantized from the first token (where mlx_lm's --kv-bits converts a
    float cache after --quantized-kv-start tokens, holding both while it does)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    caches = [KVCache() if bits is None else QuantizedKVCache(group_size=group_size, bits=bits)
              for _ in range(n_layers)]
    if context is not None:
        for c in caches:
            c.step = context
    return caches


def flash_kv_caches(model, runtime, context):
    """Per-layer caches of one KV cache on flash (stores/kv.py) for `context` positions, in
    the mlx_flash home's kv/ folder (the disk the models are on); its reads join the FFN
    store's stats, and it becomes `runtime.kv` (the cost model counts its reads)."""
    import mlx.core as mx

    from ..home import default_home
    from ..io.reader import FlashReader
    from .stores.kv import FlashKV

    attn = model.layers[0].self_attn
    heads = getattr(attn, "n_kv_heads", None) or attn.n_heads
    kv = FlashKV(default_home() / "kv", len(model.layers), heads, attn.head_dim, attn.head_dim, context,
                 getattr(mx, runtime.compute_dtype), FlashReader(threads=KV_READ_THREADS), verify=runtime.config.verify,
                 stats=getattr(runtime.store, "stats", None))
    runtime.kv = kv
    return [kv.layer_cache(i) for i in range(len(model.layers))]


KV_READ_THREADS = 4  # the KV cache's reads are a few large spans a layer


TOKENIZER_PEAK = 32 << 20  # the least a tokenizer's load is counted to add at its peak
# A tokenizer's load (mlx_lm's, then tokenizer.py's trim), per byte of its tokenizer.json: what the
# RSS peaks at above the imports, and what it keeps. Measured: SmolLM2 (3.5 MB) +82 / +24 MB,
# Qwen2.5 (11.4 MB) +245 / +51, Gemma 3 (33.3 MB, 262,144 tokens, 513k merges) +727 / +126.
TOKENIZER_PEAK_PER_BYTE, TOKENIZER_KEPT_PER_BYTE = 23, 7


def tokenizer_load(folder):
    """(the RSS a tokenizer's load adds at its peak, what it keeps), from its tokenizer.json's size;
    each at least TOKENIZER_PEAK."""
    path = Path(folder) / "tokenizer.json"
    size = path.stat().st_size if path.is_file() else 0
    return max(TOKENIZER_PEAK, TOKENIZER_PEAK_PER_BYTE * size), max(TOKENIZER_PEAK, TOKENIZER_KEPT_PER_BYTE * size)


def check_limit_before_loading(text, resident_file_bytes, earlier, folder):
    """Before the tokenizer and the resident weights load: a limit that cannot hold the
    runtime, the tokenizer's load and the resident file (less what may stay on flash:
    runtime.loaded_resident_bytes) is a clear error now, not a kill by the memory cgroup
    while loading. earlier: the folders of models loaded before in this process and still
    referenced (loader.loaded_before), named in the error or in a warning: their memory counts
    in this load's runtime."""
    limit, _ = effective_limit(text, warn=False)  # (plan_memory says it, after this check)
    runtime = process_rss()
    peak, kept = tokenizer_load(folder)
    need = runtime + max(peak, kept + resident_file_bytes)  # (the weights load after the tokenizer's peak)
    held = (f"{len(earlier)} model(s) loaded before in this process and still referenced ({', '.join(earlier)}) "
            "count in the measured runtime: drop every reference to them (del model; gc.collect()) before "
            "loading another under a limit" if earlier else "")
    if need > limit:
        raise FlashError(f"--memory-limit {limit / 1e6:.0f} MB: nothing left for the weights: the runtime takes "
                         f"{runtime / 1e6:.0f} MB (measured), loading the tokenizer ~{peak / 1e6:.0f} MB at its "
                         f"peak (~{kept / 1e6:.0f} MB kept) and the resident weights {resident_file_bytes / 1e6:.0f} "
                         "MB before any FFN row: raise "
                         f"--memory-limit to at least {need / 1e6:.0f} MB" + (f"; {held}" if held else ""))
    if held:
        logging.getLogger("mlx_flash").warning("--memory-limit: the runtime measured, %.0f MB, leaves less for the "
                                               "weights: %s", runtime / 1e6, held)

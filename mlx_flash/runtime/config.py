"""FlashConfig: every run-time option, its type, default and check, once.

`load()`'s keywords are these fields; the CLI's model arguments are generated
from them (`add_cli_args`, `from_cli`), so a new option is one field here.
"""

from dataclasses import dataclass, field, fields

from ..errors import FlashError
from ..io.reader import READ_THREADS

MODES = ("dense", "naive", "hybrid", "flash")  # what a runtime runs
CONFIG_MODES = ("auto",) + MODES  # what a user may ask for (auto: plan/choose.py picks one of MODES)
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
HELD_DTYPES = ("float16", "bfloat16")  # what resident weights may be held at, converted before use
RESIDENT_DTYPES = COMPUTE_DTYPES + ("quantized",)  # quantized: a quantized model's, at their bits
EVICTIONS = ("lru", "lfu", "belady")  # belady: replays a recorded trace (benchmarks only)


def _sparsity_names():
    from ..sparsity import source_names

    return source_names()


def _opt(default, help, flag=None, choices=None, negate=False):
    """A field with what the CLI needs: its help, its flag (None: not on the CLI), its
    choices (a tuple, or a function giving them), and `negate` for a --no-x switch."""
    return field(default=default, metadata=dict(help=help, flag=flag, choices=choices, negate=negate))


@dataclass(frozen=True)
class FlashConfig:
    dtype: str | None = _opt(None, "compute dtype (default float32 on the CPU, the flash dtype on a GPU)",
                             "--dtype", COMPUTE_DTYPES)
    verify: bool = _opt(True, "skip sha256 checks at load", "--no-verify", negate=True)
    mode: str = _opt("auto", "auto: dense when the model fits the memory limit or budget, else the exact "
                     "mode that reads least (hybrid, else naive), or flash when a sparsity option is given; "
                     "dense: all FFN rows in DRAM; naive: all read every token; hybrid: as many resident as "
                     "the budget allows, the rest read; flash: only the needed neurons, windowed cache "
                     "(default auto)", "--mode", CONFIG_MODES)
    explain: bool = _opt(False, "print the plan before running: with --mode auto every mode it compared "
                         "(the weights each needs, the cost model's predicted time per token)", "--explain")
    sparsity: str = _opt("oracle", "flash mode's sparsity source (dip / dip-ca need a model converted "
                         "with --dip; predictor a calibrated one)", "--sparsity", _sparsity_names)
    gamma: float = _opt(0.2, "DIP-CA re-weighting of uncached entries", "--gamma")
    eviction: str = _opt("lfu", "DIP caches' eviction policy", "--eviction", ("lru", "lfu"))
    expert_eviction: str = _opt("edgemoe", "mixture-of-experts models under --memory-budget: which expert the "
                                "full buffer gives up (lru, lfu, or edgemoe: EdgeMoE's use frequency weighted by "
                                "how soon its layer runs again)", "--expert-eviction", ("lru", "lfu", "edgemoe"))
    expert_predictor: str = _opt("router", "mixture-of-experts models under --memory-budget: how the next layer's "
                                 "experts are guessed to read them ahead (router: its router on this layer's hidden "
                                 "state; paths: EdgeMoE's expert-path statistics of mlx_flash.calibrate)",
                                 "--expert-predictor", ("router", "paths"))
    density: float = _opt(1.0, "kept fraction of neurons (top-k sources); of the FFN's weights per token, on "
                            "average (dip, calibrated)", "--density")
    memory_budget: str | None = _opt(None, "weights in DRAM: '50%%' of the model or '4GB' (the paper's "
                                     "weights-only budget; --memory-limit counts the whole process)",
                                     "--memory-budget")
    memory_limit: str | None = _opt(None, "the whole process's memory: '8GB' or '50%%' of this machine's RAM; "
                                    "the runtime, KV cache, activations and MLX's cache are measured or "
                                    "computed and the weights get the rest (runtime/memory.py)", "--memory-limit")
    ctx_size: int | None = _opt(None, "with --memory-limit: the tokens of context (prompt + generated) the "
                                "KV cache is planned for (default 2048; llama.cpp's name)", "--ctx-size")
    batch_size: int = _opt(1, "with --memory-limit: the sequences decoded together (batch_generate), each with a "
                           "KV cache of --ctx-size tokens (generate --batch-file: its number of prompts)")
    kv_bits: int | None = _opt(None, "hold the KV cache quantized from the first token, group-wise at these "
                               "bits (mlx_lm's QuantizedKVCache; --memory-limit plans it at that size)",
                               "--kv-bits", (4, 8))
    kv_cache: str = _opt("auto", "where the KV cache lives: dram; flash (written as it is made, read back in "
                         "chunks by every token: for contexts whose keys and values the memory cannot hold); auto: "
                         "flash only when --memory-limit leaves the weights too little with it in DRAM",
                         "--kv-cache", ("auto", "dram", "flash"))
    kv_group_size: int = _opt(64, "with --kv-bits: values per quantization group (mlx_lm's name)",
                              "--kv-group-size", (32, 64, 128))
    window: int | None = _opt(4, "tokens whose neurons stay cached (flash)", "--window")
    threads: int = _opt(READ_THREADS, "reader threads", "--threads")
    resident_dtype: str | None = _opt(
        None, "hold embeddings and attention in DRAM at the model's 16-bit flash dtype and convert "
        "them just before use (exact, half the DRAM; default: the compute dtype). A quantized model's: "
        "'quantized' holds them at their bits (1/7 of float32's DRAM; on the CPU the native quantized "
        "matvec, ~10x float32's decode), float32 dequantizes them at load; default: quantized (float32 "
        "on a CPU without the native kernels, unless --memory-budget is given)", "--resident-dtype", RESIDENT_DTYPES)
    stream_embeddings: str = _opt(
        "auto", "the input embedding table: 'on' leaves it in the resident file and reads, each pass, the "
        "rows of its tokens (one small checked read a token; the table's DRAM freed); 'off' holds it in DRAM; "
        "auto: on under --memory-limit / --memory-budget where the whole model does not fit (--mode naive: "
        "where the resident weights leave the FFN too little), before any attention is read from flash. Never "
        "a table tied to the output head, which multiplies by every row each token", "--stream-embeddings",
        ("auto", "on", "off"))
    stream_head: str = _opt(
        "auto", "the output head (an untied, quantized one): 'on' leaves it in the resident file and reads "
        "it every pass, chunk by chunk, while the kernels multiply the chunk before (its DRAM freed, its bytes "
        "read each token); 'off' holds it in DRAM; auto: on under --memory-limit / --memory-budget only where "
        "even every layer's attention read from flash leaves the FFN too little", "--stream-head",
        ("auto", "on", "off"))
    ffn_rows: str | None = _opt(
        None, "a quantized model's FFN rows in DRAM (caches, streaming buffers): 'quantized' keeps "
        "them at their bits as read (1/7 of float32's DRAM, computed on by the native kernels on the "
        "CPU), float32 dequantizes them as they are read; default: quantized for dense / naive / hybrid and the "
        "DIP store (dip, calibrated) where the kernels run (the CPU, float32 compute, no --resident-dtype float16), else float32 (flash "
        "mode's few active rows fall in many groups of the down scales: at its bits its compute was "
        "measured 741-985 vs 733-796 ms per OPT-6.7B token, benchmark paper)",
        "--ffn-rows", ("quantized", "float32"))
    cache_writes: str | None = _opt(
        None, "how read rows enter the neuron caches: host (the reader writes the cache's memory in place, "
        "the fastest on the CPU) or staged (a host staging copy, scattered into the caches on the device: no "
        "host write to memory a GPU computes on); default host on the CPU, staged on a GPU",
        "--cache-writes", ("host", "staged"))
    recovery: bool = _opt(True, "calibrated sources: leave out the recovery adapters of `mlx_flash.calibrate "
                          "--recover` (used when the model has them)", "--no-recovery", negate=True)
    prefetch: bool = _opt(True, "read in the layer, without overlapping compute (naive / hybrid: the "
                          "next layer's rows; flash: the missing neurons while the cached ones compute; "
                          "experts: the next layer's guessed experts, and a layer's missing ones while its "
                          "cached ones compute)", "--no-prefetch", negate=True)
    # for the paper benchmark, not on the CLI
    bundled: bool = _opt(True, "read a neuron's weight kinds as one bundle (False: one read per kind, "
                         "the paper's layout before row-column bundling)")
    overlap: bool | None = _opt(None, "flash / experts: read a layer's missing neurons / experts while the "
                                "cached ones compute (None: as prefetch)")

    def __post_init__(self):
        def bad(what):
            raise FlashError(what)

        if self.mode not in CONFIG_MODES:
            bad(f"unknown mode '{self.mode}' (choose from {', '.join(CONFIG_MODES)})")
        if self.dtype is not None and self.dtype not in COMPUTE_DTYPES:
            bad(f"unsupported compute dtype '{self.dtype}' (choose from {', '.join(COMPUTE_DTYPES)})")
        if not isinstance(self.sparsity, str):
            bad("sparsity is a source's name (a source object goes to build_runtime(source=...))")
        if self.mode != "dense" and self.sparsity not in _sparsity_names():
            bad(f"unknown sparsity source '{self.sparsity}' (available: {', '.join(_sparsity_names())})")
        if self.mode in ("flash", "auto") and not 0 < self.density <= 1:
            bad(f"--density must be in (0, 1], got {self.density}")
        if self.window is not None and self.window < 0:
            bad(f"--window must be 0 or more, got {self.window}")
        if not 1 <= self.threads <= 1024:
            bad(f"--threads must be in 1..1024, got {self.threads}")
        self._check_applies()
        if self.memory_limit is not None and self.memory_budget is not None:
            bad("--memory-limit (the whole process) and --memory-budget (weights only) contradict each "
                "other: give one")
        if self.kv_group_size != 64 and self.kv_bits is None:
            bad("--kv-group-size sizes the groups of a quantized KV cache: give --kv-bits too")
        if self.batch_size < 1:
            bad(f"batch_size must be at least 1, got {self.batch_size}")
        if self.batch_size > 1 and self.memory_limit is None:
            bad("batch_size sizes the KV caches a --memory-limit plan holds; without a limit batch_generate "
                "takes any number of prompts")
        if self.batch_size > 1 and self.kv_bits is not None:
            bad("--kv-bits quantizes one sequence's KV cache: a batch's is held at the compute dtype")
        if self.batch_size > 1 and self.kv_cache == "flash":
            bad("--kv-cache flash holds one sequence's keys and values: a batch keeps its KV cache in DRAM")
        if self.kv_cache not in ("auto", "dram", "flash"):
            bad(f"unknown --kv-cache '{self.kv_cache}' (choose from auto, dram, flash)")
        if self.kv_cache == "flash" and self.kv_bits is not None:
            bad("--kv-cache flash holds keys and values at the compute dtype: a quantized KV cache (--kv-bits) "
                "stays in DRAM")
        if self.ctx_size is not None and self.memory_limit is None and self.kv_cache != "flash":
            bad("--ctx-size sizes the KV cache that --memory-limit (or --kv-cache flash) plans for; without "
                "either it changes nothing")
        if self.cache_writes not in (None, "host", "staged"):
            bad(f"unknown cache writes '{self.cache_writes}' (choose from host, staged)")
        if self.cache_writes is not None and self.mode == "dense":
            bad("--cache-writes is for the modes that read rows into caches (naive, hybrid, flash), not dense")
        if self.eviction not in EVICTIONS:
            bad(f"unknown eviction policy '{self.eviction}' (choose from {', '.join(EVICTIONS)})")
        if self.stream_embeddings not in ("auto", "on", "off"):
            bad(f"unknown --stream-embeddings '{self.stream_embeddings}' (choose from auto, on, off)")
        if self.stream_head not in ("auto", "on", "off"):
            bad(f"unknown --stream-head '{self.stream_head}' (choose from auto, on, off)")
        if self.resident_dtype is not None and self.resident_dtype not in RESIDENT_DTYPES:
            bad(f"unsupported resident dtype '{self.resident_dtype}' (choose from "
                f"{', '.join(RESIDENT_DTYPES)})")

    def _check_applies(self):
        """Options that would change nothing in this configuration are refused, not ignored
        (a value equal to the default cannot be told from no value, and changes nothing)."""
        d = DEFAULTS_BY_NAME
        if self.mode not in ("flash", "auto"):  # (auto with any of them is flash: sparse_options)
            given = [flag for flag, ok in (
                ("--sparsity", self.sparsity == d["sparsity"]),
                ("--density", self.density == d["density"]),
                ("--window", self.window in (d["window"], None)),
                ("--gamma", self.gamma == d["gamma"]),
                ("--eviction", self.eviction == d["eviction"])) if not ok]
            if given:
                raise FlashError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to --mode "
                                 f"flash (the mode that reads only the neurons a sparsity source picks); "
                                 f"--mode {self.mode} would ignore {'it' if len(given) == 1 else 'them'}")
        elif self.sparsity in _sparsity_names() and (self.mode == "flash" or self.sparse_options):
            from ..sparsity import source_class

            cls = source_class(self.sparsity)
            if self.gamma != d["gamma"] and not getattr(cls, "cache_aware", False):
                raise FlashError(f"--gamma re-weights what the cache holds: only for the cache-aware sources "
                                 f"(dip-ca, calibrated-ca), not --sparsity {self.sparsity}")
            if self.eviction != d["eviction"] and getattr(cls, "store", "flash") != "dip":
                raise FlashError(f"--eviction chooses what the DIP store's caches drop: only for dip, dip-ca "
                                 f"and the calibrated sources, not --sparsity {self.sparsity}")
        if not self.prefetch and self.mode == "dense":
            raise FlashError("--no-prefetch changes how rows are read during a token: --mode dense reads "
                             "none (every row is in DRAM)")

    @property
    def sparse_options(self):
        """The flash-only options given (differing from their defaults): with --mode auto, they
        ask for flash mode."""
        d = DEFAULTS_BY_NAME
        return [flag for flag, name in (("--sparsity", "sparsity"), ("--density", "density"),
                                        ("--window", "window"), ("--gamma", "gamma"), ("--eviction", "eviction"))
                if getattr(self, name) != d[name] and not (name == "window" and self.window is None)]

    @property
    def overlaps(self):
        """flash mode reads a layer's missing neurons during its compute."""
        return self.prefetch if self.overlap is None else self.overlap

    def compute_dtype(self, flash_dtype, on_cpu):
        # On the CPU only float32 matmuls use BLAS (MLX's CPU backend): 16-bit is ~20x slower.
        return self.dtype or ("float32" if on_cpu else flash_dtype)

    def held_dtype(self, flash_dtype, compute_dtype):
        """The 16-bit dtype resident weights are held at, or None for the compute dtype."""
        r = self.resident_dtype
        if r in (None, compute_dtype, "quantized"):
            return None
        if r not in HELD_DTYPES:
            raise FlashError(f"unsupported resident dtype '{r}' (choose from {', '.join(HELD_DTYPES)}, "
                             f"or the compute dtype {compute_dtype})")
        if compute_dtype != "float32":
            raise FlashError(f"--resident-dtype {r} needs float32 compute (got {compute_dtype})")
        if r != flash_dtype:
            raise FlashError(f"--resident-dtype {r}: the model is {flash_dtype} on flash; holding it at "
                             f"another 16-bit dtype would round it (choose {flash_dtype} or float32)"
                             if flash_dtype in HELD_DTYPES else
                             f"--resident-dtype {r}: the model is {flash_dtype} on flash; holding it at "
                             f"16 bits would round it (convert it with --dtype {r})")
        return r


def keep_quantized(config, on_cpu):
    """Hold a quantized model's resident weights at their bits (else dequantize them)? Yes,
    unless told otherwise, or on a CPU without the native kernels (kernels/_matvec.c), where
    MLX's own quantized matmul is 2x (decode) to 50x (prompt) slower than float32 BLAS
    (models/quantized.py): there only when a memory budget asks for the DRAM."""
    if config.resident_dtype is None:
        if not on_cpu or config.memory_budget is not None:
            return True
        from ..kernels import kernels_module

        return kernels_module()[0] is not None
    return config.resident_dtype == "quantized"


def packed_ffn_rows(config, quantized_layout, float32_compute, held, kernels, dip=False, mode=None):
    """Keep a quantized layout's FFN rows at their bits in the caches? (see ffn_rows; dip: the
    DIP store's, whose default is quantized where the kernels run; mode: the mode asked about,
    default config.mode)"""
    possible = bool(quantized_layout and float32_compute and not held and kernels)
    if config.ffn_rows == "quantized" and not possible:
        raise FlashError("--ffn-rows quantized needs a quantized model, float32 compute and the native "
                         "kernels on the CPU" + ("" if kernels else " (not built, or not on the CPU)"))
    if config.ffn_rows is None:
        return possible and (dip or (mode or config.mode) in ("dense", "naive", "hybrid"))
    return possible and config.ffn_rows == "quantized"


def staged_caches(config, on_cpu):
    """The one place that chooses how rows enter the caches (cache/neuron_cache.py): in place
    from the host on the CPU (measured fastest: no copy, no scatter), staged on a GPU (the
    host never writes memory the device reads; on a discrete GPU every such write crosses the
    bus and serialises host and device). A Mac's unified memory would allow the host
    path too; staged is the default there until a Metal run measures which is faster."""
    if config.cache_writes is None:
        return not on_cpu
    return config.cache_writes == "staged"


def option_names():
    return [f.name for f in fields(FlashConfig)]


def _value_type(f):
    """int / float for a field of that type (its default, or its annotation where the default
    is None, e.g. `int | None`), else None."""
    kind = {int: int, float: float}.get(type(f.default))
    if kind is None and f.default is None:
        names = str(f.type).replace(" ", "").split("|")
        kind = {"int": int, "float": float}.get(next((n for n in names if n != "None"), ""))
    return kind


def add_cli_args(parser):
    """The model options of every command that loads a model, from FlashConfig's fields."""
    for f in fields(FlashConfig):
        meta = f.metadata
        if not meta.get("flag"):
            continue
        if meta["negate"]:
            parser.add_argument(meta["flag"], dest=f.name, action="store_false", help=meta["help"])
            continue
        if f.default is False:  # a switch
            parser.add_argument(meta["flag"], dest=f.name, action="store_true", help=meta["help"])
            continue
        choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
        kind = _value_type(f)  # None: a string (or a choice)
        parser.add_argument(meta["flag"], dest=f.name, default=f.default, type=kind, choices=choices,
                            help=meta["help"])


def from_cli(args, **overrides):
    """FlashConfig from parsed arguments (those add_cli_args made)."""
    values = {f.name: getattr(args, f.name) for f in fields(FlashConfig)
              if f.metadata.get("flag") and hasattr(args, f.name)}
    return FlashConfig(**(values | overrides))


def make_config(options):
    """load()'s keywords -> FlashConfig; a keyword that is not an option is a TypeError."""
    unknown = [k for k in options if k not in option_names()]
    if unknown:
        raise TypeError(f"unknown load() options: {', '.join(unknown)}")
    return FlashConfig(**options)


DEFAULTS_BY_NAME = {f.name: f.default for f in fields(FlashConfig)}
DEFAULTS = FlashConfig()  # every default, for code that needs one outside a config

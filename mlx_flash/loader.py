"""load(): a converted flash folder (or anything convertible) -> (model, tokenizer)."""

import json
import os
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .errors import FlashError
from .layout.format import check_file, is_flash_folder, read_manifest

BUDGET_CACHE_LIMIT = 32 << 20  # MLX buffer cache under --memory-budget (bytes)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_home():
    return Path(os.environ.get("MLX_FLASH_HOME", Path.home() / ".cache" / "mlx_flash"))


def resolve_model_path(path_or_repo, convert_dtype="float16", progress=True):
    """A flash folder as is; anything else is converted once into MLX_FLASH_HOME."""
    p = Path(str(path_or_repo)).expanduser()
    if p.is_dir() and is_flash_folder(p):
        return p
    from .convert import convert

    slug = str(path_or_repo).strip("/").replace("/", "--").replace(".", "_")
    out = default_home() / "models" / f"{slug}-{convert_dtype}"
    if is_flash_folder(out):
        return out
    return convert(path_or_repo, out, dtype=convert_dtype, progress=progress)


def default_compute_dtype(flash_dtype):
    # On the CPU only float32 matmuls use BLAS (FACTS.md): 16-bit is ~20x slower.
    if mx.default_device() == mx.cpu:
        return "float32"
    return flash_dtype


def load(path_or_repo, dtype=None, verify=True, progress=False, mode="dense", sparsity="oracle",
         density=1.0, memory_budget=None, window=4, threads=32, gamma=0.2, eviction="lfu",
         resident_dtype=None, prefetch=True, **options):
    """Load a model for generation.

    path_or_repo: a converted mlx_flash folder, or a Hub repo id / HF folder /
      mlx-lm folder / .gguf file (converted once into $MLX_FLASH_HOME).
    dtype: compute dtype (default float32 on the CPU, the flash dtype on a GPU).
    verify: check the sha256 of every file against the manifest while reading.
    mode: dense (every FFN row in DRAM), naive (every FFN weight read from flash
      every token), hybrid (half resident, half read every token), flash (the
      neurons a token needs, through per-layer windowed caches).
    sparsity, density: the flash mode's sparsity source and kept fraction.
    memory_budget: "50%" of the model's weights or "4GB"; the weights the
      process holds in DRAM stay under it.
    window: tokens whose active neurons stay cached (flash mode).
    gamma, eviction: DIP-CA's re-weighting of uncached entries, and the eviction
      policy (lru, lfu) of the DIP caches.
    resident_dtype: hold the resident weights (embeddings, attention) in DRAM at
      this 16-bit dtype, the model's flash dtype, and convert them to the compute
      dtype just before each use (exact; half the DRAM of float32). None: hold
      them at the compute dtype.
    prefetch: naive / hybrid read the next layer's streamed rows while this one
      computes (one more streaming buffer in the budget); flash reads a layer's
      missing neurons while the FFN computes on its cached ones.
    Returns (model, tokenizer) like mlx_lm.load.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from .models import model_args
    from .store import DenseStore

    if options:
        raise TypeError(f"unknown load() options: {', '.join(options)}")
    folder = resolve_model_path(path_or_repo, progress=progress)
    manifest = read_manifest(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise FlashError(f"{folder}/config.json: unreadable ({e})")
    family, args = model_args(config)
    dtype = dtype or default_compute_dtype(manifest.dtype)
    if dtype not in DTYPES:
        raise FlashError(f"unsupported compute dtype '{dtype}' (choose from {', '.join(DTYPES)})")

    held = _held_dtype(resident_dtype, manifest.dtype, dtype)
    # The tokenizer first: its load peaks ~30 MB above what it keeps, before the weights arrive.
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise FlashError(f"{folder}: cannot load the tokenizer ({e})")
    release_heap()
    model = family.Model(args)
    check_file(folder, manifest.resident, checksum=verify)
    if memory_budget is not None and mode != "dense":  # dense says what it needs instead
        _check_resident_fits(folder, manifest, DTYPES[dtype], memory_budget, held)
    try:
        weights = mx.load(str(folder / manifest.resident["file"]))
    except Exception as e:
        raise FlashError(f"{folder / manifest.resident['file']}: unreadable ({e})")
    converted = {}
    for k in list(weights):  # one tensor at a time: the file's copy of all of them never lives at once
        converted[k] = weights.pop(k)
        if held is None or converted[k].ndim != 2:  # 2-D: weights a held model may keep as they are
            converted[k] = converted[k].astype(DTYPES[dtype])
        mx.eval(converted[k])
    weights = converted
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise FlashError(f"{folder}: resident weights do not match the model ({e})")
    itemsize = mx.zeros((), DTYPES[dtype]).itemsize
    resident_compute_bytes = sum(v.size * itemsize for v in weights.values())  # what "50%" is of
    if held is not None:
        from .models.ffn import FlashFFN
        from .models.half import hold_at_16_bits

        arena = hold_at_16_bits(model, held, DTYPES[dtype], skip=(FlashFFN,))
        weights = dict(tree_flatten(model.parameters())) | {"<float32 arena>": arena.array}
    mx.eval(model.parameters())
    # The file's float16 buffers, freed by the conversion, stay in MLX's buffer
    # cache: give them back. Under a budget, also keep that cache small while
    # decoding (the budget counts weights; the process's other memory is what
    # a memory limit leaves for activations, the KV cache and this cache).
    mx.clear_cache()
    if memory_budget is not None:
        mx.set_cache_limit(BUDGET_CACHE_LIMIT)

    model.flash = {"folder": folder, "manifest": manifest, "dtype": dtype, "mode": mode,
                   "resident_dtype": resident_dtype if held is not None else dtype,
                   "resident_compute_bytes": resident_compute_bytes,
                   # dense / hybrid hold their resident FFN rows at float16 too (NumPy has no
                   # bfloat16: a bfloat16 model's FFN rows stay at the compute dtype)
                   "held_ffn": held is not None and held == mx.float16}
    if mode == "dense":
        from .plan import make_plan, parse_budget

        resident = sum(v.nbytes for v in weights.values())
        lay = manifest.layout
        neuron_bytes = len(lay.kinds) * lay.d_model * mx.zeros((), DTYPES[dtype]).itemsize
        budget = parse_budget(memory_budget, resident_compute_bytes
                              + neuron_bytes * lay.n_neurons * len(manifest.ffn_files))
        held_ffn = model.flash["held_ffn"]
        make_plan("dense", budget, resident, 0, neuron_bytes, len(manifest.ffn_files), lay.n_neurons,
                  held_neuron_bytes=neuron_bytes // 2 if held_ffn else 0)
        from tqdm import tqdm

        bar = tqdm(total=len(manifest.ffn_files), desc="load ffn", disable=not progress, leave=False)
        store = DenseStore(folder, manifest, DTYPES[dtype], verify=verify, progress=bar, held=held_ffn)
        bar.close()
        model.flash["budget_bytes"] = budget
    else:
        from .sparse_loader import make_flash_store

        store = make_flash_store(model, folder, manifest, DTYPES[dtype], weights, mode, sparsity,
                                 density, memory_budget, window, threads, verify,
                                 dip_options={"gamma": gamma, "eviction": eviction}, prefetch=prefetch,
                                 overlap=prefetch)
    for layer in model.layers:
        layer_ffn(layer).store = store
    model.flash["store"] = store
    model.eval()
    return model, tokenizer


def release_heap():
    """Give the C heap's free pages back to the system (glibc keeps them): loading the
    tokenizer parses a large JSON whose ~30 MB, freed, otherwise stay in the process's
    RSS, which a memory limit counts. A no-op where there is no glibc (macOS)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _held_dtype(resident_dtype, flash_dtype, compute_dtype):
    """The MLX dtype resident weights are held at, or None for the compute dtype."""
    if resident_dtype in (None, compute_dtype):
        return None
    from .models.half import HELD_DTYPES

    if resident_dtype not in HELD_DTYPES:
        raise FlashError(f"unsupported resident dtype '{resident_dtype}' (choose from "
                         f"{', '.join(HELD_DTYPES)}, or the compute dtype {compute_dtype})")
    if compute_dtype != "float32":
        raise FlashError(f"--resident-dtype {resident_dtype} needs float32 compute (got {compute_dtype})")
    if resident_dtype != flash_dtype:
        raise FlashError(f"--resident-dtype {resident_dtype}: the model is {flash_dtype} on flash; holding "
                         f"it at another 16-bit dtype would round it (choose {flash_dtype} or float32)"
                         if flash_dtype in HELD_DTYPES else
                         f"--resident-dtype {resident_dtype}: the model is {flash_dtype} on flash; holding "
                         f"it at 16 bits would round it (convert it with --dtype {resident_dtype})")
    return HELD_DTYPES[resident_dtype]


def _check_resident_fits(folder, manifest, dtype, memory_budget, held=None):
    """Refuse a budget the resident weights alone exceed, from the file's header, before
    reading them (else the process can be killed by a memory limit before the planner speaks)."""
    import numpy as np

    from .layout.safetensors_io import SafetensorsFile
    from .plan import parse_budget
    from .plan.budget import _too_small

    st = SafetensorsFile(folder / manifest.resident["file"])
    itemsize = mx.zeros((), dtype).itemsize
    held_size = itemsize if held is None else mx.zeros((), held).itemsize
    sizes = [(int(np.prod(st.shape(n))), len(st.shape(n))) for n in st.names()]
    resident = sum(size * (held_size if ndim == 2 else itemsize) for size, ndim in sizes)
    full = sum(size for size, _ in sizes) * itemsize  # what "50%" is of
    lay = manifest.layout
    ffn = len(lay.kinds) * lay.d_model * lay.n_neurons * len(manifest.ffn_files) * itemsize
    budget = parse_budget(memory_budget, full + ffn)
    if budget < resident:
        raise FlashError(_too_small(budget, resident))


def layer_ffn(layer):
    """The FlashFFN of a transformer block, whatever the family calls it."""
    from .models.ffn import FlashFFN

    for name in ("mlp", "ffn", "feed_forward"):
        if name in layer and isinstance(layer[name], FlashFFN):
            return layer[name]
    raise FlashError(f"{type(layer).__name__} has no FlashFFN")

"""load(): a converted flash folder (or anything convertible) -> (model, tokenizer).

Top to bottom: resolve the path, read the manifest, build the model with its
resident weights, build the runtime from the config (runtime/build.py).
"""

import json
import logging
import sys
import threading
import weakref
from dataclasses import replace
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .errors import BudgetTooSmall, FlashError
from .home import default_home
from .layout.format import MANIFEST, check_file, is_flash_folder, read_manifest
from .layout.schema import missing_parts
from .io.files import log_once
from .kernels import kernels_module
from .models.quantized import dequantize_modules, quantized_modules, use_native_kernels
from .plan.explain import explain
from . import plan
from .plan.fit import fit_limit, fit_weights
from .plan.profile import load_profile
from .runtime.memory import (DEFAULT_CONTEXT, MLX_CACHE_LIMIT, check_limit_before_loading, flash_kv_caches,
                             kv_caches, kv_value_bytes, model_shape, plan_memory, trim_heap)
from .runtime import (DTYPES, FlashConfig, ResidentWeights, build_runtime, compute_dtype, embedding_on_flash,
                      head_on_flash, keep_quantized, loaded_resident_bytes, make_config)



def resolve_model_path(path_or_repo, convert_dtype="float16", progress=True):
    """A flash folder as is; anything else is converted once into MLX_FLASH_HOME."""
    p = Path(str(path_or_repo)).expanduser()
    if p.is_dir() and is_flash_folder(p):
        return p
    from .convert import convert
    from .convert.sources import CONVERT_HINT, check_not_flash_folder

    if p.is_dir():  # a folder to convert: not a conversion's leftovers, and a model's config.json
        check_not_flash_folder(p)
        if not (p / "config.json").is_file():
            raise FlashError(f"{p} has no manifest.json: not an mlx_flash model folder, and no config.json: "
                             f"not a Hugging Face or mlx-lm model folder to convert either; convert a model "
                             f"with {CONVERT_HINT}")

    slug = str(path_or_repo).strip("/").replace("/", "--").replace(".", "_")
    out = default_home() / "models" / f"{slug}-{convert_dtype}"
    if is_flash_folder(out):
        return out
    return convert(path_or_repo, out, dtype=convert_dtype, progress=progress)


def load(path_or_repo, progress=False, config=None, context_of=None, **options):
    """Load a model for generation; returns (model, tokenizer) like mlx_lm.load.

    path_or_repo: a converted mlx_flash folder, or a Hub repo id / HF folder /
      mlx-lm folder / .gguf file (converted once into $MLX_FLASH_HOME).
    options: FlashConfig's fields (runtime/config.py), e.g. dtype (compute dtype:
      float32 on the CPU by default), verify (sha256 of every file), mode (dense |
      naive | hybrid | flash), sparsity and density (flash mode's source and kept
      fraction), memory_budget ("50%" of the model's weights or "4GB"), window,
      threads, gamma / eviction (DIP-CA), resident_dtype (hold embeddings and
      attention at the flash's 16-bit dtype, converted before use; a quantized
      model's are held at their bits, or dequantized with "float32"), prefetch.
      Or a whole FlashConfig as `config`.
    context_of: under a memory limit with no ctx_size, a function of the loaded tokenizer -> the
      tokens the plan holds a KV cache for (generate: its prompt's and max_tokens), called first.
    The model carries its runtime as `model.runtime` (stats(), plan, store).
    """
    config = config or make_config(options)
    # --explain's machine profile, the cached one (generate --explain measures it first when
    # none is: cli/generate.py; `mlx_flash.benchmark profile` from Python)
    profile = load_profile() if config.explain else None
    folder = resolve_model_path(path_or_repo, progress=progress)
    manifest = read_manifest(folder)
    if manifest.experts:  # a mixture of experts: its own runtime (runtime/moe.py)
        return _load_moe(folder, manifest, config, context_of)
    asked = config
    model, tokenizer, resident, config, memory = _build_model(folder, manifest, asked, context_of)
    try:  # (the plan fitted before the weights loaded: fit_weights / fit_limit; a batch: auto prices its step)
        runtime = build_runtime(model, folder, manifest, config, resident, progress=progress,
                                batch=asked.batch_size, planner=plan)
    except BudgetTooSmall as e:
        raise (e if memory is None else memory.restate(e)) from None
    runtime.memory = memory
    if runtime.choice is not None and runtime.budget_bytes is not None and not config.explain:
        # (no limit: dense, which --explain says; with it, its first line says this)
        logging.getLogger("mlx_flash").warning("%s", runtime.choice.describe())
    if config.explain:
        print(explain(runtime, profile), file=sys.stderr)
    if config.kv_bits is not None:
        _check_kv_groups(model, config.kv_group_size)
    _set_caches(model, runtime, config, memory, asked.ctx_size)
    model.eval()
    return delivered(model, folder), tokenizer


_LOADED = []  # (a weak reference to a model load() returned, its folder)
_LOADED_LOCK = threading.Lock()


def delivered(model, folder):
    """A model load() returns, remembered by a weak reference (a later load under a limit names it
    while something references it: loaded_before), after the load's temporaries are given back
    (else they stay in the RSS a limit counts). -> model."""
    with _LOADED_LOCK:
        _LOADED[:] = [(r, f) for r, f in _LOADED if r() is not None] + [(weakref.ref(model), str(folder))]
    release_heap()
    return model


def forget_loaded(model):
    """Not to be named by loaded_before: a model meant to stay beside the next (a speculative
    draft, loaded first so that its memory counts in the target's limit)."""
    with _LOADED_LOCK:
        _LOADED[:] = [(r, f) for r, f in _LOADED if r() is not None and r() is not model]


def loaded_before():
    """The folders of the models load() returned in this process that something still
    references (a script's variable, closed or not): their weights and caches are in this
    process's memory, which the next load under a limit measures as its runtime. Collects
    first: one dropped but not yet collected is not one."""
    import gc

    if not _LOADED:
        return []
    gc.collect()
    with _LOADED_LOCK:
        return [f for r, f in _LOADED if r() is not None]


def _set_caches(model, runtime, config, memory, ctx_size):
    """model.make_cache (mlx_lm's make_prompt_cache uses it): the KV cache on flash, or mlx_lm's
    caches allocated once for the plan's context (quantized with --kv-bits)."""
    if (memory is not None and memory.kv_on_flash) or config.kv_cache == "flash":
        context = memory.context if memory is not None else (ctx_size or DEFAULT_CONTEXT)
        model.make_cache = partial(flash_kv_caches, model, runtime, context)
    elif config.kv_bits is not None or memory is not None:
        model.make_cache = partial(kv_caches, len(model.layers), memory.context if memory is not None else None,
                                   config.kv_bits, config.kv_group_size)


def _check_kv_groups(model, group_size):
    """--kv-bits quantizes each head's keys and values in groups along the head dimension."""
    head_dim = getattr(getattr(model.layers[0], "self_attn", None), "head_dim", None)
    if head_dim is not None and head_dim % group_size:
        raise FlashError(f"--kv-group-size {group_size} does not divide the model's head dimension ({head_dim}): "
                         "choose 32, 64 or 128 that does")


def _model_and_tokenizer(folder, manifest, config, loaded_bytes):
    """config.json -> (the family's model, its resident modules quantized as config.json says but no
    weights loaded yet; the tokenizer; ModelArgs). Under --memory-limit, a limit that cannot hold the
    runtime, the tokenizer's load and `loaded_bytes()` of the resident file is an error first."""
    from .models import model_args
    from .tokenizer import load_tokenizer

    try:
        model_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise FlashError(f"{folder}/config.json: unreadable ({e})")
    if not isinstance(model_config, dict):
        raise FlashError(f"{folder}/config.json: not a JSON object; convert the model again")
    family, args = model_args(model_config)
    check_complete(folder, manifest, model_config)
    if config.memory_limit is not None:  # (a limit too small: an error here, not a kill while loading)
        earlier = loaded_before()  # (first: it collects what was dropped, before the RSS is measured)
        check_limit_before_loading(config.memory_limit, loaded_bytes(), earlier, folder)
    # The tokenizer first: its load peaks far above what it keeps (memory.tokenizer_load), before the
    # weights arrive.
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=model_config.get("eos_token_id"))
    except Exception as e:
        raise FlashError(f"{folder}: cannot load the tokenizer ({e})")
    model = family.Model(args)
    quantize_resident(model, model_config.get("quantization"), folder)
    check_file(folder, manifest.resident, checksum=config.verify)
    release_heap()  # (the tokenizer's temporaries, and the checksum's buffer: 8 MB the heap had kept)
    return model, tokenizer, args


def check_complete(folder, manifest, model_config):
    """The manifest lists every layer and weight kind (the experts) config.json describes."""
    missing = missing_parts(manifest, model_config)
    if missing:
        raise FlashError(f"{folder / MANIFEST}: {'; '.join(missing)}: the folder is incomplete; convert the "
                         "model again (mlx_flash.verify checks a whole folder)")


def _with_context(config, tokenizer, context_of):
    """Under a memory limit with no ctx_size: the context load()'s context_of counts with the tokenizer."""
    if context_of is not None and config.memory_limit is not None and config.ctx_size is None:
        return replace(config, ctx_size=context_of(tokenizer))
    return config


def _build_model(folder, manifest, config: FlashConfig, context_of=None):
    """The model with its resident weights (embeddings, attention, norms) in DRAM, and the tokenizer."""
    dtype = compute_dtype(config, manifest)
    held = config.held_dtype(manifest.dtype, dtype)
    model, tokenizer, _ = _model_and_tokenizer(folder, manifest, config,
                                               lambda: loaded_resident_bytes(folder, manifest, config))
    config = _with_context(config, tokenizer, context_of)
    memory = None
    if config.memory_limit is None:
        config, held, streamed, lines = fit_weights(folder, manifest, config, held)
    else:  # what the process holds besides weights, off the limit
        shape = model_shape(model, manifest.layout.d_model, manifest.layout.n_neurons)
        memory, config, held, streamed, lines = fit_limit(folder, manifest, config, held, shape,
                                                           DTYPES[dtype].size)
        lines.insert(0, memory.describe())
    for line in lines:
        logging.getLogger("mlx_flash").warning("%s", line)
    if streamed:
        from .models.quantized import stream_modules

        stream_modules(model, {i: list(s.matrices) for i, s in streamed.items()})
    table = embedding_on_flash(folder, manifest, config)  # (the input embedding left on flash, or None)
    if table is not None:
        from .models.quantized import stream_embedding

        stream_embedding(model, table.module, table.n_rows, table.dims)
    head = head_on_flash(folder, manifest, config)  # (the output head left on flash, or None)
    if head is not None:
        from .models.quantized import stream_head

        stream_head(model, head.n_rows, head.dims)
    gone = {n for s in streamed.values() for n in s.names} | (table.names if table is not None else set()) | (
        head.names if head is not None else set())
    weights, streamed_bytes = _load_resident(model, folder, manifest, DTYPES[dtype], held, gone)
    quantized = bool(quantized_modules(model))
    if quantized and held is not None:
        raise FlashError(f"--resident-dtype {config.resident_dtype}: {folder}'s resident weights are "
                         f"quantized; hold them at their bits (quantized) or at {dtype}")
    if not quantized and config.resident_dtype == "quantized":
        raise FlashError(f"--resident-dtype quantized: {folder}'s resident weights are not quantized "
                         "(convert it with --quantize)")
    on_cpu = mx.default_device() == mx.cpu
    if quantized and not keep_quantized(config, on_cpu):
        dequantize_modules(model, DTYPES[dtype])
        weights = dict(tree_flatten(model.parameters()))
        quantized = False
    elif quantized and on_cpu:
        arena = _on_native_kernels(model, dtype)
        if arena is not None:
            weights = dict(tree_flatten(model.parameters())) | {"<float32 arena>": arena.array}
    compute_bytes = streamed_bytes + sum(v.size * (DTYPES[dtype].size if mx.issubdtype(v.dtype, mx.floating)
                                                   else v.itemsize) for v in weights.values())  # what "50%" is of
    if held is not None:
        from .models.ffn import FlashFFN
        from .models.half import hold_at_16_bits

        arena = hold_at_16_bits(model, DTYPES[held], DTYPES[dtype], skip=(FlashFFN,),
                                kernels=_half_kernels(dtype, on_cpu))
        weights = dict(tree_flatten(model.parameters())) | {"<float32 arena>": arena.array}
    _settle(model, config)
    parameters = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    resident = ResidentWeights(sum(v.nbytes for v in weights.values()), compute_bytes, parameters, quantized)
    return model, tokenizer, resident, config, memory


def _load_moe(folder, manifest, config, context_of=None):
    """A mixture-of-experts model: its resident weights (router, attention, embeddings, shared
    experts) in DRAM, its experts in an expert buffer (runtime/moe.py) of what --memory-budget,
    or --memory-limit less the runtime, the KV cache and the prompt's temporaries, leaves."""
    from .layout.experts import expert_bits
    from .runtime.moe import build_moe_runtime, check_moe_config, read_buffers

    check_moe_config(config)
    dtype = compute_dtype(config, manifest)
    model, tokenizer, args = _model_and_tokenizer(folder, manifest, config, lambda: manifest.resident["size"])
    config = _with_context(config, tokenizer, context_of)
    memory = None
    if config.memory_limit is not None:  # (measured before the weights load: they are in the budget)
        shape = model_shape(model, args.hidden_size, args.num_experts_per_tok * args.d_expert)
        memory = plan_memory(config.memory_limit, shape, DTYPES[dtype].size, config.ctx_size,
                             kv_itemsize=kv_value_bytes(DTYPES[dtype].size, config.kv_bits, config.kv_group_size))
        logging.getLogger("mlx_flash").warning("%s", memory.describe())
        _, buffers = read_buffers(manifest.experts["layout"], config.threads, expert_bits(manifest.experts) is not None)
        if memory.weights - buffers <= 0:
            raise FlashError(f"--memory-limit {memory.limit / 1e6:.0f} MB: the expert reader's buffers "
                             f"({buffers / 1e6:.0f} MB) leave nothing for the weights: raise --memory-limit")
        logging.getLogger("mlx_flash").warning("of the weights' share, %.0f MB are the expert reader's buffers",
                                               buffers / 1e6)
        config = replace(config, memory_limit=None, memory_budget=str(memory.weights - buffers), ctx_size=None)
    weights, _ = _load_resident(model, folder, manifest, DTYPES[dtype])
    del weights
    held = "quantized" if quantized_modules(model) else dtype
    if held == "quantized" and mx.default_device() == mx.cpu:  # as a dense model's (_build_model)
        _on_native_kernels(model, dtype)
    _settle(model, config)
    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    try:
        model.runtime = build_moe_runtime(model, folder, manifest, config, resident, held)
    except BudgetTooSmall as e:
        raise (e if memory is None else memory.restate(e)) from None
    model.runtime.memory = memory
    _set_caches(model, model.runtime, config, memory, None)
    model.eval()
    return delivered(model, folder), tokenizer


def _load_resident(model, folder, manifest, dtype, held=None, gone=frozenset()):
    """The resident file's weights into `model` (dense and mixture loaders alike), one tensor at a
    time (the file's copy of all of them never lives at once): floating ones at the compute dtype,
    except the 2-D weights a model held at 16 bits keeps as stored (`held`; their quantized ones'
    scales are converted). `gone`: names left on flash, never read (mx.load is lazy).
    -> ({name: array loaded}, the bytes of those left on flash at the compute dtype)."""
    try:
        weights = mx.load(str(folder / manifest.resident["file"]))
    except Exception as e:
        raise FlashError(f"{folder / manifest.resident['file']}: unreadable ({e})")
    loaded, streamed_bytes = {}, 0  # (the streamed ones' bytes at the compute dtype: part of what "50%" is of)
    for k in list(weights):
        v = weights.pop(k)
        floating = mx.issubdtype(v.dtype, mx.floating)
        if k in gone:
            streamed_bytes += v.size * (dtype.size if floating else v.itemsize)
            continue
        if floating and (held is None or v.ndim != 2 or k.endswith((".scales", ".biases"))):
            v = v.astype(dtype)  # (else quantized weights' packed words, or a 16-bit weight held so)
        mx.eval(v)
        loaded[k] = v
    try:
        model.load_weights(list(loaded.items()), strict=True)
    except ValueError as e:
        raise FlashError(f"{folder}: resident weights do not match the model ({e})")
    return loaded, streamed_bytes


def _settle(model, config):
    """The loaded weights evaluated; the file's buffers, freed by their conversion, given back from
    MLX's buffer cache. Under a budget that cache is also kept small while decoding (the budget counts
    weights; the process's other memory is what a memory limit leaves for activations, the KV cache
    and this cache)."""
    mx.eval(model.parameters())
    mx.clear_cache()
    if config.memory_budget is not None:
        mx.set_cache_limit(MLX_CACHE_LIMIT)


def _half_kernels(dtype, on_cpu):
    """The native module whose gather_mv multiplies a decode step's 16-bit held rows (gather_mm a
    batch's step; the CPU, float32 compute), or None (said once where it is not built: each weight is then converted into a
    float32 arena for BLAS every token, ~6x slower at SmolLM2's size here)."""
    if not on_cpu or dtype != "float32":
        return None
    kernels, why = kernels_module()
    if kernels is None:
        log_once("half-kernels", "mlx_flash: weights held at 16 bits are converted into float32 for BLAS at every "
                 "use (the native kernels would read them as they are): %s", why)
    return kernels


def _on_native_kernels(model, dtype):
    """A quantized model's resident modules onto the native kernels (the CPU) -> their arena, or None
    (said once) where the kernels are not built."""
    kernels, why = kernels_module()
    if kernels is None:
        log_once("qmv", "mlx_flash: quantized weights held at their bits go through MLX's quantized "
                 "matmul on the CPU, 2x (decode) to 50x (prompt) slower than float32: %s", why)
        return None
    return use_native_kernels(model, kernels, DTYPES[dtype])


def quantize_resident(model, quantization, folder):
    """Turn the modules config.json's `quantization` names (mlx-lm's form: one entry per
    quantized module, written by convert) into MLX quantized modules, held at their bits
    and computed by MLX's quantized matmul."""
    if not quantization:
        return
    import mlx.nn as nn

    from .models.ffn import FlashFFN

    named = {k: v for k, v in quantization.items() if isinstance(v, dict)}

    def predicate(path, module):
        if isinstance(module, FlashFFN) or path not in named:
            return False
        if not hasattr(module, "to_quantized"):
            raise FlashError(f"{folder}/config.json: {path} is quantized, but the model's "
                             f"{type(module).__name__} cannot be")
        return {"group_size": named[path]["group_size"], "bits": named[path]["bits"]}

    nn.quantize(model, class_predicate=predicate)


def release_heap():
    """Give freed memory back to the system: MLX's buffer cache, and the C heap's free pages
    (glibc keeps them; a no-op where there is no glibc: macOS). Loading the tokenizer parses
    a large JSON whose ~30 MB, freed, otherwise stay in the process's RSS, which a memory
    limit counts; so would a model loaded before this one in the same process and closed
    (a server's, a script's), measured as this one's runtime: 119, then 165, then 179 MB
    at three loads of SmolLM2 under 350 MB, each closed before the next."""
    import gc

    gc.collect()
    mx.clear_cache()
    trim_heap()

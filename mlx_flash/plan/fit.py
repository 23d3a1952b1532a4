"""What a memory limit or budget leaves the weights, decided before they load (the loader
calls these; loader.py then loads what they chose).

fit_weights: the resident weights' dtype under a budget, whether the input embedding and which
layers' attention stay on flash. fit_limit: --memory-limit's plan (runtime/memory.py): where the KV
cache lives, the prompt chunks, the weights' budget. Each is decided once, from the files' headers:
the loader then loads what they chose, and builds the runtime once.
"""

from dataclasses import replace

import mlx.core as mx

from ..errors import BudgetTooSmall, FlashError
from ..kernels import kernels_module
from ..runtime import (attention_to_stream, check_resident_fits, dense_need, dip_flash, embedding_on_flash,
                       embedding_to_stream, head_may_stream, head_on_flash, may_hold_float16)
from ..runtime.budget import over_budget
from ..runtime.memory import kv_value_bytes, plan_memory


def may_hold_at_16_bits(config, manifest):
    """--mode auto, no sparse mode asked for, may hold a float16 model's resident weights at
    float16 (runtime.may_hold_float16): from the start where the native kernels multiply 16-bit
    rows, else only when a budget leaves no plan at float32 (fit_weights)."""
    return config.mode == "auto" and not config.sparse_options and may_hold_float16(config, manifest)


def fit_weights(folder, manifest, config, held):
    """What the budget leaves the resident weights, decided before they load (no line said
    yet: the caller says them for the placement it keeps). -> (config, held dtype,
    {layer: LayerSpan} of streamed attention, lines to say); raises BudgetTooSmall.

    --mode auto, a float16 model computed in float32: its weights are held at float16 as stored
    where the native kernels multiply them (the CPU); elsewhere its
    resident weights (embeddings, attention) when at float32 they do not fit the weights' share
    (converted before use, exact), or at float32 leave no FFN plan room beside them. Under a budget the whole model does not fit, an untied input
    embedding table stays on flash, a pass reading its tokens' rows (runtime.embedding_to_stream:
    the config returned says stream_embeddings "on" or "off"); where the resident weights of a
    quantized model then leave too little, some layers' attention too, read every token
    (runtime.attention_to_stream); where every layer's would not be enough, an untied, quantized
    output head first (stream_head "on": read every pass, chunk by chunk), then the fewest layers'."""
    lines = []
    may_hold_16 = may_hold_at_16_bits(config, manifest)
    if may_hold_16 and mx.default_device() == mx.cpu and kernels_module()[0] is not None:
        # (float16 SmolLM2, no limit: decode 26.7-28.7 tok/s against 15.8-17.5 held at float32,
        # prompt 272-287 against 284-296 tok/s, MLX's peak 0.15 against 0.56 GB)
        lines.append("--mode auto: the weights held at float16 as stored: the native kernels multiply them as "
                     "they are (the same sums as at float32, in half the DRAM, a decode step faster; a prompt "
                     "converts them into a float32 arena; --resident-dtype float32 holds them at float32)")
        config, held = replace(config, resident_dtype="float16"), "float16"
    elif may_hold_16 and config.memory_budget is not None:
        try:
            check_resident_fits(folder, manifest, config)
        except BudgetTooSmall as e:
            lines.append(f"--mode auto: {e.reason}; held at float16 as stored instead (converted into a "
                         "float32 arena before use: the same values)")
            config, held = replace(config, resident_dtype="float16"), "float16"
    config = replace(config, stream_embeddings="on" if embedding_to_stream(folder, manifest, config) else "off")
    table = embedding_on_flash(folder, manifest, config)
    if table is not None:
        lines.append(f"the input embeddings ({table.nbytes / 1e6:.0f} MB, not tied to the output head) stay on "
                     f"flash: each pass reads its tokens' rows ({table.row_bytes} bytes a token, checked)")
    try:
        streamed = attention_to_stream(folder, manifest, config)
    except BudgetTooSmall:
        if not head_may_stream(folder, manifest, config):
            raise
        config = replace(config, stream_head="on")  # (the next weight left on flash, then the fewest layers)
        streamed = attention_to_stream(folder, manifest, config)
    if config.stream_head == "auto":
        config = replace(config, stream_head="off")
    head = head_on_flash(folder, manifest, config)
    if head is not None:
        lines.append(f"the output head ({head.nbytes / 1e6:.0f} MB) stays on flash: each pass reads it, chunk "
                     "by chunk while the kernels multiply the chunk before (its bytes read every token; "
                     "--stream-head off holds it)")
    if streamed:
        layers = sorted(streamed)
        mb = sum(s.nbytes for s in streamed.values()) / 1e6
        lines.append(f"the resident weights leave too little of the budget for the FFN: the attention of "
                     f"{len(streamed)} layers ({_ranges(layers)}; {mb:.0f} MB) stays on flash, read every token")
    try:
        check_resident_fits(folder, manifest, config, streamed)
    except BudgetTooSmall as e:
        if config.mode == "auto" or not may_hold_float16(config, manifest):
            raise
        hint = (", or hold the resident weights at float16 as stored with --resident-dtype float16 (half "
                "their DRAM, the same values)")  # (an explicit mode keeps the compute dtype unless told)
        raise BudgetTooSmall(str(e), e.budget, e.needed, e.reason, hint) from None
    return config, held, streamed, lines


def fit_limit(folder, manifest, config, held, shape, itemsize):
    """--memory-limit -> (MemoryPlan, config with its weights budget, held, streamed, lines).
    The KV cache in DRAM, or (--kv-cache flash, or auto where in DRAM it leaves the weights too
    little) on flash, read back every token; each with the prompt chunks the plan's rule chose,
    and only where neither fits so, shorter chunks (a prompt then reads the streamed weights more
    often). The runtime is measured once, for every plan tried."""
    kv_itemsize = kv_value_bytes(itemsize, config.kv_bits, config.kv_group_size)
    if dip_flash(config, manifest):  # (its prompt chunks' temporaries: runtime/memory.py activation_bytes)
        shape = replace(shape, dip_prompt=True)
    if config.kv_cache == "auto" and config.kv_bits is None and config.batch_size == 1:
        places = (False, True)
    else:
        places = (config.kv_cache == "flash",)
    rules, nothing, baseline = [], None, None  # each placement's plan at the rule's chunk
    for on_flash in places:
        try:
            rules.append(plan_memory(config.memory_limit, shape, itemsize, config.ctx_size, baseline,
                                     kv_itemsize=None if on_flash else kv_itemsize, kv_on_flash=on_flash,
                                     batch=config.batch_size, warn=on_flash == places[0]))
            baseline = rules[-1].baseline  # (one runtime measured for every plan)
        except FlashError as e:
            nothing = e  # (the KV cache in DRAM leaves the weights nothing; on flash, if tried, may not)
    if not rules:
        raise nothing
    if len(rules) == 2 and rules[1].most_weights <= rules[0].most_weights:
        rules.pop()  # (a short context: the KV cache on flash's buffers and chunks take more than in DRAM)
    failed = {}  # placement -> (its rule's plan, BudgetTooSmall)
    rows16 = config.mode == "auto"  # (dense's float16-rows variant: auto's alone)
    for memory in rules + [p for rule in rules for p in rule.shorter_chunks()]:
        try:
            fitted, held_as, streamed, lines = fit_weights(folder, manifest, _budgeted(config, memory), held)
        except BudgetTooSmall as e:
            failed.setdefault(memory.kv_on_flash, (memory, e))
            continue
        # (--mode auto, or dense asked for: the whole model in DRAM wins over longer chunks)
        # (each placement's for an explicit dense, which goes on to the next where it does not fit)
        if config.mode in ("auto", "dense") and not config.sparse_options:
            dense = dense_need(folder, manifest, fitted, rows16)
            shorter = [p for p in memory.shorter_chunks() if p.weights >= dense]
            if memory.weights < dense and shorter:  # the whole model in DRAM wins over longer chunks
                refit = fit_weights(folder, manifest, _budgeted(config, shorter[0]), held)
                # (at the larger budget the resident weights may be held otherwise: dense then
                # needs what that says, and the longer chunks stay where it still does not fit)
                if dense_need(folder, manifest, refit[0], rows16) <= shorter[0].weights:
                    line = _chunk_line(shorter[0], memory, f"dense needs {dense / 1e6:.0f} MB")
                    memory, (fitted, held_as, streamed, lines) = shorter[0], refit
                    lines.insert(0, line)
        if config.mode == "dense" and not config.sparse_options:  # (asked for: where else does it fit?)
            need = dense_need(folder, manifest, fitted, rows16=False)
            if need > memory.weights:
                failed.setdefault(memory.kv_on_flash, (memory, over_budget("dense", need, memory.weights)))
                continue
        if memory.kv_on_flash in failed:
            first, e = failed[memory.kv_on_flash]
            lines.insert(0, _chunk_line(memory, first, e.reason))
        if memory.kv_on_flash and len(places) == 2:
            dram, e = failed.get(False, (None, nothing))
            why = (f"its {memory.context * shape.kv_per_token * itemsize / 1e6:.0f} MB leave the weights nothing"
                   if dram is None else f"it leaves the weights {dram.weights / 1e6:.0f} MB, and {e.reason}")
            lines.insert(0, f"the KV cache on flash (--kv-cache auto): held in DRAM for {memory.context} tokens, "
                            f"{why}; each token reads its keys and values back, up to "
                            f"{memory.context * shape.kv_per_token * itemsize / 1e6:.0f} MB at the full context")
        return memory, fitted, held_as, streamed, lines
    # (the default plan's shortfall, the KV cache in DRAM at the rule's chunk where it was tried: the
    # limit named then holds that plan)
    first, e = failed.get(False) or failed[True]
    raise first.restate(e)


def _budgeted(config, memory):
    """The config whose weights budget is the memory plan's (the plan holds the limit, the context
    and the batch from here)."""
    return replace(config, memory_limit=None, memory_budget=str(memory.weights), ctx_size=None, batch_size=1)


def _chunk_line(memory, longer, why):
    """The line that says `memory`'s prompt chunks are shorter than `longer`'s, and why."""
    return (f"prompt chunks of {memory.prefill_step} tokens, not {longer.prefill_step}: their temporaries at "
            f"{longer.prefill_step} ({longer.activations / 1e6:.0f} MB) leave the weights "
            f"{longer.weights / 1e6:.0f} MB, and {why}")


def _ranges(layers):
    shown = ", ".join(map(str, layers)) if len(layers) <= 8 else f"{', '.join(map(str, layers[:6]))}, ..., {layers[-1]}"
    return "layers " + shown

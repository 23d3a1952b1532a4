"""What one decode token does under a plan: the bytes it reads from flash and the bytes of each
weight form it multiplies by (Work). The runtime's own accounting of its plan; the cost model
(plan/cost.py) turns a Work into predicted milliseconds with the machine's profile."""

from dataclasses import dataclass

import mlx.nn as nn

from ..models.ffn import FlashFFN
from ..models.half import HalfEmbedding, HalfLinear
from ..models.quantized import NativeQuantizedEmbedding, NativeQuantizedLinear, StreamedQuantizedLinear


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


def resident_computed(model):
    """{form: bytes} of the resident matrices one token multiplies by (FFNs excluded)."""
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

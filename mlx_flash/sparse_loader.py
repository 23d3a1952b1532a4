"""Assemble the flash-mode runtime: plan the budget, build the source, the reader, the store."""

import numpy as np

import mlx.core as mx

from .errors import FlashError
from .flash_store import FlashStore
from .io import FlashReader
from .layout.format import check_file
from .plan import make_plan, parse_budget
from .sparsity import make_source
from .store import read_layer_file


def make_flash_store(model, folder, manifest, dtype, resident_weights, mode, sparsity, density,
                     memory_budget, window, threads, verify):
    from .loader import layer_ffn

    lay = manifest.layout
    n_layers = len(manifest.ffn_files)
    itemsize = mx.zeros((), dtype).itemsize
    neuron_bytes = len(lay.kinds) * lay.d_model * itemsize
    resident = sum(v.nbytes for v in resident_weights.values())
    model_bytes = resident + neuron_bytes * lay.n_neurons * n_layers
    budget = parse_budget(memory_budget, model_bytes)
    if verify:
        for e in manifest.ffn_files:
            check_file(folder, e, checksum=False)

    ffns = [layer_ffn(layer) for layer in model.layers]
    source = None
    if mode == "flash":
        def layer_weights(kinds):
            out = []
            for e in manifest.ffn_files:
                rows = read_layer_file(folder, e, lay, verify)
                out.append({k: mx.array(rows[k]).astype(dtype) for k in kinds})
                mx.eval(list(out[-1].values()))
            return out

        up_bias = [f.up_bias if "up_bias" in f else None for f in ffns]
        act = ffns[0]._act
        source = make_source(sparsity, density, layer_weights, act, ffns[0].gated, up_bias)
    plan = make_plan(mode, budget, resident, source.resident_bytes if source else 0, neuron_bytes,
                     n_layers, lay.n_neurons, window=window if window else 10**9)
    reader = FlashReader(threads=threads, direct=True)
    store = FlashStore(folder, manifest, plan, source, reader, dtype)
    model.flash.update(
        plan=plan, budget_bytes=budget, model_bytes=model_bytes, sparsity=sparsity if source else None,
        density=density if source else None,
    )
    return store

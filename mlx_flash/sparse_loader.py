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
                     memory_budget, window, threads, verify, dip_options=None, bundled=True,
                     prefetch=False, overlap=False):
    """sparsity: a source name, or a source object (`select`, `resident_bytes`), as the
    paper benchmark's trace source. window: None keeps every neuron (no limit); 0 keeps
    none from one token to the next (the paper's "predictor only" row).
    bundled=False reads each weight kind of a neuron separately (the paper's layout
    before row-column bundling). prefetch (naive, hybrid): read the next layer's
    streamed rows while this one computes (the paper's baselines do not). overlap
    (flash): read a layer's missing neurons while the FFN computes on its cached ones."""
    from .loader import layer_ffn

    lay = manifest.layout
    n_layers = len(manifest.ffn_files)
    itemsize = mx.zeros((), dtype).itemsize
    neuron_bytes = len(lay.kinds) * lay.d_model * itemsize
    resident = sum(v.nbytes for v in resident_weights.values())
    # "50%" is of the model at the compute dtype, however its resident part is held
    full = getattr(model, "flash", {}).get("resident_compute_bytes", resident)
    model_bytes = full + neuron_bytes * lay.n_neurons * n_layers
    budget = parse_budget(memory_budget, model_bytes)
    if verify:
        for e in manifest.ffn_files:
            check_file(folder, e, checksum=False)

    ffns = [layer_ffn(layer) for layer in model.layers]
    source = None
    if mode == "flash" and not isinstance(sparsity, str):
        source = sparsity
    elif mode == "flash" and sparsity in ("dip", "dip-ca"):
        return _dip_store(model, folder, manifest, dtype, itemsize, resident, budget, model_bytes,
                          ffns, sparsity, density, threads, dip_options or {})
    elif mode == "flash":
        def layer_weights(kinds):
            out = []
            for e in manifest.ffn_files:
                rows = read_layer_file(folder, e, lay, verify)
                out.append({k: mx.array(rows[k]).astype(dtype) for k in kinds})
                mx.eval(list(out[-1].values()))
            return out

        up_bias = [f.up_bias if "up_bias" in f else None for f in ffns]
        act = ffns[0]._act
        if sparsity == "predictor":
            from .sparsity import PredictorSource

            if not 0 < density <= 1:
                raise FlashError(f"--density must be in (0, 1], got {density}")
            source = PredictorSource(folder, manifest, density, dtype)
        else:
            source = make_source(sparsity, density, layer_weights, act, ffns[0].gated, up_bias)
    req = manifest.calibration.get("req")
    if req and mode == "flash":  # per-layer capacity from calibration: Req_i at this window
        k = min(8 if window is None else max(window, 1), max(req["windows"]))
        req = ([r[req["windows"].index(k)] for r in req["per_layer"]],
               max(r[0] for r in req["per_layer"]))  # Req_i(k), and the most one token needs
    else:
        req = None
    held = mode == "hybrid" and getattr(model, "flash", {}).get("held_ffn", False)
    plan = make_plan(mode, budget, resident, source.resident_bytes if source else 0, neuron_bytes,
                     n_layers, lay.n_neurons, window=10**9 if window is None else window, req=req,
                     held_neuron_bytes=neuron_bytes // 2 if held else 0, prefetch=prefetch)
    reader = FlashReader(threads=threads, direct=True)
    store = FlashStore(folder, manifest, plan, source, reader, dtype, bundled=bundled, overlap=overlap)
    name = sparsity if isinstance(sparsity, str) else getattr(sparsity, "name", "custom")
    model.flash.update(
        plan=plan, budget_bytes=budget, model_bytes=model_bytes, sparsity=name if source else None,
        density=density if source else None,
    )
    return store


def _dip_store(model, folder, manifest, dtype, itemsize, resident, budget, model_bytes, ffns,
               sparsity, density, threads, dip_options):
    from .dip_store import DIPStore

    if not ffns[0].gated or "up_bias" in ffns[0]:
        raise FlashError("--sparsity dip / dip-ca needs a gated (SwiGLU) FFN without biases")
    if not 0 < density <= 1:
        raise FlashError(f"--density must be in (0, 1], got {density}")
    if not manifest.dip:
        raise FlashError(f"{folder}: no DIP orientation on flash; convert again with `mlx_flash.convert --dip`")
    inp, down = manifest.dip["input"]["layout"], manifest.dip["down"]["layout"]
    k_in, k_out = max(1, round(density * inp.n_neurons)), max(1, round(density * down.n_neurons))
    dims = (inp.n_neurons, len(inp.kinds) * inp.d_model * itemsize, down.n_neurons,
            down.d_model * itemsize, k_in, k_out)
    lay = manifest.layout
    plan = make_plan("flash", budget, resident, 0, len(lay.kinds) * lay.d_model * itemsize,
                     len(manifest.ffn_files), lay.n_neurons, dip=dims)
    reader = FlashReader(threads=threads, direct=True)
    store = DIPStore(folder, manifest, plan, reader, ffns[0]._act, density,
                     cache_aware=sparsity == "dip-ca", dtype=dtype, **dip_options)
    model.flash.update(plan=plan, budget_bytes=budget, model_bytes=model_bytes, sparsity=sparsity,
                       density=density)
    return store

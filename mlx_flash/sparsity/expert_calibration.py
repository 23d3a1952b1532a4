"""mlx_flash.calibrate on a mixture of experts: the expert paths of calibration text (EdgeMoE
§3.3.2), for the path predictor (expert_paths.py). Apart from it so that the runtime, which
loads a predictor, does not import the calibration's text handling."""

import time

import numpy as np

from .expert_paths import ExpertPathPredictor


def calibrate_paths(model, tokenizer, data="c4", tokens=4096, seq_len=256, held_out=0.2, log=print):
    """Run calibration text through a loaded mixture of experts, recording each token's experts at
    every MoE layer -> (ExpertPathPredictor, {layers, tokens, the precision on the held-out last
    tokens of the counts of the first ones, the precision of always guessing the most used experts}).
    The predictor returned counts every token (measured first, then the held-out ones added)."""
    import mlx.core as mx

    from ..models.moe import on_route
    from .calibrate import token_sequences

    layers = sorted(model.expert_ffns())
    pos = {layer: i for i, layer in enumerate(layers)}
    seqs = token_sequences(tokenizer, data, tokens, seq_len)
    chosen = {}  # MoE layer position -> [inds of each call]
    off = on_route(model, lambda layer, x, inds, scores: chosen.setdefault(pos[layer], []).append(
        np.array(inds).reshape(-1, inds.shape[-1])))
    t0 = time.perf_counter()
    try:
        for i, seq in enumerate(seqs):
            mx.eval(model(mx.array([seq])))
            if (i + 1) % max(1, len(seqs) // 4) == 0:
                log(f"{i + 1}/{len(seqs)} sequences ({time.perf_counter() - t0:.0f} s)")
    finally:
        off()
    per_layer = [np.concatenate(chosen[p]) for p in range(len(layers))]  # [tokens, k] each
    paths = [[per_layer[p][t] for p in range(len(layers))] for t in range(per_layer[0].shape[0])]
    cut = int(len(paths) * (1 - held_out))
    n_experts, k = model.args.n_experts, per_layer[0].shape[1]
    predictor = ExpertPathPredictor(len(layers), n_experts).fit(paths[:cut])
    popular = ExpertPathPredictor(len(layers), n_experts)  # no pairs: the next layer's most used experts
    for p in range(len(layers) - 1):
        popular.counts[p] += np.bincount(per_layer[p + 1][:cut].reshape(-1), minlength=n_experts)[None, :]
    info = {"layers": layers, "tokens": len(paths), "held_out_tokens": len(paths) - cut, "data": data,
            "precision": predictor.precision(paths[cut:], k), "popular_precision": popular.precision(paths[cut:], k),
            "chance": k / n_experts}
    return predictor.fit(paths[cut:]), info

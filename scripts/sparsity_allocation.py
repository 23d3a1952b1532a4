"""Research script (issue 19): per-layer densities of the FFN's two sides, searched on
calibration text, against uniform densities, simulated densely.

    .venv/bin/python scripts/sparsity_allocation.py                       # SmolLM2, ~10 min here
    .venv/bin/python scripts/sparsity_allocation.py --tokens 4096 --eval-tokens 8192

What it simulates (per token, masks are functions of that token's own FFN input, as
DIP's are): the input side keeps the dims of x with |x| >= t_in (the gate/up columns
a token reads), the output side the neurons with |h| >= t_out (the down rows), h
computed from the pruned x. Thresholds are per layer and side, quantiles of the
dense |x| / |h| on the calibration tokens (C4, never the evaluation text), so a
side's density is its average share. FFN bytes per token: (2 d_in + d_out) / 3.

The search: greedy, one 0.05 step of one layer's side at a time, the step that adds
the least predicted loss per byte saved. Predicted loss of a layer's error dy (its
FFN output against the dense one): E[(g . dy)^2], g the gradient of the calibration
NLL with respect to that FFN output (an empirical-Fisher estimate, from one backward
pass); `--proxy abs` uses E|dy|^2 instead (TEAL's block-wise activation error, which
ignores how an error propagates). Every allocation of the search's path is written to
--json; WikiText-2 test perplexity of dense, uniform and searched densities is printed.
--low-rank R adds to every row (searched and uniform alike) a resident rank-R SVD of
gate and up that carries the pruned dims of x (scripts/sparsity_sides.py measures it alone).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx
import numpy as np

from mlx_flash.eval.harness import evaluate_perplexity
from mlx_flash.eval.tasks import load_text
from mlx_flash.models.ffn import FFNRows, layer_ffn
from mlx_flash.sparsity.allocation import record
from mlx_flash.sparsity.calibrate import calibration_texts

BYTES = np.array([2 / 3, 1 / 3])  # share of the FFN's bytes: gate+up columns, down rows
STEP = 0.05


def simulation(model_path, eval_tokens):
    """The research scripts' set-up: the model dense with float32 rows, each layer's rows
    ({layer: FFNRows}), and ppl() -> WikiText-2 test perplexity of the first eval_tokens
    (context 512) through whatever store the caller wraps in; prints the dense figure.
    -> (model, tokenizer, weights, ppl, dense perplexity)."""
    model, tok = mlx_flash.load(model_path, mode="dense", resident_dtype="float32", ffn_rows="float32")
    _, _, weights = record(model, [list(range(1, 258))], progress=False)
    text = load_text("wikitext")[0]

    def ppl():
        return evaluate_perplexity(model, tok, text, context=512, limit=eval_tokens)["metrics"]["perplexity"]

    dense = ppl()
    print(f"dense: WikiText-2 ppl {dense:.3f} ({eval_tokens} tokens)", flush=True)
    return model, tok, weights, ppl, dense


def low_rank(weights, rank):
    """Per layer {kind: (A [n, R], B [R, d])}: gate's and up's rank-R SVD, or None."""
    if not rank:
        return None
    out = {}
    for i, r in weights.items():
        out[i] = {}
        for k in ("gate", "up"):
            u, sv, vt = mx.linalg.svd(getattr(r, k), stream=mx.cpu)
            out[i][k] = (u[:, :rank] * sv[:rank], vt[:rank])
        mx.eval(out[i])
    return out


def gate_up(r, low, x, xs):
    """gate and up products of the pruned input xs (with low: the rest of x through the factors)."""
    g, u = xs @ r.gate.T, xs @ r.up.T
    if low is not None:
        rest = x - xs
        (ga, gb), (ua, ub) = low["gate"], low["up"]
        g, u = g + (rest @ gb.T) @ ga.T, u + (rest @ ub.T) @ ua.T
    return g, u


class Pruned:
    """The FFN with per-layer thresholds on both sides (the simulation)."""

    def __init__(self, weights, act, low):
        self.weights, self.act, self.low, self.th = weights, act, low, None

    def rows(self, layer, x):
        r, (t_in, t_out) = self.weights[layer], self.th[layer]
        xs = x * (mx.abs(x) >= t_in)
        g, u = gate_up(r, None if self.low is None else self.low[layer], x, xs)
        h = self.act(g) * u
        return FFNRows(up=None, down=r.down, h=h * (mx.abs(h) >= t_out))


def threshold(sorted_abs, density):
    """The value keeping `density` of the recorded magnitudes (0: keep all)."""
    if density >= 1:
        return 0.0
    return float(sorted_abs[min(len(sorted_abs) - 1, int(round((1 - density) * len(sorted_abs))))])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens (C4), in sequences of 256")
    p.add_argument("--eval-tokens", type=int, default=2048, help="WikiText-2 test tokens scored")
    p.add_argument("--targets", default="0.5,0.4", help="average FFN byte shares to evaluate")
    p.add_argument("--proxy", choices=("fisher", "abs"), default="fisher")
    p.add_argument("--low-rank", type=int, default=0,
                   help="R-Sparse-like: the pruned input dims through a resident rank-R SVD of gate / up")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    targets = [float(t) for t in a.targets.split(",")]

    t_start = time.perf_counter()
    model, tok = mlx_flash.load(a.model, mode="dense", resident_dtype="float32", ffn_rows="float32")
    ffns = [layer_ffn(layer) for layer in model.layers]
    n_layers, act = len(ffns), ffns[0]._act
    seqs = []
    for text in calibration_texts("c4"):
        ids = tok.encode(text)
        seqs += [ids[i : i + 257] for i in range(0, len(ids) - 256, 256)]
        if len(seqs) * 256 >= a.tokens:
            break
    seqs = seqs[: max(1, a.tokens // 256)]

    X, G, W = record(model, seqs, progress=False)
    H = [act(X[i] @ W[i].gate.T) * (X[i] @ W[i].up.T) for i in range(n_layers)]
    Y = [H[i] @ W[i].down for i in range(n_layers)]
    mx.eval(X, G, H, Y)
    low = low_rank(W, a.low_rank)
    abs_x = [np.sort(np.abs(np.array(x)).ravel()) for x in X]
    abs_h = [np.sort(np.abs(np.array(h)).ravel()) for h in H]
    print(f"recorded {len(seqs)} x 256 C4 tokens and their gradients in {time.perf_counter() - t_start:.0f} s",
          flush=True)

    def err(i, d_in, d_out):
        xs = X[i] * (mx.abs(X[i]) >= threshold(abs_x[i], d_in))
        g, u = gate_up(W[i], None if low is None else low[i], X[i], xs)
        h = act(g) * u
        h = h * (mx.abs(h) >= threshold(abs_h[i], d_out))
        dy = h @ W[i].down - Y[i]
        e = mx.sum(G[i] * dy, -1) ** 2 if a.proxy == "fisher" else mx.sum(dy * dy, -1)
        return float(mx.mean(e))

    t0 = time.perf_counter()
    dens = np.ones((n_layers, 2))
    cur = [err(i, 1, 1) for i in range(n_layers)]
    memo, path = {}, []
    lowest = min(targets) - 1e-9
    while float((dens * BYTES).sum(1).mean()) > lowest:
        best = None
        for i in range(n_layers):
            for side in (0, 1):
                if dens[i, side] <= STEP + 1e-9:
                    continue
                nd = dens[i].copy()
                nd[side] = round(nd[side] - STEP, 2)
                key = (i, *nd)
                if key not in memo:
                    memo[key] = err(i, *nd)
                cost = (memo[key] - cur[i]) / (STEP * BYTES[side])
                if best is None or cost < best[0]:
                    best = (cost, i, nd, memo[key])
        _, i, nd, e = best
        dens[i], cur[i] = nd, e
        path.append(dens.copy())
    print(f"searched {len(path)} steps ({len(memo)} layer evaluations) in {time.perf_counter() - t0:.0f} s",
          flush=True)

    def at(target):
        for d in path:
            if float((d * BYTES).sum(1).mean()) <= target + 1e-9:
                return d
        return path[-1]

    text = load_text("wikitext")[0]
    pr = Pruned(W, act, low)

    def ppl(d=None):
        if d is None:
            model.runtime.unwrap_store()
        else:
            pr.th = [(threshold(abs_x[i], d[i, 0]), threshold(abs_h[i], d[i, 1])) for i in range(n_layers)]
            model.runtime.wrap_store(lambda store: pr)
        return evaluate_perplexity(model, tok, text, context=512, limit=a.eval_tokens)["metrics"]["perplexity"]

    dense = ppl()
    rows = [{"config": "dense", "bytes": 1.0, "ppl": dense}]
    print(f"dense: WikiText-2 ppl {dense:.3f} ({a.eval_tokens} tokens)", flush=True)
    for target in targets:
        d = at(target)
        got = float((d * BYTES).sum(1).mean())
        for name, dd in ((f"searched ({a.proxy})", d), ("uniform", np.full((n_layers, 2), target)),
                         ("uniform, input side 2x output",
                          np.tile([3 * target / 2.5 * 1.0, 3 * target / 2.5 * 0.5], (n_layers, 1)))):
            dd = np.minimum(dd, 1.0)
            v = ppl(dd)
            b = float((dd * BYTES).sum(1).mean())
            rows.append({"config": name, "target": target, "bytes": b, "ppl": v, "ratio": v / dense,
                         "d_in": dd[:, 0].tolist(), "d_out": dd[:, 1].tolist()})
            print(f"{name:34s} bytes {b:.3f} ppl {v:.3f} x{v / dense:.3f}", flush=True)
        print("  searched d_in ", " ".join(f"{v:.2f}" for v in d[:, 0]), f"(bytes {got:.3f})")
        print("  searched d_out", " ".join(f"{v:.2f}" for v in d[:, 1]), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())

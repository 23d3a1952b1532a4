"""Research script (issue 19): which side of a SwiGLU FFN SmolLM2 can lose, with uniform
top-k densities, simulated densely; WikiText-2 test perplexity against dense.

    .venv/bin/python scripts/sparsity_sides.py            # ~6 min here (2 cores)

Rows (per token; d_in of x's dims, d_out of the neurons, top-k by score):
- "two-sided": input side top-k |x| (or WINA: |x_i| * ||[G; U][:, i]||), h from the
  pruned x, output side top-k |h| (or WINA: |h_j| * ||D_j||); FFN bytes (2 d_in + d_out) / 3.
- "one side": the same with the other side kept whole.
- "exact rows": neurons chosen by top-k |h~| (h~ from the pruned x), then their exact h
  from the whole x (their gate / up rows read too); bytes 2 d_in / 3 + d_out.
--low-rank R (R-Sparse's idea): the pruned dims of x still reach gate / up through a
resident rank-R SVD of each (g = G_S x_S + G_R (x - x_S)); only two-sided rows, and
the resident bytes are printed.
--rotate (LaRoSA's idea, arXiv 2507.01299): the input side's top-k is taken on z = Q_l^T x,
Q_l the eigenvectors of layer l's E[x x^T] on --calib-tokens C4 tokens (never the
evaluation text); gate / up then see Q_l z_kept (on flash: the columns of G Q_l, U Q_l).
Rows with and without the rotation, in one run; Q_l's resident bytes are printed.
"""

import argparse
import sys
import time

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx
import numpy as np

from mlx_flash.models.ffn import FFNRows, layer_ffn
from mlx_flash.sparsity.allocation import record
from mlx_flash.sparsity.calibrate import calibration_texts
from sparsity_allocation import gate_up, low_rank, simulation  # this folder's; run as a script


def top_k(scores, k):
    if k >= scores.shape[-1]:
        return mx.ones(scores.shape, dtype=mx.bool_)
    return scores >= mx.sort(scores, axis=-1)[..., -k][..., None]


# (name, d_in, d_out, WINA scores, exact rows)
ROWS = ([("two-sided", d_in, d_out, wina, False)
         for d_in, d_out in ((0.5, 0.5), (0.6, 0.3), (0.55, 0.4), (0.45, 0.6), (0.4, 0.7)) for wina in (False, True)]
        + [("one side", 1.0, 0.5, False, False), ("one side", 0.5, 1.0, False, False),
           ("one side", 0.75, 1.0, False, False)]
        + [("exact rows", d_in, d_out, False, True)
           for d_in, d_out in ((0.15, 0.4), (0.3, 0.3), (0.225, 0.35), (0.075, 0.45), (0.3, 0.4))])
# (name, d_in, d_out, rotated)
ROTATE_ROWS = [(name, d_in, d_out, rot) for name, d_in, d_out in
               (("two-sided", 0.5, 0.5), ("two-sided", 0.6, 0.3), ("two-sided", 0.55, 0.4),
                ("one side", 0.5, 1.0), ("one side", 0.25, 1.0), ("two-sided", 0.4, 0.4))
               for rot in (False, True)]
LOW_RANK_ROWS = [("two-sided", d_in, d_out, False, False)
                 for d_in, d_out in ((0.5, 0.5), (0.6, 0.3), (0.55, 0.4), (0.4, 0.4), (0.45, 0.3))]


class Sides:
    def __init__(self, weights, act, rank=0):
        self.w, self.act, self.cfg = weights, act, None
        self.low = low_rank(weights, rank)
        self.rot = None  # {layer: Q [d, d]} when rotating
        self.norms = {i: (mx.sqrt(mx.sum(r.gate * r.gate, 0) + mx.sum(r.up * r.up, 0)),
                          mx.sqrt(mx.sum(r.down * r.down, 1))) for i, r in weights.items()}
        mx.eval(self.norms)

    def rows(self, layer, x):
        r, (d_in, d_out, wina, exact) = self.w[layer], self.cfg
        n_in, n_out = self.norms[layer] if wina else (1, 1)
        k_in = max(1, round(d_in * x.shape[-1]))
        if self.rot is not None:
            z = x @ self.rot[layer]
            xs = (z * top_k(mx.abs(z), k_in)) @ self.rot[layer].T
        else:
            xs = x * top_k(mx.abs(x) * n_in, k_in)
        g, u = gate_up(r, None if self.low is None or exact else self.low[layer], x, xs)
        h = self.act(g) * u
        keep = top_k(mx.abs(h) * n_out, max(1, round(d_out * h.shape[-1])))
        if exact:
            h = self.act(x @ r.gate.T) * (x @ r.up.T)
        return FFNRows(up=None, down=r.down, h=h * keep)


def rotations(model, tok, tokens):
    """Per layer Q [d, d]: eigenvectors of E[x x^T] of the FFN input on C4, largest first."""
    seqs = []
    for text in calibration_texts("c4"):
        ids = tok.encode(text)
        seqs += [ids[i : i + 257] for i in range(0, len(ids) - 256, 256)]
        if len(seqs) * 256 >= tokens:
            break
    X, _, _ = record(model, seqs[: max(1, tokens // 256)], progress=False)
    out = {}
    for i, x in enumerate(X):
        x = np.array(x, dtype=np.float64).reshape(-1, x.shape[-1])
        w, v = np.linalg.eigh(x.T @ x / len(x))
        out[i] = mx.array(v[:, ::-1].astype(np.float32))
    mx.eval(out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--low-rank", type=int, default=0, help="rank of the resident gate / up correction")
    p.add_argument("--rotate", action="store_true", help="LaRoSA-like rotated input side, with and without")
    p.add_argument("--calib-tokens", type=int, default=2048, help="C4 tokens for the rotations")
    a = p.parse_args(argv)
    model, tok, weights, ppl, dense = simulation(a.model, a.eval_tokens)
    sides = Sides(weights, layer_ffn(model.layers[0])._act, a.low_rank)
    if a.low_rank:
        r0 = weights[0]
        per = 2 * a.low_rank * (r0.gate.shape[0] + r0.gate.shape[1]) * 2  # float16
        print(f"low rank {a.low_rank}: {per * len(weights) / 1e6:.1f} MB resident at float16 "
              f"(FFN at 4 bits: {3 * r0.gate.size * len(weights) * 0.5625 / 1e6:.1f} MB)", flush=True)
    if a.rotate:
        t = time.perf_counter()
        rot = rotations(model, tok, a.calib_tokens)
        d = rot[0].shape[0]
        print(f"rotations from {a.calib_tokens} C4 tokens in {time.perf_counter() - t:.0f} s: "
              f"{len(rot) * d * d * 4 / 1e6:.1f} MB resident at float32", flush=True)
        model.runtime.wrap_store(lambda store: sides)
        for name, d_in, d_out, rotated in ROTATE_ROWS:
            sides.cfg, sides.rot = (d_in, d_out, False, False), rot if rotated else None
            t = time.perf_counter()
            v = ppl()
            print(f"{name:10s} d_in {d_in:.3f} d_out {d_out:.2f} rotated {int(rotated)} "
                  f"bytes {(2 * d_in + d_out) / 3:.2f} ppl {v:.3f} x{v / dense:.3f} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
        return 0
    model.runtime.wrap_store(lambda store: sides)
    rows = LOW_RANK_ROWS if a.low_rank else ROWS
    for name, d_in, d_out, wina, exact in rows:
        sides.cfg = (d_in, d_out, wina, exact)
        t = time.perf_counter()
        v = ppl()
        b = 2 * d_in / 3 + d_out if exact else (2 * d_in + d_out) / 3
        print(f"{name:10s} d_in {d_in:.3f} d_out {d_out:.2f} wina {int(wina)} bytes {b:.2f} ppl {v:.3f} "
              f"x{v / dense:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())

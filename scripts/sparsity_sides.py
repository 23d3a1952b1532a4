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
"""

import argparse
import sys
import time

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx

from mlx_flash.eval.harness import evaluate_perplexity
from mlx_flash.eval.tasks import load_text
from mlx_flash.models.ffn import FFNRows, layer_ffn
from sparsity_allocation import gate_up, low_rank  # this folder's; run as a script


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
LOW_RANK_ROWS = [("two-sided", d_in, d_out, False, False)
                 for d_in, d_out in ((0.5, 0.5), (0.6, 0.3), (0.55, 0.4), (0.4, 0.4), (0.45, 0.3))]


class Probe:
    def __init__(self, inner):
        self.inner, self.weights = inner, {}

    def rows(self, layer, x):
        self.weights[layer] = r = self.inner.rows(layer, x)
        return r


class Sides:
    def __init__(self, weights, act, rank=0):
        self.w, self.act, self.cfg = weights, act, None
        self.low = low_rank(weights, rank)
        self.norms = {i: (mx.sqrt(mx.sum(r.gate * r.gate, 0) + mx.sum(r.up * r.up, 0)),
                          mx.sqrt(mx.sum(r.down * r.down, 1))) for i, r in weights.items()}
        mx.eval(self.norms)

    def rows(self, layer, x):
        r, (d_in, d_out, wina, exact) = self.w[layer], self.cfg
        n_in, n_out = self.norms[layer] if wina else (1, 1)
        xs = x * top_k(mx.abs(x) * n_in, max(1, round(d_in * x.shape[-1])))
        g, u = gate_up(r, None if self.low is None or exact else self.low[layer], x, xs)
        h = self.act(g) * u
        keep = top_k(mx.abs(h) * n_out, max(1, round(d_out * h.shape[-1])))
        if exact:
            h = self.act(x @ r.gate.T) * (x @ r.up.T)
        return FFNRows(up=None, down=r.down, h=h * keep)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--low-rank", type=int, default=0, help="rank of the resident gate / up correction")
    a = p.parse_args(argv)
    model, tok = mlx_flash.load(a.model, mode="dense", resident_dtype="float32")
    probe = model.runtime.wrap_store(Probe)
    mx.eval(model(mx.array([[1, 2, 3]])))
    model.runtime.unwrap_store()
    text = load_text("wikitext")[0]

    def ppl():
        return evaluate_perplexity(model, tok, text, context=512, limit=a.eval_tokens)["metrics"]["perplexity"]

    dense = ppl()
    print(f"dense: WikiText-2 ppl {dense:.3f} ({a.eval_tokens} tokens)", flush=True)
    sides = Sides(probe.weights, layer_ffn(model.layers[0])._act, a.low_rank)
    if a.low_rank:
        r0 = probe.weights[0]
        per = 2 * a.low_rank * (r0.gate.shape[0] + r0.gate.shape[1]) * 2  # float16
        print(f"low rank {a.low_rank}: {per * len(probe.weights) / 1e6:.1f} MB resident at float16 "
              f"(FFN at 4 bits: {3 * r0.gate.size * len(probe.weights) * 0.5625 / 1e6:.1f} MB)", flush=True)
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

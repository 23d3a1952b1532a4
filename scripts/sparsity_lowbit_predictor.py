"""Research script (issue 19): can a resident low-bit copy of gate / up choose the neurons?

    .venv/bin/python scripts/sparsity_lowbit_predictor.py      # ~4 min here (2 cores)

Per token and layer, neurons are chosen by top-k |silu(G_b x) * (U_b x)|, where G_b, U_b
are gate and up re-quantized to b bits (MLX's affine quantization, group size g) and would
stay in DRAM; the chosen neurons then get their exact h (their gate, up and down rows
read from flash: the paper's bundles), the rest contribute nothing. FFN bytes read per
token = the neuron share; the resident predictor is 2/3 of the FFN at b bits.
"b none" is the oracle (the exact h ranks itself). Simulated densely on SmolLM2's
float32 rows; WikiText-2 test, first --eval-tokens tokens, context 512.
"""

import argparse
import sys
import time

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx

from mlx_flash.models.ffn import FFNRows, layer_ffn
from sparsity_allocation import simulation  # this folder's; run as a script

# (bits or None for the oracle, group size, neuron share)
ROWS = [(None, 0, 0.5), (None, 0, 0.4), (2, 64, 0.5), (2, 32, 0.5), (3, 64, 0.5), (4, 64, 0.5),
        (2, 64, 0.4), (3, 64, 0.4), (2, 64, 0.35), (3, 64, 0.35)]


def top_k(scores, k):
    return scores >= mx.sort(scores, axis=-1)[..., -k][..., None]


def requantized(w, bits, group):
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return mx.dequantize(q, s, b, group_size=group, bits=bits)


class LowBitChoice:
    """The simulated store: exact h on the neurons a low-bit copy of gate / up ranks first."""

    def __init__(self, weights, act):
        self.w, self.act, self.share, self.pred = weights, act, 1.0, {}

    def configure(self, bits, group, share):
        self.share = share
        self.pred = {i: (r.gate, r.up) if bits is None else
                     (requantized(r.gate, bits, group), requantized(r.up, bits, group))
                     for i, r in self.w.items()}
        mx.eval(self.pred)

    def rows(self, layer, x):
        r, (g_b, u_b) = self.w[layer], self.pred[layer]
        guess = self.act(x @ g_b.T) * (x @ u_b.T)
        h = self.act(x @ r.gate.T) * (x @ r.up.T)
        keep = top_k(mx.abs(guess), max(1, round(self.share * h.shape[-1])))
        return FFNRows(up=None, down=r.down, h=h * keep)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--eval-tokens", type=int, default=2048)
    a = p.parse_args(argv)
    model, tok, weights, ppl, dense = simulation(a.model, a.eval_tokens)
    store = LowBitChoice(weights, layer_ffn(model.layers[0])._act)
    model.runtime.wrap_store(lambda _: store)
    r0 = weights[0]
    for bits, group, share in ROWS:
        t = time.perf_counter()
        store.configure(bits, group, share)
        v = ppl()
        resident = 0 if bits is None else 2 * r0.gate.size * len(weights) * (bits + 32 / group) / 8
        print(f"bits {bits or 'none':>4} group {group:2d} neurons {share:.2f} resident {resident / 1e6:5.1f} MB "
              f"ppl {v:.3f} x{v / dense:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

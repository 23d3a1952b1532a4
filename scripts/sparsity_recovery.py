"""Research script (issue 19, item 4): what recovery training buys the calibrated sources.

    .venv/bin/python scripts/sparsity_recovery.py --density 0.5 --rank 32 --steps 200

The model (SmolLM2 by default, `mlx_flash.calibrate` run on it first) runs with the
calibrated thresholds of `--density` on both FFN sides, simulated densely (as
scripts/sparsity_allocation.py does). Beside every layer's pruned FFN sits a small
resident adapter, y += B (A z) with A [R, d], B [d, R] (B starts at zero), z = x (the
FFN input) or, with --input rest, the part of x the input side pruned. Only the
adapters are trained (Adam), by distillation: KL(dense || sparse) of the next-token
distributions on C4 calibration sequences that the threshold search did not use.
WikiText-2 test perplexity (never trained on) of dense, sparse and sparse + adapters
is printed, with the adapters' resident bytes (float16) and the training time.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx_flash  # first: it chooses MLX's BLAS before MLX is imported

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from mlx_flash.eval.harness import evaluate_perplexity
from mlx_flash.eval.tasks import load_text
from mlx_flash.layout.format import read_manifest
from mlx_flash.models.ffn import FFNRows
from mlx_flash.sparsity.allocation import allocation
from mlx_flash.sparsity.calibrate import calibration_texts


class Sparse:
    """The FFN with per-layer thresholds on both sides, and the adapters (or none)."""

    def __init__(self, inner, act, th, rank, d_model, n_layers, rest):
        self.inner, self.act, self.th, self.rest = inner, act, th, rest
        self.on, self.adapt = True, rank > 0
        self.record = None  # per layer: [(z, y_dense - y_sparse)] while fitting by least squares
        self.params = {"layers": [{"A": mx.random.normal((rank, d_model)) * d_model ** -0.5,
                                   "B": mx.zeros((d_model, rank))} for _ in range(n_layers)] if rank else []}

    def rows(self, layer, x):
        r = self.inner.rows(layer, x)
        if not self.on:
            return r
        t_in, t_out = self.th[layer]
        xs = x * (mx.abs(x) >= t_in)
        h = self.act(xs @ r.gate.T) * (xs @ r.up.T)
        h = h * (mx.abs(h) >= t_out)
        parts = [FFNRows(up=None, down=r.down, h=h)]
        z = (x - xs) if self.rest else x
        if self.record is not None:
            hd = self.act(x @ r.gate.T) * (x @ r.up.T)
            self.record[layer].append((z.reshape(-1, z.shape[-1]), ((hd - h) @ r.down).reshape(-1, z.shape[-1])))
            return r  # the dense FFN: every layer sees the dense model's inputs
        if self.adapt:
            p = self.params["layers"][layer]
            parts.append(FFNRows(up=None, down=p["B"].T, h=z @ p["A"].T))
        return parts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--density", type=float, default=0.5)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--input", choices=("x", "rest"), default="x")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fit", choices=("kl", "lsq"), default="kl",
                   help="kl: Adam on the distillation loss; lsq: each layer's adapter by reduced-rank least "
                        "squares of its FFN error on the dense model's inputs (closed form)")
    p.add_argument("--lsq-tokens", type=int, default=4096)
    p.add_argument("--skip-docs", type=int, default=200, help="C4 documents left out (the search's)")
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    t_start = time.perf_counter()
    man = read_manifest(a.model)
    alloc = allocation(man.calibration["thresholds"], a.density)
    model, tok = mlx_flash.load(a.model, mode="dense", resident_dtype="float32")
    rt = model.runtime
    n_layers, d_model = len(rt.ffns), rt.ffns[0].d_model
    sp = rt.wrap_store(lambda s: Sparse(s, rt.ffns[0]._act, alloc.threshold.tolist(), a.rank, d_model,
                                        n_layers, a.input == "rest"))
    text = load_text("wikitext")[0]

    def ppl(on):
        sp.on = on
        return evaluate_perplexity(model, tok, text, context=512, limit=a.eval_tokens)["metrics"]["perplexity"]

    dense, sparse0 = ppl(False), ppl(True)
    print(f"dense {dense:.3f}; calibrated at {a.density} (bytes {alloc.bytes_share:.3f}): {sparse0:.3f} "
          f"x{sparse0 / dense:.3f}", flush=True)
    rows = {"dense": dense, "sparse": sparse0}
    if a.rank and a.fit == "lsq":
        t0 = time.perf_counter()
        sp.record = [[] for _ in range(n_layers)]
        have = 0
        for text_c4 in calibration_texts("c4")[a.skip_docs:]:
            ids = tok.encode(text_c4)
            for i in range(0, len(ids) - a.seq_len + 1, a.seq_len):
                mx.eval(model(mx.array([ids[i : i + a.seq_len]])), sp.record)
                have += a.seq_len
            if have >= a.lsq_tokens:
                break
        rec, sp.record = sp.record, None
        for i in range(n_layers):
            z = mx.concatenate([r[0] for r in rec[i]])
            t = mx.concatenate([r[1] for r in rec[i]])
            zz = z.T @ z
            lam = 1e-3 * mx.mean(mx.diag(zz))
            m = mx.linalg.solve(zz + lam * mx.eye(d_model), z.T @ t, stream=mx.cpu)  # [d, d]
            _, _, vt = mx.linalg.svd(z @ m, stream=mx.cpu)
            v = vt[: a.rank].T  # [d, R]: the fitted values' top directions
            sp.params["layers"][i] = {"A": (m @ v).T, "B": v}
            mx.eval(sp.params["layers"][i])
        train_s = time.perf_counter() - t0
        sparse1 = ppl(True)
        nbytes = sum(v.size for q in sp.params["layers"] for v in q.values()) * 2
        print(f"with lsq adapters (rank {a.rank}, input {a.input}, {nbytes / 1e6:.2f} MB float16, {have} tokens): "
              f"{sparse1:.3f} x{sparse1 / dense:.3f}; fitted in {train_s:.0f} s", flush=True)
        rows |= {"recovered": sparse1, "adapter_bytes": nbytes, "train_s": train_s}
    elif a.rank:
        seqs = []
        for text_c4 in calibration_texts("c4")[a.skip_docs:]:
            ids = tok.encode(text_c4)
            seqs += [ids[i : i + a.seq_len] for i in range(0, len(ids) - a.seq_len + 1, a.seq_len)]
            if len(seqs) >= a.steps:
                break
        opt = optim.Adam(learning_rate=a.lr)
        params = sp.params

        def loss_fn(params, inp, target_logp):
            sp.params = params
            logp = model(inp)[0].astype(mx.float32)
            logp = logp - mx.logsumexp(logp, -1, keepdims=True)
            return mx.mean(mx.sum(mx.exp(target_logp) * (target_logp - logp), -1))

        grad_fn = mx.value_and_grad(loss_fn)
        t0 = time.perf_counter()
        losses = []
        for step, s in enumerate(seqs[: a.steps]):
            inp = mx.array([s])
            sp.on = False
            t = model(inp)[0].astype(mx.float32)
            t = t - mx.logsumexp(t, -1, keepdims=True)
            mx.eval(t)
            sp.on = True
            loss, g = grad_fn(params, inp, t)
            params = opt.apply_gradients(g, params)
            mx.eval(params, opt.state, loss)
            sp.params = params
            losses.append(float(loss))
            if (step + 1) % 25 == 0:
                print(f"step {step + 1}: KL {np.mean(losses[-25:]):.4f} ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        train_s = time.perf_counter() - t0
        sparse1 = ppl(True)
        nbytes = sum(v.size for q in params["layers"] for v in q.values()) * 2
        print(f"with adapters (rank {a.rank}, input {a.input}, {nbytes / 1e6:.2f} MB float16): {sparse1:.3f} "
              f"x{sparse1 / dense:.3f}; trained {len(losses)} steps x {a.seq_len} tokens in {train_s:.0f} s",
              flush=True)
        rows |= {"recovered": sparse1, "adapter_bytes": nbytes, "train_s": train_s, "losses": losses}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "bytes_share": alloc.bytes_share} | rows, indent=1))
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())

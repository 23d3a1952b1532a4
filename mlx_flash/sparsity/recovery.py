"""Recovery adapters for the calibrated sources (DIP's LoRA recovery, in
the cheapest form that serves a model read from flash).

Beside every layer's sparse FFN sits a small resident low-rank adapter,
    y += B (A x),   A [rank, d_model], B [d_model, rank], x the FFN input,
trained by distillation with the sparse forward in the loop: on calibration text (C4 by
default, the sequences after those the threshold search used; never the evaluation
text), the model with the calibrated thresholds of one `--density` on both FFN sides
(simulated densely: the same selection as the DIP store's `calibrated` source) learns to
match the dense model's next-token distributions, KL(dense || sparse + adapters). Only
the adapters train (Adam); B starts at zero, so step 0 is the plain sparse model.

The adapters live in `recovery.safetensors` (float16) and the manifest's
calibration["recovery"] (version 1: file, sha256, rank, the density trained at, steps,
tokens, the loss before and after). At run time the `calibrated` and `calibrated-ca`
sources add them to every layer (resident, counted against the memory budget), and say
so; `--no-recovery` leaves them out.
"""

import os
import time
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx.optimizers as optim

from ..errors import FlashError
from ..models.ffn import FFNRows
from ..models.host import mlx_only

VERSION = 1
FILE = "recovery.safetensors"


def _keep(values, threshold):
    """values where |values| >= threshold, and each token's largest one (the DIP store's rule)."""
    a = mx.abs(values)
    return mx.where((a >= threshold) | (a >= a.max(axis=-1, keepdims=True)), values, mx.zeros_like(values))


class _SparseTrainer:
    """Between the FFNs and a dense store: the calibrated sparse FFN plus the adapters
    (`sparse` False: the dense model, the teacher)."""

    def __init__(self, inner, act, thresholds, params):
        self.inner, self.act, self.thresholds = inner, act, thresholds
        self.params = params  # {"layers": [{"A": [r, d], "B": [d, r]}]}
        self.sparse = True

    def rows(self, layer, x):
        r = self.inner.rows(layer, x)
        if not self.sparse:
            return r
        t_in, t_out = self.thresholds[layer]
        xs = _keep(x, t_in)
        h = _keep(self.act(xs @ r.gate.T) * (xs @ r.up.T), t_out)
        p = self.params["layers"][layer]
        return [FFNRows(up=None, down=r.down, h=h), FFNRows(up=None, down=p["B"].T, h=x @ p["A"].T)]


def _log_probs(logits):
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, -1, keepdims=True)


HELD_OUT = 4  # sequences after the training ones: the KL before and after training, measured on them


def train_recovery(folder, density=0.5, rank=32, steps=200, seq_len=256, lr=1e-3, data="c4", seed=0,
                   progress=True, log=print):
    """Train the adapters of `folder`'s calibrated thresholds at `density`, write them and the
    manifest section (with the KL of the sparse model to the dense one on HELD_OUT sequences
    it did not train on, before and after). -> the section. All through MLX (it differentiates
    the model)."""
    with mlx_only():
        return _train_recovery(folder, density, rank, steps, seq_len, lr, data, seed, progress, log)


# long: one training run read top to bottom; its loss, teacher and held-out closures share the wrapped model
def _train_recovery(folder, density, rank, steps, seq_len, lr, data, seed, progress, log):
    from tqdm import tqdm

    from .. import load
    from ..layout.format import add_manifest_section, read_manifest, sha256_file
    from ..layout.safetensors_io import SafetensorsWriter
    from .allocation import allocation
    from .calibrate import token_sequences

    folder = Path(folder)
    section = read_manifest(folder).calibration.get("thresholds")
    if section is None:
        raise FlashError(f"{folder}: recovery training needs the calibrated thresholds; run "
                         "`mlx_flash.calibrate --what thresholds` first")
    if rank < 1 or steps < 1:
        raise FlashError(f"--recover-rank and --recover-steps must be at least 1 (got {rank}, {steps})")
    if not 0 < density < 1:
        raise FlashError(f"--recover-density must be in (0, 1), got {density}")
    alloc = allocation(section, density)
    model, tok = load(folder, mode="dense", resident_dtype="float32", ffn_rows="float32")
    rt = model.runtime
    ffns = rt.ffns
    d_model = ffns[0].d_model
    mx.random.seed(seed)
    params = {"layers": [{"A": mx.random.normal((rank, d_model)) * d_model ** -0.5,
                          "B": mx.zeros((d_model, rank))} for _ in ffns]}
    # the sequences after those the threshold search used
    skip = -(-int(section.get("tokens", 0)) // seq_len)
    seqs = token_sequences(tok, data, (skip + steps + HELD_OUT) * seq_len, seq_len)[skip:]
    held, seqs = seqs[-HELD_OUT:], seqs[:-HELD_OUT]
    if not seqs:
        raise FlashError(f"calibration data '{data}': fewer than {HELD_OUT + 1} sequences of {seq_len} tokens "
                         f"after the threshold search's {skip * seq_len} tokens")
    if len(seqs) < steps:
        log(f"calibration data '{data}' has {len(seqs)} sequences of {seq_len} tokens after the threshold "
            f"search's and the {HELD_OUT} held out; training {len(seqs)} steps, not {steps}")
    trainer = rt.wrap_store(lambda store: _SparseTrainer(store, ffns[0]._act, alloc.threshold.tolist(), params))
    opt = optim.Adam(learning_rate=lr)

    def loss_fn(p, inp, target):
        trainer.params = p
        logp = _log_probs(model(inp)[0])
        return mx.mean(mx.sum(mx.exp(target) * (target - logp), -1))

    grad_fn = mx.value_and_grad(loss_fn)

    def teacher(inp):
        trainer.sparse = False
        target = _log_probs(model(inp)[0])
        mx.eval(target)
        trainer.sparse = True
        return target

    def held_out_kl(p):
        return float(np.mean([loss_fn(p, inp, teacher(inp)).item() for inp in (mx.array([s]) for s in held)]))

    losses = []
    t0 = time.perf_counter()
    try:
        kl_before = held_out_kl(params)
        bar = tqdm(seqs, desc="recovery", disable=not progress, leave=False)
        for s in bar:
            inp = mx.array([s])
            target = teacher(inp)
            loss, g = grad_fn(params, inp, target)
            params = opt.apply_gradients(g, params)
            mx.eval(params, opt.state, loss)
            losses.append(float(loss))
            bar.set_postfix_str(f"KL {np.mean(losses[-20:]):.4f}")
        kl_after = held_out_kl(params)
    finally:
        rt.unwrap_store()
        rt.close()
    train_s = time.perf_counter() - t0
    log(f"trained {len(losses)} steps x {seq_len} tokens in {train_s:.0f} s: KL(dense || sparse) on "
        f"{len(held)} held-out sequences {kl_before:.4f} -> {kl_after:.4f}")

    tmp = folder / (FILE + ".tmp")
    arrays = {f"layers.{i}.{k}": np.array(p[k].astype(mx.float32)).astype(np.float16)
              for i, p in enumerate(params["layers"]) for k in ("A", "B")}
    w = SafetensorsWriter(tmp, [(k, v.shape, "float16") for k, v in arrays.items()])
    for k, v in arrays.items():
        w.write(k, v)
    w.close()
    os.replace(tmp, folder / FILE)
    recovery = {"version": VERSION, "file": FILE, "size": os.path.getsize(folder / FILE),
                "sha256": sha256_file(folder / FILE), "rank": rank, "density": density, "steps": len(losses),
                "seq_len": seq_len, "tokens": len(losses) * seq_len, "lr": lr, "data": str(data),
                "skipped_tokens": skip * seq_len, "train_s": train_s, "held_out_tokens": len(held) * seq_len,
                "kl_before": kl_before, "kl_after": kl_after}
    return add_manifest_section(folder, "calibration", {"recovery": recovery}, merge=True).calibration["recovery"]


def load_adapters(folder, manifest, dtype, verify=True):
    """The adapters of calibration["recovery"] as per-layer (A^T [d, r], B^T [r, d]) at `dtype`
    (FFNRows' orientation: h = x A^T, y = h B^T), or None when there are none."""
    from ..layout.format import check_file

    section = manifest.calibration.get("recovery")
    if section is None:
        return None
    if section.get("version") != VERSION:
        raise FlashError(f"{folder}: recovery adapters of version {section.get('version')} (this mlx_flash reads "
                         f"{VERSION}); run `mlx_flash.calibrate --recover` again")
    check_file(folder, section, checksum=verify)
    w = mx.load(str(folder / section["file"]))
    n_layers = len(manifest.ffn_files)
    try:
        out = [(w[f"layers.{i}.A"].T.astype(dtype), w[f"layers.{i}.B"].T.astype(dtype)) for i in range(n_layers)]
    except KeyError as e:
        raise FlashError(f"{folder / section['file']}: no tensor {e} (the file does not match the manifest)")
    mx.eval(out)
    return out

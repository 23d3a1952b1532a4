"""Calibration: record FFN inputs and activations, train the low-rank predictors, measure Req_i.

The model runs over calibration text in `naive` mode (every layer's FFN read
from flash per chunk, so calibration fits in the memory the model runs in).
For every layer we keep the FFN inputs x and which neurons are active:
- ReLU-family FFNs (relu, relu2, fatrelu; OPT): the neurons whose activation is
  not zero — what the paper predicts;
- SwiGLU: the top-k |GLU| neurons at `density` (the set DIP's GLU pruning
  keeps) — a harder target (DIP §3).
Then each layer's predictor is trained, its threshold chosen on held-out
tokens as the largest reaching the target recall (a layer that must then
select more than half of its inactive neurons is retrained at twice the rank,
up to max_rank — the paper's larger predictors for the layers that need them), and Req_i(k) — the most neurons the predictor
selects over any k consecutive tokens, k = 1..8 — recorded for the planner.
"""

import json
import os
import time
from pathlib import Path

import numpy as np

import mlx.core as mx

from ..errors import FlashError
from ..layout.format import add_manifest_section, sha256_file
from ..layout.safetensors_io import SafetensorsWriter
from ..models.ffn import FFNRows
from . import top_k_mask
from .predictor import choose_threshold, metrics, probabilities, train_predictor

PREDICTORS = "predictors.safetensors"
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # shared/data in the checkout's parent folder
SPARSE_ACTS = ("relu", "relu2", "fatrelu")
WINDOWS = range(1, 9)


def calibration_texts(data):
    """'c4' | 'wikitext' (validation split: never calibrate on the test set) | a .txt / .jsonl path."""
    if data == "c4":
        path = DATA / "c4" / "c4-validation-2k.jsonl"
    elif data == "wikitext":
        path = DATA / "wikitext-2-raw" / "wikitext2_val_sample.jsonl"
    else:
        path = Path(data)
    if not path.is_file():
        raise FlashError(f"calibration data {path}: no such file")
    if path.suffix == ".jsonl":
        texts = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    texts.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise FlashError(f"{path}: every line must be a JSON object with a 'text' field")
        return texts
    return [path.read_text(encoding="utf-8")]


class _Recorder:
    """Wraps a store whose rows are every neuron in order: records x and the active set."""

    def __init__(self, inner, ffns, target, density):
        self.inner, self.ffns, self.target, self.density = inner, ffns, target, density
        n = len(ffns)
        self.x, self.y = [[] for _ in range(n)], [[] for _ in range(n)]

    def rows(self, layer, x):
        parts = self.inner.rows(layer, x)
        r = parts if isinstance(parts, FFNRows) else parts[0]
        assert (isinstance(parts, FFNRows) or len(parts) == 1) and r.ids is None
        ffn = self.ffns[layer]
        x2 = x.reshape(-1, x.shape[-1])
        u = ffn.biased("up", x2 @ r.up.T)
        h = ffn._act(ffn.biased("gate", x2 @ r.gate.T)) * u if ffn.gated else ffn._act(u)
        h = np.abs(np.array(h.astype(mx.float32)))
        if self.target == "relu":
            y = h != 0
        else:
            y = top_k_mask(h, max(1, round(self.density * h.shape[-1])))
        self.x[layer].append(np.array(x2.astype(mx.float32)))
        self.y[layer].append(y)
        return parts


def token_sequences(tok, data, tokens, seq_len, targets=False):
    """Whole sequences of seq_len tokens of the calibration texts, until `tokens`; with
    targets, each one token longer (its last position's next token)."""
    n = seq_len + (1 if targets else 0)
    seqs, have = [], 0
    for text in calibration_texts(data):
        ids = tok.encode(text)
        for i in range(0, len(ids) - n + 1, seq_len):
            seqs.append(ids[i : i + n])
            have += seq_len
            if have >= tokens:
                return seqs
    if not seqs:
        raise FlashError(f"calibration data '{data}' gives no sequence of {n} tokens")
    return seqs


def _req(pred_by_seq, n):
    """Req(k): the most distinct neurons predicted over k consecutive tokens of a sequence."""
    req = [0] * len(WINDOWS)
    for pred in pred_by_seq:
        union = pred.copy()
        for j, k in enumerate(WINDOWS):
            if k > 1:
                if pred.shape[0] < k:  # a window longer than the sequence: all of it
                    req[j] = max(req[j], req[j - 1])
                    continue
                union = union[:-1] | pred[k - 1 :]  # union[t] = pred[t] | ... | pred[t + k - 1]
            req[j] = max(req[j], int(union.sum(axis=1).max()))
    return req


def calibrate(folder, data="c4", tokens=4096, seq_len=256, rank=128, max_rank=512, recall=0.95,
              density=None, epochs=4, progress=True, log=print):
    from tqdm import tqdm

    from .. import load
    from ..models.ffn import layer_ffn

    folder = Path(folder)
    model, tok = load(folder, mode="naive", ffn_rows="float32")  # the recorder computes on float rows
    ffns = [layer_ffn(layer) for layer in model.layers]
    act_name = getattr(model.args, "hidden_act", None) or getattr(model.args, "activation_function", "relu")
    target = "relu" if act_name in SPARSE_ACTS else "topk"
    if target == "topk":
        density = density or 0.5
    elif density is not None:
        raise FlashError(f"--density is for SwiGLU models; this one ({act_name}) is predicted exactly")

    seqs = token_sequences(tok, data, tokens, seq_len)
    rec = model.runtime.wrap_store(lambda store: _Recorder(store, ffns, target, density))
    t0 = time.perf_counter()
    for s in tqdm(seqs, desc="record", disable=not progress, leave=False):
        mx.eval(model(mx.array([s])))
    log(f"recorded {len(seqs)} x {seq_len} tokens in {time.perf_counter() - t0:.1f} s ({target} target"
        + (f", density {density}" if target == "topk" else "") + ")")

    n_val = max(1, len(seqs) // 10)  # the last sequences: held out
    split = (len(seqs) - n_val) * seq_len
    weights, ranks, thresholds, req, per_layer = {}, [], [], [], []
    t0 = time.perf_counter()
    for layer in tqdm(range(len(ffns)), desc="train", disable=not progress, leave=False):
        x = np.concatenate(rec.x[layer])
        y = np.concatenate(rec.y[layer])
        best, r = None, rank
        while r <= max_rank:
            pred = train_predictor(x[:split], y[:split], r, epochs=epochs, seed=layer)
            p_val = probabilities(pred, x[split:])
            th = choose_threshold(p_val, y[split:], recall)
            m = metrics(p_val, y[split:], th)
            improved = best is None or m["false_positive_rate"] < 0.9 * best[3]["false_positive_rate"]
            if improved:
                best = (pred, r, th, m)
            # a larger predictor only for a layer that selects over half its inactive
            # neurons at the target recall, and only while doubling the rank helps
            if m["false_positive_rate"] < 0.5 or not improved:
                break
            r *= 2
        pred, r, th, m = best
        p_all = probabilities(pred, x) >= th
        req.append(_req([p_all[i : i + seq_len] for i in range(0, len(p_all), seq_len)], y.shape[1]))
        for k, v in (("down.weight", pred.down.weight), ("up.weight", pred.up.weight), ("up.bias", pred.up.bias)):
            weights[f"layers.{layer}.{k}"] = np.array(v)
        ranks.append(r)
        thresholds.append(th)
        per_layer.append(dict(m, rank=r, threshold=th))
        rec.x[layer] = rec.y[layer] = None  # free as we go
    log(f"trained {len(ffns)} predictors in {time.perf_counter() - t0:.1f} s")

    tmp = folder / (PREDICTORS + ".tmp")
    w = SafetensorsWriter(tmp, [(k, v.shape, "float32") for k, v in weights.items()])
    for k, v in weights.items():
        w.write(k, v)
    w.close()
    os.replace(tmp, folder / PREDICTORS)
    calibration = {
        "predictors": {"file": PREDICTORS, "size": os.path.getsize(folder / PREDICTORS),
                       "sha256": sha256_file(folder / PREDICTORS), "ranks": ranks,
                       "thresholds": thresholds, "target": target, "density": density},
        "req": {"windows": list(WINDOWS), "per_layer": req},
        "metrics": per_layer,
        "data": str(data), "tokens": len(seqs) * seq_len, "held_out_tokens": n_val * seq_len,
    }
    return add_manifest_section(folder, "calibration", calibration, merge=True).calibration

"""Calibrated thresholds for both sides of a SwiGLU FFN, per layer (TEAL's idea).

A token reads the gate/up columns of the input dims with |x_i| >= t_in[layer] (the
input side, 2/3 of the FFN's bytes) and the down rows of the neurons with
|h~_j| >= t_out[layer] (the output side, 1/3), h~ computed from the pruned x: the
`calibrated` sources (dip.py) in the DIP store. How much each layer and side keeps
is chosen here, on calibration text (C4; never the evaluation text):

1. record: every layer's FFN input x and g = dNLL/dy (its output's loss gradient), one
   forward and one backward pass layer by layer, a layer's float32 weights at a time
   (layerwise.py: the model is never loaded whole);
2. thresholds: the quantiles of |x| and |h| per layer, so that a density d of a
   side is the threshold that keeps a share d of the recorded values;
3. search: greedy, from dense, one STEP of one layer's side at a time, taking the
   step that adds the least predicted loss per byte saved. Predicted loss of a
   layer's output error dy: E[(g . dy)^2] (an empirical-Fisher estimate: how much
   the error moves the loss, which TEAL's |dy|^2 ignores; it allocates better on
   SmolLM2).

The manifest keeps the quantiles and the search's path (which side of which layer
each step lowered), not one allocation: `--density` at run time is the average
share of the FFN's bytes, and the allocation for it is the path replayed until the
average reaches it (`allocation(section, density)`).

Scores (`score`): "magnitude" compares |x_i| and |h~_j| with the thresholds; "wina"
(WINA, 2025) weighs each by the norm of the weights it multiplies: |x_i| ||(G; U)[:, i]||
(input dim i's gate and up columns) and |h~_j| ||D[j]|| (neuron j's down row), so a
small input that meets large weights is kept before a larger one that meets small
ones. The norms are computed here, written beside the manifest (NORMS_FILE) and held
resident by the source (d_model + d_ff floats a layer).
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import mlx.core as mx

from ..errors import FlashError

VERSION = 1
SCORES = ("magnitude", "wina")
NORMS_FILE = "calibration/score-norms.safetensors"
STEP = 0.05
SHARE = np.array([2 / 3, 1 / 3])  # share of a layer's FFN bytes: gate+up columns, down rows
LOWEST = 0.2  # the search stops at this average share (run-time --density below it: an error)
SIDES = ("in", "out")


@dataclass
class Allocation:
    """Per layer: the kept share of each side, and its threshold."""

    density: np.ndarray  # [layers, 2]: input side, output side
    threshold: np.ndarray  # [layers, 2]

    @property
    def bytes_share(self):
        """The average share of the FFN's weight bytes a token reads."""
        return float((self.density * SHARE).sum(1).mean())


def allocation(section, target):
    """The allocation of a calibrated `thresholds` section at an average byte share `target`."""
    if section.get("version") != VERSION:
        raise FlashError(f"calibrated thresholds of version {section.get('version')} (this mlx_flash reads "
                         f"{VERSION}); run `mlx_flash.calibrate` again")
    step, q = section["step"], [np.array(section["quantiles"][s]) for s in SIDES]
    n_layers = q[0].shape[0]
    dens = np.ones((n_layers, 2))
    low = section["lowest"]
    if target < low - 1e-9:
        raise FlashError(f"--density {target}: the calibrated thresholds reach down to {low}; "
                         f"calibrate with a lower --lowest")
    for layer, side in section["path"]:
        if float((dens * SHARE).sum(1).mean()) <= target + 1e-9:
            break
        dens[layer, side] = round(dens[layer, side] - step, 6)
    idx = np.rint(dens / step).astype(int)
    th = np.stack([q[s][np.arange(n_layers), idx[:, s]] for s in (0, 1)], axis=1)
    return Allocation(dens, th)


def uniform(section, target):
    """The ablation of the search: every layer and side at `target`, the thresholds the
    calibrated quantiles give it (interpolated between the grid's points)."""
    if target < section["lowest"] - 1e-9:
        raise FlashError(f"--density {target}: the calibrated thresholds reach down to {section['lowest']}")
    q = [np.array(section["quantiles"][s]) for s in SIDES]
    pos = target / section["step"]
    lo = int(np.floor(pos + 1e-9))
    hi, w = min(lo + 1, q[0].shape[1] - 1), pos - lo
    th = []
    for s in (0, 1):
        a, b = q[s][:, lo], q[s][:, hi]
        th.append(a if w < 1e-9 else a + w * (b - a))  # lo >= 1: target >= lowest >= step
    dens = np.full((q[0].shape[0], 2), float(target))
    return Allocation(dens, np.stack(th, axis=1))


def _quantiles(values, step):
    """Thresholds keeping a share k * step of |values|, k = 0 .. 1/step (k = 0: inf)."""
    s = np.sort(np.abs(np.asarray(values, dtype=np.float32)).ravel())
    n = int(round(1 / step))
    out = [float("inf")]
    for k in range(1, n):
        out.append(float(s[min(len(s) - 1, int(round((1 - k * step) * len(s))))]))
    return out + [0.0]


def score_norms(W):
    """Per layer (||(G; U)[:, i]|| for every input dim i [d], ||D[j]|| for every neuron j [d_ff]),
    float32 NumPy, of the dense FFN rows W {layer: FFNRows (gate, up, down: [d_ff, d])}."""
    out = []
    for i in range(len(W)):
        w = W[i]
        n_in = mx.sqrt(mx.sum(w.gate.astype(mx.float32) ** 2, 0) + mx.sum(w.up.astype(mx.float32) ** 2, 0))
        n_out = mx.sqrt(mx.sum(w.down.astype(mx.float32) ** 2, 1))
        out.append((np.array(n_in), np.array(n_out)))
    return out


# long: one greedy search; its closures (h_at, err, candidates) share the recorded arrays and the densities
def search(X, G, W, act, step=STEP, lowest=LOWEST, progress=True, log=print, score="magnitude"):
    """The greedy search on recorded FFN inputs X and gradients G ([layers][tokens, d] float32,
    layerwise.record) with the layers' FFN rows W (W[i]: FFNRows, read when asked for).
    -> (the `thresholds` manifest section without the data description, the score norms per
    layer or None). Each layer's activations h~ (tokens x d_ff floats; its current and its next
    input-side step's) are kept by a Spill between the steps that use them: the last few used in
    DRAM, the others in a temporary folder (2 x layers x tokens x d_ff floats at most: 4.1 GB for
    Qwen2.5-Coder-1.5B at 2,048 tokens)."""
    from .layerwise import Spill

    if score not in SCORES:
        raise FlashError(f"unknown score '{score}' (choose from {', '.join(SCORES)})")
    n_layers = len(X)
    spill = Spill()
    try:
        return _search(X, G, W, act, step, lowest, progress, log, score, n_layers, spill)
    finally:
        spill.close()


def _search(X, G, W, act, step, lowest, progress, log, score, n_layers, spill):
    from tqdm import tqdm

    norms = score_norms(W) if score == "wina" else None
    # what each side's threshold compares: |x| and |h~|, each weighed by its weights' norm (wina)
    nx = [mx.array(norms[i][0]) if norms else 1.0 for i in range(n_layers)]
    nh = [mx.array(norms[i][1]) if norms else 1.0 for i in range(n_layers)]
    q = [[_quantiles(np.array(mx.abs(X[i]) * nx[i]), step) for i in range(n_layers)], []]
    Y = []
    for i in range(n_layers):  # dense h and y; h~ at full density is h (spilled as layer i's current)
        h = act(X[i] @ W[i].gate.T) * (X[i] @ W[i].up.T)
        Y.append(h @ W[i].down)
        mx.eval(Y[-1])
        q[1].append(_quantiles(np.array(mx.abs(h) * nh[i]), step))
        spill.put(("cur", i), h)
        del h
    n_tokens = X[0].shape[0]

    def k(d):
        return int(round(d / step))

    # the current h~ of each layer (at its current input density, spilled under ("cur", i)): an
    # output-side step re-thresholds it, only an input-side step recomputes gate and up

    def h_at(i, d_in):
        x = X[i]
        xs = x * (mx.abs(x) * nx[i] >= q[0][i][k(d_in)])
        return act(xs @ W[i].gate.T) * (xs @ W[i].up.T)

    def err(i, h, d_out):
        h = h * (mx.abs(h) * nh[i] >= q[1][i][k(d_out)])
        e = mx.mean(mx.sum(G[i] * (h @ W[i].down - Y[i]), -1) ** 2)
        return float(e)

    t0 = time.perf_counter()
    dens = np.ones((n_layers, 2))
    cur = np.zeros(n_layers)
    cand = {}  # (layer, side) -> loss after the step (an input-side one's h~ spilled under ("in", i))

    def candidates(i, stepped=0):
        """Layer i's two next steps, after a step of its side `stepped` (an output-side step
        leaves the input-side candidate's h~ as it was: only its loss changes)."""
        for side in (0, 1):
            if dens[i, side] <= step + 1e-9:
                cand.pop((i, side), None)
                continue
            nd = dens[i].copy()
            nd[side] = round(nd[side] - step, 6)
            if side == 1:
                h = spill.get(("cur", i))
            elif stepped == 1 and (i, 0) in cand:
                h = spill.get(("in", i))
            else:
                h = h_at(i, nd[0])
                spill.put(("in", i), h)
            cand[(i, side)] = err(i, h, nd[1])
            del h

    for i in range(n_layers):
        candidates(i)
    path = []
    total = int(round((1 - lowest) / (step * SHARE.min()) * n_layers))  # an upper bound, for the bar
    bar = tqdm(total=total, desc="search", disable=not progress, leave=False)
    while float((dens * SHARE).sum(1).mean()) > lowest + 1e-9 and cand:
        (i, side), e = min(cand.items(), key=lambda kv: (kv[1] - cur[kv[0][0]]) / SHARE[kv[0][1]])
        dens[i, side] = round(dens[i, side] - step, 6)
        cur[i] = e
        if side == 0:
            spill.move(("in", i), ("cur", i))
        path.append([i, side])
        candidates(i, side)
        bar.update(1)
    bar.close()
    log(f"searched {len(path)} steps in {time.perf_counter() - t0:.1f} s")
    return {"version": VERSION, "step": step, "lowest": lowest, "proxy": "fisher", "score": score,
            "quantiles": {"in": q[0], "out": q[1]}, "path": path, "tokens": n_tokens}, norms


def write_norms(folder, norms):
    """The score norms into NORMS_FILE (float32, written whole, then renamed) -> its manifest entry."""
    import os

    from ..layout.format import sha256_file
    from ..layout.safetensors_io import SafetensorsWriter

    path = Path(folder) / NORMS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    arrays = {f"layers.{i}.{side}": a for i, pair in enumerate(norms) for side, a in zip(SIDES, pair)}
    w = SafetensorsWriter(tmp, [(k, v.shape, "float32") for k, v in arrays.items()])
    for k, v in arrays.items():
        w.write(k, v)
    w.close()
    os.replace(tmp, path)
    return {"file": NORMS_FILE, "size": path.stat().st_size, "sha256": sha256_file(path)}


def read_norms(folder, manifest, verify=True):
    """The `wina` score's norms per layer ((in [d], out [d_ff]) float32 NumPy), or None for a
    magnitude section."""
    from ..layout.format import check_file
    from ..layout.safetensors_io import SafetensorsFile

    section = manifest.calibration["thresholds"]
    if section.get("score", "magnitude") == "magnitude":
        return None
    entry = section.get("norms")
    if entry is None:
        raise FlashError(f"{folder}: the calibrated thresholds use the {section['score']} score but list no "
                         "norms file; run `mlx_flash.calibrate` again")
    check_file(folder, entry, checksum=verify)
    st = SafetensorsFile(Path(folder) / entry["file"])
    try:
        return [tuple(np.ascontiguousarray(st.read(f"layers.{i}.{side}"), dtype=np.float32) for side in SIDES)
                for i in range(len(manifest.ffn_files))]
    except KeyError as e:
        raise FlashError(f"{st.path}: no tensor {e} (the file does not match the manifest)")


def calibrate_thresholds(folder, data="c4", tokens=2048, seq_len=256, lowest=LOWEST, progress=True, log=print,
                         score="magnitude", verify=True):
    """Search a SwiGLU model's per-layer thresholds on calibration text and write them into
    its manifest (calibration["thresholds"], beside the predictors). -> the section. The model
    is never loaded whole: a layer's float32 weights at a time (layerwise.py)."""
    from ..layout.format import add_manifest_section, check_file, read_manifest
    from ..models import model_args
    from ..models.ffn import activation
    from ..tokenizer import load_tokenizer
    from .calibrate import token_sequences
    from .layerwise import record

    folder = Path(folder)
    manifest = read_manifest(folder)
    config = json.loads((folder / "config.json").read_text())
    _, args = model_args(config)
    if "gate" not in manifest.layout.kinds or manifest.experts or getattr(args, "mlp_bias", False):
        raise FlashError(f"{folder}: calibrated thresholds are for gated (SwiGLU) FFNs without biases")
    if not 0 < lowest < 1:
        raise FlashError(f"--lowest must be in (0, 1), got {lowest}")
    check_file(folder, manifest.resident, checksum=verify)
    tok = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    seqs = token_sequences(tok, data, tokens, seq_len, targets=True)
    t0 = time.perf_counter()
    X, G, W = record(folder, manifest, seqs, progress, verify)
    log(f"recorded {len(seqs)} sequences ({X[0].shape[0]} tokens) and their gradients layer by layer in "
        f"{time.perf_counter() - t0:.1f} s")
    act = activation(args.hidden_act, getattr(args, "fatrelu_threshold", None))
    section, norms = search(X, G, W, act, lowest=lowest, progress=progress, log=log, score=score)
    section["data"] = str(data)
    if norms is not None:
        section["norms"] = write_norms(folder, norms)
    return add_manifest_section(folder, "calibration", {"thresholds": section}, merge=True).calibration["thresholds"]


def plot(section, densities, path):
    """A PNG of each layer's input- and output-side density at the given averages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for d in densities:
        a = allocation(section, d)
        for s, ax in enumerate(axes):
            ax.plot(a.density[:, s], marker="o", ms=3, label=f"--density {d:g}")
    for s, ax in enumerate(axes):
        ax.set_title(("input side: gate/up columns kept", "output side: down rows kept")[s])
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("kept share")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

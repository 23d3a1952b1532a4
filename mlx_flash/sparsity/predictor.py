"""Low-rank activation predictors (paper §3.1, Figure 3b, App. B).

Per layer: p = sigmoid(B (A x) + b), x the FFN input (the current layer's
attention output after its norm), A: d -> r, B: r -> n. Trained with a binary
cross-entropy balanced between the positive (active) and negative neurons of
that layer; a neuron is predicted active when p >= the layer's threshold,
chosen on held-out data as the largest one whose recall reaches the target.
"""

import numpy as np

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from .base import Source, top_k_mask


class LowRankPredictor(nn.Module):
    def __init__(self, d_model, n_neurons, rank):
        super().__init__()
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, n_neurons, bias=True)

    def __call__(self, x):
        return self.up(self.down(x))  # logits


def balanced_bce(logits, y):
    """Mean of the positives' and the negatives' BCE: neither class dominates."""
    pos = y.sum()
    neg = y.size - pos
    loss_pos = (y * nn.softplus(-logits)).sum() / mx.maximum(pos, 1)
    loss_neg = ((1 - y) * nn.softplus(logits)).sum() / mx.maximum(neg, 1)
    return 0.5 * (loss_pos + loss_neg)


def train_predictor(x, y, rank, epochs=4, batch=512, lr=3e-3, seed=0):
    """x [N, d] float32, y [N, n] bool -> a trained LowRankPredictor."""
    mx.random.seed(seed)
    model = LowRankPredictor(x.shape[1], y.shape[1], rank)
    opt = optim.Adam(learning_rate=lr)
    loss_grad = nn.value_and_grad(model, lambda m, xb, yb: balanced_bce(m(xb), yb))
    rng = np.random.default_rng(seed)
    X, Y = mx.array(x), mx.array(y.astype(np.float32))
    for _ in range(epochs):
        order = mx.array(rng.permutation(x.shape[0]))
        for i in range(0, x.shape[0], batch):
            idx = order[i : i + batch]
            loss, grads = loss_grad(model, X[idx], Y[idx])
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
    return model


def probabilities(model, x):
    return np.array(mx.sigmoid(model(mx.array(x))))


def choose_threshold(p, y, recall=0.95):
    """Largest threshold (of a grid) whose recall of the active neurons reaches `recall`."""
    pos = max(int(y.sum()), 1)
    for t in np.arange(0.95, 0.0, -0.05):
        if (p[y] >= t).sum() / pos >= recall:
            return float(round(t, 2))
    return 0.05


def metrics(p, y, threshold):
    """Paper Figure 9 / App. B: false negatives and positives, predicted vs true density."""
    pred = p >= threshold
    pos, neg = max(int(y.sum()), 1), max(int((~y).sum()), 1)
    return {
        "recall": float((pred & y).sum() / pos),
        "false_negative_rate": float((~pred & y).sum() / pos),
        "false_positive_rate": float((pred & ~y).sum() / neg),
        "true_density": float(y.mean()),
        "predicted_density": float(pred.mean()),
    }


class PredictorSource(Source):
    """The calibrated low-rank predictors (paper §3.1): p(x) >= the layer's threshold.

    With density < 1, at most the top density * n predicted neurons are kept.
    """

    name = "predictor"
    needs = "predictors"

    def __init__(self, folder, manifest, density, dtype=mx.float32):
        from mlx.utils import tree_flatten

        from ..layout.format import check_file

        cal = manifest.calibration.get("predictors")
        self.check_needs(folder, manifest)
        check_file(folder, cal, checksum=True)
        w = mx.load(str(folder / cal["file"]))
        self.layers = []
        for i, r in enumerate(cal["ranks"]):
            p = LowRankPredictor(w[f"layers.{i}.down.weight"].shape[1], w[f"layers.{i}.up.bias"].shape[0], r)
            p.load_weights([(k.split(".", 2)[2], v.astype(dtype)) for k, v in w.items()
                            if k.startswith(f"layers.{i}.")])
            mx.eval(p.parameters())
            self.layers.append(p)
        self.thresholds = cal["thresholds"]
        self.density = density
        self.resident_bytes = sum(v.nbytes for p in self.layers for _, v in tree_flatten(p.parameters()))

    @classmethod
    def build(cls, ctx):
        return cls(ctx.folder, ctx.manifest, ctx.density, ctx.dtype)

    def select(self, layer, x):
        p = np.array(mx.sigmoid(self.layers[layer](x.reshape(-1, x.shape[-1]))).astype(mx.float32))
        mask = p >= self.thresholds[layer]
        if self.density < 1.0:
            mask &= top_k_mask(p, self.k(self.density, p.shape[-1]))
        return mask

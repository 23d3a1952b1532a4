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

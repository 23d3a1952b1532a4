"""Activation traces for the paper benchmark: which neurons each token uses.

Random weights have no meaningful activations, so the benchmark's sparsity
comes from a statistical model fitted to the paper's OPT-6.7B figures (paper
Figure 4a, Figure 9, Table 2): about 3 % of a layer's neurons are active per
token, and with a window of k = 5 tokens about 2.4 % of them are new (not
active in the window). A mapping of SmolLM2's traces onto the wider layers
would mislead: SmolLM2 is a SwiGLU model with no natural sparsity — at the
densities that keep its perplexity (50 % and up) its tokens need 10-30x the
paper's share of neurons and nearly all of them on every token (its calibrated
predictor's one-token maximum is 1,524 of 1,536 neurons).

The model: neuron i of a layer has a firing propensity p_i ~ Beta(a, b) with
mean `active`; tokens are independent draws, neuron i active with probability
p_i. Heterogeneous propensities are what make windows pay off: with one p for
all, a window of 5 would save only 14 % of a token's loads; the concentration
a + b is solved so that E[p (1 - p)^k] (the new share per token) = `new`.

`TraceSource` turns a trace into a sparsity source for FlashStore: it runs a
low-rank predictor of the paper's size on the real FFN input (for its cost;
its output on random weights means nothing) and returns the trace's active
set with the paper's predictor errors injected (false negatives: active
neurons it misses; false positives: extra neurons, a fraction of the active
count).
"""

import math

import numpy as np

import mlx.core as mx

from ..errors import FlashError


def _log_beta(a, b):
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def new_share(active, concentration, k):
    """E[p (1 - p)^k] for p ~ Beta(active * s, (1 - active) * s)."""
    a, b = active * concentration, (1 - active) * concentration
    return math.exp(_log_beta(a + 1, b + k) - _log_beta(a, b))


def fit_concentration(active, new, k):
    """The Beta concentration s with new_share(active, s, k) == new."""
    if not 0 < new < active * (1 - active) ** k:
        raise FlashError(
            f"a trace with {active:.1%} active cannot have {new:.1%} new at window {k}: "
            f"independent tokens already give {active * (1 - active) ** k:.2%}; choose less"
        )
    lo, hi = -8.0, 12.0  # log s; new_share grows with s
    for _ in range(100):
        mid = (lo + hi) / 2
        if new_share(active, math.exp(mid), k) < new:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


class TraceModel:
    """Per-layer neuron propensities; `token()` draws one token's active sets."""

    def __init__(self, n_layers, n_neurons, active=0.03, new=0.024, k=5, seed=0):
        self.active, self.new, self.k = active, new, k
        self.concentration = s = fit_concentration(active, new, k)
        self.rng = np.random.default_rng(seed)
        self.p = [self.rng.beta(active * s, (1 - active) * s, n_neurons) for _ in range(n_layers)]

    def token(self):
        return [self.rng.random(p.size) < p for p in self.p]

    def statistics(self, tokens=200, k=None):
        """Measured on a fresh draw: active share, new share at window k, window union share."""
        k = self.k if k is None else k
        rng_state = self.rng.bit_generator.state
        hist, act, new, union = [], [], [], []
        for t in range(tokens):
            m = self.token()[0]
            if len(hist) == k:
                seen = np.logical_or.reduce(hist)
                act.append(m.mean())
                new.append((m & ~seen).mean())
                union.append((seen | m).mean())
                hist.pop(0)
            hist.append(m)
        self.rng.bit_generator.state = rng_state
        return {"active": float(np.mean(act)), "new": float(np.mean(new)),
                "union": float(np.mean(union)), "k": k}


class TraceSource:
    """A FlashStore sparsity source replaying a TraceModel (see the module docstring).

    predictor_rank: run a rank-r predictor per layer (r = 0: no predictor cost).
    false_negative / false_positive: the paper's OPT predictor errors (App. B).
    """

    name = "trace"

    def __init__(self, trace, d_model, predictor_rank=128, false_negative=0.05,
                 false_positive=0.07, dtype=mx.float32, seed=1):
        self.trace = trace
        self.fn, self.fp = false_negative, false_positive
        self.rng = np.random.default_rng(seed)
        self.density = trace.active
        self.predictors = []
        if predictor_rank:
            n = trace.p[0].size
            for _ in trace.p:
                a = mx.random.normal((d_model, predictor_rank), dtype=dtype) * d_model ** -0.5
                b = mx.random.normal((predictor_rank, n), dtype=dtype) * predictor_rank ** -0.5
                self.predictors.append((a, b))
            mx.eval(self.predictors)
        self.resident_bytes = sum(a.nbytes + b.nbytes for a, b in self.predictors)
        self.tokens = []  # this forward's per-token masks, per layer
        self.stats = {"active": 0, "predicted": 0, "missed": 0, "extra": 0}

    def _draw(self):
        masks = self.trace.token()
        out = []
        for m in masks:
            act = np.flatnonzero(m)
            pred = m.copy()
            if self.fn and act.size:
                pred[act[self.rng.random(act.size) < self.fn]] = False
            n_extra = self.rng.binomial(act.size, self.fp) if self.fp else 0
            if n_extra:
                idle = np.flatnonzero(~m)
                pred[self.rng.choice(idle, size=min(n_extra, idle.size), replace=False)] = True
            s = self.stats
            s["active"] += act.size
            s["predicted"] += int(pred.sum())
            s["missed"] += int((m & ~pred).sum())
            s["extra"] += int((pred & ~m).sum())
            out.append(pred)
        return out

    def select(self, layer, x):
        n_tok = int(np.prod(x.shape[:-1]))
        if layer == 0:
            self.tokens = [self._draw() for _ in range(n_tok)]
        if self.predictors:
            a, b = self.predictors[layer]
            p = mx.sigmoid((x.reshape(-1, x.shape[-1]) @ a) @ b)
            np.array(p)  # the predictor's cost: computed and brought to the host, as PredictorSource does
        return np.stack([t[layer] for t in self.tokens])

"""EdgeMoE's statistical expert predictor (§3.3.2): from the expert paths of calibration
tokens, how often expert b of layer l+1 follows expert a of layer l; online, the experts the
current layer chose vote for the next layer's, and the most voted are read ahead.

Knows expert ids only (never models or files). A wrong guess costs a read, never a result.
"""

import numpy as np


class ExpertPathPredictor:
    def __init__(self, n_layers, n_experts):
        self.n_layers, self.n_experts = n_layers, n_experts
        # counts[l, a, b]: tokens that chose a at layer l and b at layer l + 1 (+1: every pair possible)
        self.counts = np.ones((max(n_layers - 1, 1), n_experts, n_experts), dtype=np.float32)

    def fit(self, paths):
        """paths: per token, [experts of layer 0, of layer 1, ...] (arrays of ids)."""
        for path in paths:
            for layer in range(len(path) - 1):
                a, b = np.asarray(path[layer]), np.asarray(path[layer + 1])
                self.counts[layer][np.ix_(a, b)] += 1
        return self

    def predict(self, layer, chosen, m):
        """The m experts of layer + 1 most likely after `chosen` (one or more tokens' ids at `layer`)."""
        votes = self.counts[layer][np.unique(np.asarray(chosen).reshape(-1))].sum(axis=0)
        return np.argsort(-votes, kind="stable")[:m]

"""EdgeMoE's statistical expert predictor (§3.3.2): from the expert paths of calibration
tokens, how often expert b of layer l+1 follows expert a of layer l; online, the experts the
current layer chose vote for the next layer's, and the most voted are read ahead.

The predictor knows expert ids only (expert_calibration.py records them from a model's routing);
`save_paths` / `load_paths` keep its counts in a converted folder. A wrong guess costs a read,
never a result.
"""

from pathlib import Path

import numpy as np

from ..errors import FlashError

PATHS_FILE = "expert_paths.npy"


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

    def precision(self, paths, k):
        """Of the k experts predicted for each next layer of each token, the share it chose."""
        hit = n = 0
        for path in paths:
            for layer in range(len(path) - 1):
                hit += np.isin(self.predict(layer, path[layer], k), path[layer + 1]).sum()
                n += k
        return float(hit / n) if n else None


def save_paths(folder, predictor, info):
    """The counts into `folder`/expert_paths.npy, described in the manifest's calibration section."""
    from ..layout.format import add_manifest_section, sha256_file

    path = Path(folder) / PATHS_FILE
    tmp = path.with_suffix(".partial.npy")
    np.save(tmp, predictor.counts)
    tmp.rename(path)
    entry = {"file": PATHS_FILE, "size": path.stat().st_size, "sha256": sha256_file(path), **info}
    add_manifest_section(folder, "calibration", {"expert_paths": entry}, merge=True)
    return entry


def load_paths(folder, manifest, verify=True):
    """-> (ExpertPathPredictor, the MoE layers it is over) from a calibrated folder."""
    from ..layout.format import check_file

    entry = manifest.calibration.get("expert_paths")
    if entry is None:
        raise FlashError(f"{folder}: --expert-predictor paths needs the expert paths of calibration text: run "
                         f"mlx_flash.calibrate --model {folder}")
    check_file(folder, entry, checksum=verify)
    counts = np.load(Path(folder) / entry["file"])
    layers = entry["layers"]
    predictor = ExpertPathPredictor(len(layers), counts.shape[1])
    if counts.shape != predictor.counts.shape:
        raise FlashError(f"{Path(folder) / entry['file']}: counts {counts.shape}, expected {predictor.counts.shape}")
    predictor.counts = counts
    return predictor, layers

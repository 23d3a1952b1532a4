"""Per-token statistics of a streaming store: the paper's Table 3 columns.

One row per forward pass (a prompt chunk or a decode token): I/O, memory
management, prediction and compute time, bytes read, reads issued, neurons
active and cached (hit rate), the window the caches kept, and (DIP store) the share
of the FFN's weights the pass used. And hidden_share, the share of expert reading a mixture
of experts' compute hid (runtime/stores/experts.py, bench/moe.py).
"""

import time

import numpy as np


def hidden_share(io_s, read_s, wait_s, prefetch_s):
    """Of a mixture of experts' expert reading, the share no layer waited for (compute ran
    meanwhile): 1 - waited / read over the layers' own reads (io_s waited of read_s) and the
    look-ahead's (wait_s of prefetch_s); None when nothing was read."""
    read = read_s + prefetch_s
    # (a wait includes the worker's hand-off: a few microseconds more than a read nothing hid)
    return max(0.0, 1 - (io_s + wait_s) / read) if read > 0 else None


class TokenStats:
    KEYS = ("io_ms", "mem_ms", "predict_ms", "compute_ms", "total_ms", "bytes_read", "reads",
            "active", "hits", "hit_rate", "window", "ffn_share", "tokens")

    def __init__(self):
        self.rows = []
        self.cur = None
        self.t_start = None
        self._early = None  # (io_s, bytes_read, reads) of the next pass before its first layer (early)

    def begin(self, n_tokens):
        now = time.perf_counter()
        if self.cur is not None:
            self.end(now)
        self.cur = dict.fromkeys(self.KEYS, 0)
        self.cur["tokens"] = n_tokens
        self.cur["windows"] = []
        self.t_start = now
        if self._early is not None:  # (its reads came first: their time is the pass's too)
            io_s, self.cur["bytes_read"], self.cur["reads"] = self._early
            self.cur["io_ms"] = 1e3 * io_s
            self.t_start -= io_s
            self._early = None

    def end(self, now=None):
        if self.cur is None:
            return
        c = self.cur
        c["total_ms"] = 1e3 * ((now or time.perf_counter()) - self.t_start)
        c["compute_ms"] = c["total_ms"] - c["io_ms"] - c["mem_ms"] - c["predict_ms"]
        c["hit_rate"] = c["hits"] / c["active"] if c["active"] else 1.0
        w = c.pop("windows")
        c["window"] = float(np.mean(w)) if w else 0.0
        self.rows.append(c)
        self.cur = None

    def early(self, io_s=0.0, bytes_read=0, reads=0):
        """Reads a pass makes before its first layer asks for rows (the input embedding's, read
        from flash): kept, and counted in that pass's row when it begins."""
        e = self._early or (0.0, 0, 0)
        self._early = (e[0] + io_s, e[1] + bytes_read, e[2] + reads)

    def add(self, predict_s=0.0, mem_s=0.0, io_s=0.0, bytes_read=0, reads=0, active=0, hits=0, share=0.0):
        """Add one layer's figures to the current pass. share: the part of the model's FFN
        weights this layer's computation used (its share of the layer / the layers), for
        the stores that choose rows of both sides (0 elsewhere)."""
        c = self.cur
        c["ffn_share"] += share
        c["predict_ms"] += 1e3 * predict_s
        c["mem_ms"] += 1e3 * mem_s
        c["io_ms"] += 1e3 * io_s
        c["bytes_read"] += bytes_read
        c["reads"] += reads
        c["active"] += active
        c["hits"] += hits

    def summary(self, decode_only=True):
        rows = [r for r in self.rows if r["tokens"] == 1] if decode_only else self.rows
        if not rows:
            return {}
        return {f"mean_{k}": float(np.mean([r[k] for r in rows])) for k in self.KEYS if k != "tokens"} | {
            "n_tokens": len(rows)
        }

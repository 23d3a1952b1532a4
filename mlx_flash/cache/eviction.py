"""Eviction policies for caches that are not window-managed (DIP §5.1, §6.4).

A policy sees every use (`touch(ids, step)`) and, when a cache is full,
chooses `n` victims among the cached ids, never one of `protect` (the ids the
current token needs).
- LRU: the least recently used.
- LFU: the least frequently used (ties: least recently used).
- Belady: the one whose next use is farthest in the future — the offline
  optimum, given the whole future access trace (recorded by an earlier run).
"""

import numpy as np


class LRU:
    name = "lru"

    def __init__(self, n_ids):
        self.last = np.full(n_ids, -1, dtype=np.int64)

    def touch(self, ids, step):
        self.last[ids] = step

    def _key(self, ids, step):
        return self.last[ids]

    def victims(self, cached, n, protect, step):
        cand = cached[~np.isin(cached, protect)]
        if n > cand.size:
            raise ValueError(f"need {n} victims, only {cand.size} evictable")
        order = np.lexsort(self._lex(cand, step, protect))
        return cand[order[:n]]

    def _lex(self, cand, step, protect):
        """lexsort keys of the candidates (the last is primary): who leaves first."""
        return (self.last[cand],)


class LFU(LRU):
    name = "lfu"

    def __init__(self, n_ids):
        super().__init__(n_ids)
        self.count = np.zeros(n_ids, dtype=np.int64)

    def touch(self, ids, step):
        super().touch(ids, step)
        self.count[ids] += 1

    def _lex(self, cand, step, protect):
        return (self.last[cand], self.count[cand])


class Belady(LRU):
    """Offline optimum: evict the id used again farthest in the future.

    `trace` is the sequence of id arrays this cache will be asked for, one per
    step (as recorded by a previous run with the same inputs).
    """

    name = "belady"

    def __init__(self, n_ids, trace):
        super().__init__(n_ids)
        self.uses = [[] for _ in range(n_ids)]
        for step, ids in enumerate(trace):
            for i in np.asarray(ids).tolist():
                self.uses[i].append(step)
        self.ptr = np.zeros(n_ids, dtype=np.int64)

    def _next_use(self, i, step):
        u, p = self.uses[i], self.ptr[i]
        while p < len(u) and u[p] <= step:
            p += 1
        self.ptr[i] = p
        return u[p] if p < len(u) else np.iinfo(np.int64).max

    def _lex(self, cand, step, protect):
        nxt = np.array([self._next_use(i, step) for i in cand.tolist()], dtype=np.int64)
        return (-nxt,)


POLICIES = {"lru": LRU, "lfu": LFU, "belady": Belady}


def simulate_hits(policy, trace, capacity):
    """Hit rate of `policy` on an access trace with a cache of `capacity` ids."""
    cached = np.zeros(0, dtype=np.int64)
    hits = total = 0
    for step, need in enumerate(trace):
        need = np.unique(np.asarray(need, dtype=np.int64))
        present = np.isin(need, cached)
        hits += int(present.sum())
        total += need.size
        missing = need[~present]
        over = cached.size + missing.size - capacity
        if over > 0:
            gone = policy.victims(cached, over, need, step)
            cached = cached[~np.isin(cached, gone)]
        cached = np.concatenate([cached, missing])
        policy.touch(need, step)
    return hits / max(total, 1)


class EdgeMoE(LFU):
    """EdgeMoE's expert-buffer eviction (§3.3.3): an expert's use frequency weighted by how soon
    its layer runs again. Ids are layer * n_experts + expert; the layer being served is that of
    the ids the current step needs (`protect`). The score kept is f / d, d = the layers until the
    expert's layer runs next (1 for the next layer, n_layers for the current one): the lowest
    score is evicted first (ties: the least recently used)."""

    name = "edgemoe"

    def __init__(self, n_ids, n_experts, n_layers):
        super().__init__(n_ids)
        self.n_experts, self.n_layers = n_experts, n_layers

    def _lex(self, cand, step, protect):
        protect = np.asarray(protect).reshape(-1)
        current = int(protect[0]) // self.n_experts if protect.size else 0
        distance = (cand // self.n_experts - current - 1) % self.n_layers + 1
        return (self.last[cand], self.count[cand] / distance)


POLICIES["edgemoe"] = EdgeMoE

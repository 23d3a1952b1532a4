"""The expert buffer (EdgeMoE §3.3): preallocated slots shared by every layer's experts.

Knows ids and slots, never files or models: an id is layer * n_experts + expert; a slot
is a row of the store's slab matrices. `place(ids)` says where each wanted id lives,
choosing slots for the missing ones (free slots first, then the eviction policy's
victims, never an id of this call) and recording every use with the policy.
"""

import numpy as np

from .eviction import POLICIES


class ExpertCache:
    def __init__(self, n_slots, n_experts, n_layers, policy="edgemoe"):
        if policy not in ("lru", "lfu", "edgemoe"):
            raise ValueError(f"unknown expert eviction policy {policy!r}")
        n_ids = n_experts * n_layers
        self.n_slots, self.n_experts = n_slots, n_experts
        self.policy = POLICIES[policy](n_ids, n_experts, n_layers) if policy == "edgemoe" else POLICIES[policy](n_ids)
        self.slot_of = np.full(n_ids, -1, dtype=np.int64)
        self.id_in = np.full(n_slots, -1, dtype=np.int64)
        self.step = 0

    def ids(self, layer, experts):
        return layer * self.n_experts + np.asarray(experts, dtype=np.int64)

    def place(self, ids, protect=None, touch=True):
        """Unique ids -> (their slots, the missing ids, the slots to read them into). protect:
        more ids that must stay (a prefetch keeps the experts the current layer computes on);
        touch=False: a prediction, not a use (the policy hears of the use when it comes)."""
        slots, missing, into, _ = self._place(ids, protect, touch)
        return slots, missing, into

    def reserve(self, ids, protect=None):
        """Slots for a prediction's missing ids (not a use) -> (the missing ids, their slots, the ids
        those slots held until now, -1 where free): give_back() undoes it for ids never read."""
        _, missing, into, previous = self._place(ids, protect, touch=False)
        return missing, into, previous

    def give_back(self, ids, slots, previous):
        """Ids reserved but never read: their slots hold their previous ids again (whose bytes were
        never overwritten). Only before any other place() (the store drains its read first)."""
        self.slot_of[ids] = -1
        self.id_in[slots] = previous
        back = previous >= 0
        self.slot_of[previous[back]] = slots[back]

    def _place(self, ids, protect, touch):
        ids = np.asarray(ids, dtype=np.int64)
        keep = ids if protect is None else np.concatenate([ids, np.asarray(protect, dtype=np.int64)])
        if keep.size > self.n_slots:
            raise ValueError(f"{keep.size} experts at once, the buffer has {self.n_slots} slots")
        missing = ids[self.slot_of[ids] < 0]
        free = np.flatnonzero(self.id_in < 0)[: missing.size]
        if free.size < missing.size:
            cached = self.id_in[self.id_in >= 0]
            gone = self.policy.victims(cached, missing.size - free.size, keep, self.step)
            slots = self.slot_of[gone]
            self.slot_of[gone] = -1
            free = np.concatenate([free, slots])
        previous = self.id_in[free]  # (a fancy index: already a copy)
        self.slot_of[missing] = free
        self.id_in[free] = missing
        if touch:
            self.policy.touch(ids, self.step)
            self.step += 1
        return self.slot_of[ids], missing, free, previous

    def forget(self, ids):
        """Drop ids whose slots did not get their bytes (a failed read)."""
        ids = np.asarray(ids, dtype=np.int64)
        slots = self.slot_of[ids]
        self.id_in[slots[slots >= 0]] = -1
        self.slot_of[ids] = -1

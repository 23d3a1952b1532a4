"""Eviction policies: what each evicts, and Belady's optimum on real-looking traces."""

import numpy as np

from mlx_flash.cache.eviction import LFU, LRU, Belady, simulate_hits


def test_lru_and_lfu_choose_the_right_victims():
    lru, lfu = LRU(10), LFU(10)
    for step, ids in enumerate([[1, 2, 3], [1], [1, 2], [4]]):
        lru.touch(np.array(ids), step)
        lfu.touch(np.array(ids), step)
    cached = np.array([1, 2, 3, 4])
    assert lru.victims(cached, 1, np.array([4]), 4).tolist() == [3]  # used at step 0 only
    assert lfu.victims(cached, 2, np.array([]), 4).tolist() == [3, 4]  # used once each; 3 older
    assert lru.victims(cached, 2, np.array([3]), 4).tolist() == [1, 2]


def test_belady_is_optimal_and_beats_lru_lfu():
    rng = np.random.default_rng(0)
    # skewed, drifting popularity: like neuron activations
    N, steps = 200, 300
    pop = rng.zipf(1.5, N).astype(float)
    trace = []
    for t in range(steps):
        p = pop * (1 + np.sin(np.arange(N) / 7 + t / 30)) + 1e-3
        trace.append(rng.choice(N, 20, replace=False, p=p / p.sum()))
    cap = 60
    b = simulate_hits(Belady(N, trace), trace, cap)
    lru = simulate_hits(LRU(N), trace, cap)
    lfu = simulate_hits(LFU(N), trace, cap)
    assert b >= lru and b >= lfu
    assert b > 0.3
    # a tiny trace by hand
    small = [np.array(x) for x in ([0, 1], [2], [0], [3], [1], [0], [2], [3], [0])]
    assert simulate_hits(Belady(4, small), small, 2) >= max(
        simulate_hits(LRU(4), small, 2), simulate_hits(LFU(4), small, 2))

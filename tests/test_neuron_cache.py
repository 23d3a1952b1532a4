"""NeuronCache invariants against a brute-force model, and the FFN on cached rows."""

import numpy as np
import pytest

import mlx.core as mx

from mlx_flash.cache import NeuronCache
from mlx_flash.models.ffn import FFNRows, FlashFFN, activation


def weights_of(ids, d, kind):
    """Deterministic 'flash' content of neuron i, kind k: easy to check."""
    base = {"gate": 1000.0, "up": 2000.0, "down": 3000.0}[kind]
    return (base + 16 * ids[:, None] + np.arange(d)[None, :]).astype(np.float32)


def check(cache, truth, d):
    n = cache.num_used
    assert n == len(truth)
    ids = cache.row_to_id[:n]
    assert set(ids.tolist()) == truth
    assert (cache.row_to_id[n:] == -1).all()
    assert (cache.id_to_row[ids] == np.arange(n)).all()  # inverse map agrees
    assert (cache.id_to_row >= 0).sum() == n
    for k in cache.kinds:  # matrix rows hold the right neuron
        np.testing.assert_array_equal(cache.views[k][:n], weights_of(ids, d, k))
        np.testing.assert_array_equal(np.array(cache.matrices[k][:n]), weights_of(ids, d, k))


@pytest.mark.parametrize("seed", range(5))
def test_random_insert_delete_sequences(seed):
    rng = np.random.default_rng(seed)
    N, d, cap = 300, 8, 120
    cache = NeuronCache(cap, N, d, ("gate", "up", "down"))
    buf_ptr = {k: v.ctypes.data for k, v in cache.views.items()}
    truth = set()
    for step in range(200):
        if truth and rng.random() < 0.5:
            kill = rng.choice(sorted(truth), size=rng.integers(1, len(truth) + 1), replace=False)
            cache.delete(kill)
            truth -= set(kill.tolist())
        free = [i for i in range(N) if i not in truth]
        room = cap - len(truth)
        if room and free:
            new = rng.choice(free, size=min(room, rng.integers(1, 40)), replace=False)
            rows = cache.append(new)
            for k in cache.kinds:
                cache.views[k][rows] = weights_of(new, d, k)
            truth |= set(new.tolist())
        check(cache, truth, d)
    # never reallocated
    assert all(cache.views[k].ctypes.data == p for k, p in buf_ptr.items())


@pytest.mark.parametrize("seed", range(5))
def test_random_replace_sequences(seed):
    # replace(gone, new): the window's step; rows of the neurons that stay never move
    rng = np.random.default_rng(100 + seed)
    N, d, cap = 300, 8, 120
    cache = NeuronCache(cap, N, d, ("gate", "up", "down"))
    truth = set()
    for step in range(200):
        gone = (rng.choice(sorted(truth), size=rng.integers(0, len(truth) + 1), replace=False)
                if truth else np.array([], dtype=np.int64))
        free = [i for i in range(N) if i not in truth]
        room = cap - len(truth) + gone.size
        new = rng.choice(free, size=min(room, rng.integers(0, 60)), replace=False)
        stay = sorted(truth - set(gone.tolist()))
        rows_before = cache.id_to_row[stay].copy()
        rows = cache.replace(gone, new)
        if gone.size >= new.size:
            assert rows.size == new.size and cache.num_used == len(truth) - gone.size + new.size
        if gone.size == new.size:  # the steady window: nothing moved
            np.testing.assert_array_equal(cache.id_to_row[stay], rows_before)
        for k in cache.kinds:
            cache.views[k][rows] = weights_of(new, d, k)
        truth = (truth - set(gone.tolist())) | set(new.tolist())
        check(cache, truth, d)
    with pytest.raises(ValueError, match="cache full"):
        cache.replace(np.array([], dtype=np.int64), np.array(free[: cap - len(truth) + 1]))


def test_capacity_and_misuse():
    cache = NeuronCache(4, 10, 2, ("up", "down"))
    cache.append(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="cache full"):
        cache.append(np.array([4, 5]))
    with pytest.raises(AssertionError):
        cache.append(np.array([2]))
    with pytest.raises(AssertionError):
        cache.delete(np.array([7]))


class RowsStore:
    def __init__(self, cache):
        self.cache = cache

    def rows(self, layer, x):
        m, ids = self.cache.rows()
        return FFNRows(up=m["up"], down=m["down"], gate=m.get("gate"), ids=ids)


@pytest.mark.parametrize("gated", [True, False])
def test_ffn_on_cache_equals_dense_ffn_restricted_to_those_neurons(gated):
    rng = np.random.default_rng(0)
    N, d = 64, 16
    W = {k: rng.standard_normal((N, d)).astype(np.float32) for k in ("gate", "up", "down")}
    b_up, b_down = rng.standard_normal(N).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    kinds = ("gate", "up", "down") if gated else ("up", "down")
    cache = NeuronCache(40, N, d, kinds)
    keep = rng.choice(N, 30, replace=False)
    rows = cache.append(keep)
    for k in kinds:
        cache.views[k][rows] = W[k][keep]
    cache.delete(keep[:7])  # shuffle rows around
    keep = keep[7:]
    act = activation("silu" if gated else "relu")
    ffn = FlashFFN(0, d, N, act, gated=gated, bias=not gated)
    if not gated:
        ffn.up_bias, ffn.down_bias = mx.array(b_up), mx.array(b_down)
    ffn.store = RowsStore(cache)
    x = rng.standard_normal((3, d)).astype(np.float32)
    got = np.array(ffn(mx.array(x)))
    mask = np.zeros(N, bool)
    mask[keep] = True
    if gated:
        g = x @ W["gate"].T
        h = g / (1 + np.exp(-g)) * (x @ W["up"].T)
        want = (h * mask) @ W["down"]
    else:
        h = np.maximum(x @ W["up"].T + b_up, 0)
        want = (h * mask) @ W["down"] + b_down
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_move_rows_native_matches_numpy():
    from mlx_flash.io import native

    rng = np.random.default_rng(3)
    v = rng.standard_normal((50, 7)).astype(np.float32)
    dst, src = np.array([1, 4, 9]), np.array([40, 45, 49])
    want = v.copy()
    want[dst] = want[src]
    native.move_rows(v, dst, src)
    assert (v == want).all()
    mod = native.native_module()[0]
    if mod is None:
        pytest.skip("native extension not built")
    with pytest.raises(IndexError):
        mod.move_rows(v, v.strides[0], np.array([50]), np.array([0]))

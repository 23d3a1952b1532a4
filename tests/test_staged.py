"""Staged cache writes (issue 20, item 2): rows enter the caches through a host staging copy and a
device-side scatter, never by host writes into memory MLX computes on. On the CPU (forced with
cache_writes="staged") every mode gives the host path's logits and tokens."""

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.cache import NeuronCache
from mlx_flash.errors import FlashError
from mlx_flash.runtime import FlashConfig
from mlx_flash.runtime.config import staged_caches
from mlx_flash.sparsity.allocation import calibrate_thresholds

PROMPT = [1, 5, 9, 33, 70, 12, 4, 100, 7, 250, 3]
WORDS = "the quick brown fox jumps over the lazy dog hello world paris is the capital".split()


@pytest.fixture(scope="module")
def folder(tiny_llama):
    out, _, _, _, d = tiny_llama("staged", "float32", dip=True, intermediate_size=256, num_hidden_layers=4)
    (d / "cal.txt").write_text(" ".join(np.random.default_rng(0).choice(WORDS, 2000)))
    calibrate_thresholds(out, data=str(d / "cal.txt"), tokens=256, seq_len=32, progress=False, log=lambda m: None)
    return out


def test_the_cache_moves_rows_on_the_device():
    """append / replace / delete on a staged cache keep every id's row, as the host cache does."""
    rng = np.random.default_rng(0)
    n, d, cap = 40, 8, 12
    weights = rng.standard_normal((n, d)).astype(np.float32)
    host, staged = (NeuronCache(cap, n, d, ("up",), staged=s) for s in (False, True))
    assert staged.weights_bytes == 2 * host.weights_bytes and not staged.host_readable

    def fill(cache, ids, rows):
        cache.views["up"][rows] = weights[ids]

    for step in range(30):
        cached = host.cached_ids()
        gone = rng.choice(cached, size=min(cached.size, rng.integers(0, 5)), replace=False) if cached.size else cached
        room = cap - host.num_used + gone.size
        new = rng.choice(np.setdiff1d(np.arange(n), cached), size=min(room, rng.integers(0, 6)), replace=False)
        for c in (host, staged):
            if step % 3 == 0:
                c.delete(gone)
                rows = c.append(new)
            else:
                rows = c.replace(gone, new)
            fill(c, new, rows)
            if step % 4 == 1:  # rows handed out (committed) only now and then: staged rows must survive moves
                c.rows()
        m_host, ids_host = host.rows()
        m_st, ids_st = staged.rows()
        np.testing.assert_array_equal(np.array(ids_host), np.array(ids_st))
        np.testing.assert_array_equal(np.array(m_st["up"]), weights[np.array(ids_st)])
        np.testing.assert_array_equal(np.array(m_host["up"]), np.array(m_st["up"]))


def test_commit_upto_leaves_rows_in_flight():
    c = NeuronCache(6, 10, 4, ("up",), staged=True)
    rows = c.append(np.array([3, 4]))
    c.views["up"][rows] = 1.0
    c.rows()
    more = c.append(np.array([7, 8]))
    c.views["up"][more] = 2.0
    m, _ = c.rows(upto=2)  # rows 2, 3 are still being read: not committed
    assert np.array(m["up"])[2:].sum() == 0
    m, _ = c.rows()
    assert (np.array(m["up"])[2:] == 2.0).all()


CONFIGS = [dict(mode="naive"), dict(mode="hybrid"), dict(mode="naive", prefetch=False),
           dict(mode="flash", sparsity="oracle", density=0.5, memory_budget="95%"),
           dict(mode="flash", sparsity="threshold", density=0.4),
           dict(mode="flash", sparsity="oracle", density=0.5, prefetch=False),
           dict(mode="flash", sparsity="dip", density=0.5, memory_budget="75%"),
           dict(mode="flash", sparsity="dip-ca", density=0.5),  # its choices depend on the capacity: none here
           dict(mode="flash", sparsity="calibrated", density=0.5, memory_budget="75%")]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_staged_equals_host(folder, cfg):
    from mlx_lm.generate import generate_step

    out = {}
    for writes in ("host", "staged"):
        model, _ = mlx_flash.load(folder, cache_writes=writes, **cfg)
        assert model.runtime.store.staged == (writes == "staged")
        logits = np.array(model(mx.array([PROMPT])))
        toks = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)]
        out[writes] = (logits, toks, model.runtime.stats()["summary"])
        model.runtime.close()
    np.testing.assert_allclose(out["staged"][0], out["host"][0], atol=1e-4)
    assert out["staged"][1] == out["host"][1]
    assert out["staged"][2].get("mean_bytes_read", 0) > 0  # the rows really streamed


def test_the_choice_and_its_errors(folder):
    assert staged_caches(FlashConfig(mode="flash"), on_cpu=True) is False
    assert staged_caches(FlashConfig(mode="flash"), on_cpu=False) is True
    assert staged_caches(FlashConfig(mode="flash", cache_writes="host"), on_cpu=False) is False
    with pytest.raises(FlashError, match="not dense"):
        FlashConfig(mode="dense", cache_writes="staged")
    with pytest.raises(FlashError, match="unknown cache writes"):
        FlashConfig(mode="naive", cache_writes="gpu")
    with pytest.raises(FlashError, match="float16-held rows"):
        mlx_flash.load(folder, mode="naive", memory_budget="80%", cache_writes="staged", ffn_rows="quantized")

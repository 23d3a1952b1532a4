"""Dynamic Input Pruning on flash: exact at full density, the paper's math at lower ones."""

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from helpers import make_llama_folder

PROMPT = [1, 5, 9, 33, 70, 12, 4, 100, 7, 250, 3]


def greedy(model, n=10):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.fixture(scope="module")
def folder(tiny_llama):
    m = tiny_llama("dip", "float32", dip=True, intermediate_size=256)
    return m.flash, m.config, m.tensors


def test_full_density_is_exact_even_when_streaming(folder):
    path, _, _ = folder
    dense, _ = mlx_flash.load(path)
    want = np.array(dense(mx.array([PROMPT])))
    for budget in (None, "70%"):
        model, _ = mlx_flash.load(path, mode="flash", sparsity="dip", density=1.0, memory_budget=budget)
        np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), want, atol=1e-4)
        assert greedy(model) == greedy(dense)
        if budget:
            plan = model.runtime.plan
            assert plan.dip_capacity[1] < 256  # the caches cannot hold it all: scratch streams
            resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
            assert resident + model.runtime.store.weights_bytes <= model.runtime.budget_bytes


def test_layer_output_matches_the_dip_equations(folder):
    """One token through one layer: top-k |x| columns, then top-k |GLU~| rows (Eqs. 7-8)."""
    path, cfg, t = folder
    density = 0.5
    model, _ = mlx_flash.load(path, mode="flash", sparsity="dip", density=density, memory_budget="75%")
    x = np.random.default_rng(3).standard_normal((1, 1, cfg["hidden_size"])).astype(np.float32)
    model.layers[0].mlp.store.stats.begin(1)
    got = np.array(model.layers[1].mlp(mx.array(x)))[0, 0]
    p = "model.layers.1.mlp."
    G, U, D = t[p + "gate_proj.weight"], t[p + "up_proj.weight"], t[p + "down_proj.weight"]
    x1 = x[0, 0]
    k_in, k_out = round(density * x1.size), round(density * G.shape[0])
    keep = np.argsort(-np.abs(x1))[:k_in]
    xm = np.zeros_like(x1)
    xm[keep] = x1[keep]
    g, u = G @ xm, U @ xm
    h = g / (1 + np.exp(-g)) * u
    sel = np.argsort(-np.abs(h))[:k_out]
    hm = np.zeros_like(h)
    hm[sel] = h[sel]
    np.testing.assert_allclose(got, D @ hm, rtol=1e-4, atol=1e-4)


def test_dip_ca_with_gamma_one_is_dip(folder):
    path, _, _ = folder
    a, _ = mlx_flash.load(path, mode="flash", sparsity="dip", density=0.5, memory_budget="75%")
    b, _ = mlx_flash.load(path, mode="flash", sparsity="dip-ca", density=0.5, memory_budget="75%", gamma=1.0)
    c, _ = mlx_flash.load(path, mode="flash", sparsity="dip-ca", density=0.5, memory_budget="75%", gamma=0.2)
    assert greedy(a) == greedy(b)
    greedy(c)
    stats = c.runtime.store.stats
    stats.end()
    hit_ca = np.mean([r["hit_rate"] for r in stats.rows if r["tokens"] == 1])
    stats = a.runtime.store.stats
    stats.end()
    hit_dip = np.mean([r["hit_rate"] for r in stats.rows if r["tokens"] == 1])
    assert hit_ca >= hit_dip  # re-weighting prefers cached entries (DIP §5.2)


def test_dip_needs_the_orientation_and_a_gated_ffn(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    plain = convert(src, tmp_path / "plain", dtype="float32", progress=False)
    with pytest.raises(FlashError, match="--dip"):
        mlx_flash.load(plain, mode="flash", sparsity="dip", density=0.5)


def test_dip_store_keeps_no_per_token_history_by_default(folder):
    """The ids of every token were kept for Belady replays: memory grew with every token."""
    import gc
    import sys

    path, _, _ = folder
    model, _ = mlx_flash.load(path, mode="flash", sparsity="dip", density=0.5)
    store = model.runtime.store
    greedy(model, 2)
    gc.collect()
    before = sum(sys.getsizeof(o) for o in gc.get_objects() if isinstance(o, np.ndarray))
    greedy(model, 40)
    gc.collect()
    after = sum(sys.getsizeof(o) for o in gc.get_objects() if isinstance(o, np.ndarray))
    assert store.trace is None and after - before < 64 * 1024  # nothing kept per token
    from mlx_flash.runtime.stores.dip import DIPStore

    kept = DIPStore(path, model.runtime.manifest, store.plan, store.reader, store.act, 0.5,
                    record_trace=True)
    assert kept.trace is not None and kept.trace[0]["in"] == []

"""The sparse runtime: modes, windowed caches, the budget, per-token stats."""

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from helpers import make_llama_folder

PROMPT = [1, 5, 9, 33, 70, 12, 4, 100, 7, 250, 3]


def greedy(model, n=16):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.fixture(scope="module")
def relu_llama(tiny_llama):
    return tiny_llama("sparse", "float16", hidden_act="relu", intermediate_size=256).flash


@pytest.fixture(scope="module")
def dense(relu_llama):
    model, _ = mlx_flash.load(relu_llama)
    return model, greedy(model), np.array(model(mx.array([PROMPT])))


@pytest.mark.parametrize("mode", ["naive", "hybrid"])
def test_baselines_are_exact(relu_llama, dense, mode):
    model, _ = mlx_flash.load(relu_llama, mode=mode)
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), dense[2], atol=1e-4)
    assert greedy(model) == dense[1]
    rows = model.runtime.store.stats.rows
    lay = model.runtime.manifest.layout
    streamed = lay.n_neurons if mode == "naive" else lay.n_neurons - lay.n_neurons // 2
    assert rows[-1]["bytes_read"] >= 2 * streamed * lay.bundle_bytes  # every token re-reads


def test_oracle_with_infinite_window_is_dense(relu_llama, dense):
    """ReLU + oracle: exactly the non-zero neurons; with every neuron kept, tokens equal dense."""
    model, _ = mlx_flash.load(relu_llama, mode="flash", sparsity="oracle", window=None)
    assert greedy(model) == dense[1]
    store = model.runtime.store
    store.stats.end()
    decode = [r for r in store.stats.rows if r["tokens"] == 1]
    assert decode and decode[-1]["hit_rate"] > 0.5  # the window keeps reused neurons
    assert sum(r["bytes_read"] for r in store.stats.rows) > 0


def test_windowed_flash_under_a_budget(relu_llama, dense):
    # threshold on a ReLU gate is exact and keeps only the gate resident
    model, _ = mlx_flash.load(relu_llama, mode="flash", sparsity="threshold", memory_budget="85%", window=2)
    plan = model.runtime.plan
    assert plan.capacity < model.runtime.manifest.layout.n_neurons
    assert plan.weights_bytes <= model.runtime.budget_bytes
    store = model.runtime.store
    resident = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    held = resident + store.weights_bytes + store.source.resident_bytes
    assert held <= model.runtime.budget_bytes, (held, model.runtime.budget_bytes)
    out = greedy(model)
    assert out == dense[1]  # ReLU oracle is exact whatever the window
    store.stats.end()
    for r in store.stats.rows:
        assert set(r) >= {"io_ms", "mem_ms", "compute_ms", "bytes_read", "reads", "hit_rate", "window"}
        assert r["window"] <= 2


def test_budget_errors(relu_llama):
    with pytest.raises(FlashError, match="too small"):
        mlx_flash.load(relu_llama, mode="flash", sparsity="oracle", memory_budget="1%")
    with pytest.raises(FlashError, match="over the budget"):
        mlx_flash.load(relu_llama, mode="dense", memory_budget="50%")
    with pytest.raises(FlashError, match="cannot read"):
        mlx_flash.load(relu_llama, mode="flash", memory_budget="lots")


def test_top_k_density_is_per_token_whatever_the_window(tmp_path):
    """Cached neurons of earlier tokens are masked: density means the token's own top-k."""
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=256)
    path = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    outs = []
    for window in (1, 8):
        model, _ = mlx_flash.load(path, mode="flash", sparsity="oracle", density=0.3, window=window)
        outs.append(greedy(model))
    assert outs[0] == outs[1]
    dense, _ = mlx_flash.load(path)
    full, _ = mlx_flash.load(path, mode="flash", sparsity="oracle", density=1.0, window=1)
    assert greedy(full) == greedy(dense)


def test_too_many_neurons_splits_a_batch_of_single_tokens():
    """4 sequences x 1 position whose union does not fit: split the batch, not the length-1 axis."""
    from mlx_flash.runtime import TooManyNeurons
    from mlx_flash.models.ffn import FFNRows, FlashFFN

    rng = np.random.default_rng(0)
    up, down = (mx.array(rng.standard_normal((32, 8)).astype(np.float32)) for _ in range(2))

    class OneAtATime:  # a store whose caches hold one token's rows at a time
        def rows(self, layer, x):
            if int(np.prod(x.shape[:-1])) > 1:
                raise TooManyNeurons()
            return FFNRows(up=up, down=down)

    ffn = FlashFFN(0, 8, 32, nn.relu, gated=False)
    ffn.store = OneAtATime()
    x = mx.array(rng.standard_normal((4, 1, 8)).astype(np.float32))
    want = nn.relu(x @ up.T) @ down
    np.testing.assert_allclose(np.array(ffn(x)), np.array(want), rtol=1e-5, atol=1e-5)
    y = mx.array(rng.standard_normal((1, 3, 8)).astype(np.float32))
    np.testing.assert_allclose(np.array(ffn(y)), np.array(nn.relu(y @ up.T) @ down), rtol=1e-5, atol=1e-5)


def test_too_small_budget_is_refused_before_reading_weights(relu_llama, monkeypatch):
    """A budget below the resident weights is refused from the file header: a memory limit
    must not kill the process while it loads weights the planner would refuse anyway."""
    def no_load(*a, **k):
        raise AssertionError("resident weights were read")

    monkeypatch.setattr(mx, "load", no_load)
    with pytest.raises(FlashError, match="too small"):
        mlx_flash.load(relu_llama, mode="flash", sparsity="oracle", memory_budget="1%")


@pytest.mark.parametrize("mode", ["naive", "hybrid"])
def test_prefetch_reads_the_next_layer_during_this_one(relu_llama, dense, mode):
    """Two streaming buffers; same logits, tokens and bytes per token as reading in the layer."""
    sync, _ = mlx_flash.load(relu_llama, mode=mode, prefetch=False)
    model, _ = mlx_flash.load(relu_llama, mode=mode)  # prefetch is the default
    plan, store = model.runtime.plan, model.runtime.store
    assert plan.prefetch and not sync.runtime.plan.prefetch
    assert len(store.buffers) == 2 and plan.scratch_rows == 2 * sync.runtime.plan.scratch_rows
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), dense[2], atol=1e-4)
    assert greedy(model) == dense[1] == greedy(sync)
    assert store._pending is not None  # the next token's first layer is already on its way
    a = [r["bytes_read"] for r in store.stats.rows[1:]]
    b = [r["bytes_read"] for r in sync.runtime.store.stats.rows[1:]]
    assert a[:-1] == b[: len(a) - 1] and a[0] > 0
    # a forward that does not start at layer 0 (the pending read is for layer 0): read inline
    x = mx.ones((1, 1, model.args.hidden_size))
    ffn = model.layers[1].mlp
    y_pre = ffn(x)
    ffn_sync = sync.layers[1].mlp
    np.testing.assert_allclose(np.array(y_pre), np.array(ffn_sync(x)), atol=1e-5)


def test_prefetch_read_error_surfaces_in_the_layer(relu_llama):
    import errno

    from mlx_flash.io import ReadError

    model, _ = mlx_flash.load(relu_llama, mode="naive")
    greedy(model, 2)
    model.runtime.store.reader._fault = (0, errno.EIO)  # every layer's first bundle fails
    with pytest.raises(ReadError, match="EIO"):
        greedy(model, 2)


def test_prefetch_plan_counts_both_buffers():
    from mlx_flash.runtime.budget import make_plan

    n, layers, f = 100, 4, 12
    naive = make_plan("naive", 10_000, 1000, 0, f, layers, n, prefetch=True)
    assert naive.scratch_rows == 2 * n and naive.weights_bytes == 1000 + 2 * n * f
    h1 = make_plan("hybrid", 3500, 1000, 0, f, layers, n)
    h2 = make_plan("hybrid", 3500, 1000, 0, f, layers, n, prefetch=True)
    assert h2.scratch_rows == 2 * (n - h2.capacity) and h2.capacity < h1.capacity
    assert h2.weights_bytes <= 3500 and h1.weights_bytes <= 3500
    assert not make_plan("flash", None, 0, 0, f, layers, n, prefetch=True).prefetch


def test_flash_overlap_reads_while_the_cached_neurons_compute(relu_llama, dense):
    """The missing neurons are read in a worker while the FFN computes on the cached ones:
    same logits, tokens, bytes and reads as reading first."""
    kw = dict(mode="flash", sparsity="threshold", memory_budget="85%", window=2)
    seq, _ = mlx_flash.load(relu_llama, prefetch=False, **kw)
    ovl, _ = mlx_flash.load(relu_llama, **kw)  # overlap is the default
    store = ovl.runtime.store
    assert store.overlap and not seq.runtime.store.overlap
    calls = []
    orig = store._overlapped
    store._overlapped = lambda *a: calls.append(1) or orig(*a)
    np.testing.assert_allclose(np.array(ovl(mx.array([PROMPT]))), np.array(seq(mx.array([PROMPT]))),
                               atol=1e-5)
    assert greedy(ovl) == greedy(seq) == dense[1]
    a, b = ovl.runtime.store.stats.rows, seq.runtime.store.stats.rows
    for key in ("bytes_read", "reads", "hits", "active"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert sum(r["bytes_read"] for r in a[2:]) > 0 and len(calls) > 10  # the overlap ran


def test_flash_overlap_read_error_surfaces(relu_llama):
    import errno

    from mlx_flash.io import ReadError

    model, _ = mlx_flash.load(relu_llama, mode="flash", sparsity="threshold", memory_budget="85%",
                              window=2)
    greedy(model, 2)
    model.runtime.store.reader._fault = (0, errno.EIO)
    with pytest.raises(ReadError, match="EIO"):
        for _ in range(20):  # until a token misses neuron 0 of some layer
            greedy(model, 4)

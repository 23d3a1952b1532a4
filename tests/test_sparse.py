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
def relu_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("sparse")
    src, _, _ = make_llama_folder(d / "hf", "llama", hidden_act="relu", intermediate_size=256)
    return convert(src, d / "flash", dtype="float16", progress=False)


@pytest.fixture(scope="module")
def dense(relu_llama):
    model, _ = mlx_flash.load(relu_llama)
    return model, greedy(model), np.array(model(mx.array([PROMPT])))


@pytest.mark.parametrize("mode", ["naive", "hybrid"])
def test_baselines_are_exact(relu_llama, dense, mode):
    model, _ = mlx_flash.load(relu_llama, mode=mode)
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), dense[2], atol=1e-4)
    assert greedy(model) == dense[1]
    rows = model.flash["store"].stats.rows
    lay = model.flash["manifest"].layout
    streamed = lay.n_neurons if mode == "naive" else lay.n_neurons - lay.n_neurons // 2
    assert rows[-1]["bytes_read"] >= 2 * streamed * lay.bundle_bytes  # every token re-reads


def test_oracle_with_infinite_window_is_dense(relu_llama, dense):
    """ReLU + oracle: exactly the non-zero neurons; with every neuron kept, tokens equal dense."""
    model, _ = mlx_flash.load(relu_llama, mode="flash", sparsity="oracle", window=None)
    assert greedy(model) == dense[1]
    store = model.flash["store"]
    store.stats.end()
    decode = [r for r in store.stats.rows if r["tokens"] == 1]
    assert decode and decode[-1]["hit_rate"] > 0.5  # the window keeps reused neurons
    assert sum(r["bytes_read"] for r in store.stats.rows) > 0


def test_windowed_flash_under_a_budget(relu_llama, dense):
    # threshold on a ReLU gate is exact and keeps only the gate resident
    model, _ = mlx_flash.load(relu_llama, mode="flash", sparsity="threshold", memory_budget="85%", window=2)
    plan = model.flash["plan"]
    assert plan.capacity < model.flash["manifest"].layout.n_neurons
    assert plan.weights_bytes <= model.flash["budget_bytes"]
    store = model.flash["store"]
    resident = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    held = resident + store.weights_bytes + store.source.resident_bytes
    assert held <= model.flash["budget_bytes"], (held, model.flash["budget_bytes"])
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
    from mlx_flash.flash_store import TooManyNeurons
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

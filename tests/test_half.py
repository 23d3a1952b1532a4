"""Weights held in DRAM at 16 bits, converted to float32 just before use (models/half.py)."""

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.generate import generate_step

import mlx_flash
from mlx_flash.kernels import kernels_module
from mlx_flash.cache import NeuronCache
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from mlx_flash.models.half import Arena, HalfEmbedding, HalfLinear
from mlx_flash.runtime.budget import make_plan
from helpers import make_llama_folder

PROMPT = [1, 5, 9, 33, 70, 12, 4, 100, 7, 250, 3]


def greedy(model, n=16):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_linear_and_embedding_equal_float32(dtype):
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((1000, 96)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal(1000).astype(np.float32))
    x = mx.array(rng.standard_normal((2, 3, 96)).astype(np.float32))
    arena = Arena(96 * 128)  # 8 chunks of 128 rows: the chunking is exercised
    w32 = w.astype(mx.float32)
    lin = HalfLinear(w, b, arena)
    np.testing.assert_allclose(np.array(lin(x)), np.array(x @ w32.T + b), rtol=1e-6, atol=1e-5)
    emb = HalfEmbedding(w, arena)
    ids = mx.array([[0, 999, 5]])
    assert (np.array(emb(ids)) == np.array(w32[ids])).all()  # lookups: bit-exact
    np.testing.assert_allclose(np.array(emb.as_linear(x)), np.array(x @ w32.T), rtol=1e-6, atol=1e-5)
    assert lin.weight.dtype == dtype and emb.weight.dtype == dtype  # nothing float32 kept


def test_held_neuron_cache_hands_out_float32_rows():
    rng = np.random.default_rng(1)
    kinds, d = ("gate", "up", "down"), 8
    arena = Arena(10 * len(kinds) * d)
    cache = NeuronCache(10, 50, d, kinds, arena=arena)
    assert all(v.dtype == np.float16 for v in cache.views.values())
    truth = {k: rng.standard_normal((50, d)).astype(np.float16) for k in kinds}
    ids = np.array([3, 7, 11, 40, 2])
    rows = cache.append(ids)
    for k in kinds:
        cache.views[k][rows] = truth[k][ids]
    cache.delete(np.array([7, 40]))  # swap-delete moves float16 rows
    m, got_ids = cache.rows()
    for k in kinds:
        assert m[k].dtype == mx.float32
        assert (np.array(m[k]) == truth[k][np.array(got_ids)].astype(np.float32)).all()
    with pytest.raises(AssertionError):
        NeuronCache(11, 50, d, kinds, arena=arena)  # the arena must hold a whole cache


@pytest.fixture(scope="module")
def llama16(tiny_llama):
    return tiny_llama("half", "float16", intermediate_size=256).flash


@pytest.fixture(scope="module")
def reference(llama16):
    model, _ = mlx_flash.load(llama16)
    weights = model.runtime.store.weights_bytes
    return greedy(model), np.array(model(mx.array([PROMPT]))), weights


@pytest.mark.parametrize("mode,budget", [("dense", None), ("naive", "95%"), ("hybrid", "75%"),
                                         ("hybrid", None)])
def test_held_model_matches_float32(llama16, reference, mode, budget):
    # (2 layers: prefetch's second buffer would cost more than a 75 % budget leaves)
    no_prefetch = {} if mode == "dense" else {"prefetch": False}  # (dense reads nothing: refused there)
    # (the input embedding held, not left on flash under the budget: this test is of what is held)
    model, _ = mlx_flash.load(llama16, mode=mode, memory_budget=budget, resident_dtype="float16",
                              stream_embeddings="off", **no_prefetch)
    assert model.runtime.resident_dtype == "float16"
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, HalfLinear) and attn.q_proj.weight.dtype == mx.float16
    # a decode step's products on the CPU: the native 16-bit kernel, where it is built
    assert (attn.q_proj._kernels is not None) == (kernels_module()[0] is not None)
    assert isinstance(model.model.embed_tokens, HalfEmbedding)
    assert model.layers[0].input_layernorm.weight.dtype == mx.float32
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), reference[1], rtol=1e-5, atol=1e-4)
    assert greedy(model) == reference[0]
    if mode == "dense":  # every FFN row at float16 + one float32 layer of arena
        lay = model.runtime.manifest.layout
        layer32 = len(lay.kinds) * lay.d_model * lay.n_neurons * 4
        assert model.runtime.store.weights_bytes == reference[2] // 2 + layer32
    if budget:
        plan = model.runtime.plan
        assert plan.weights_bytes <= model.runtime.budget_bytes
        if mode == "hybrid":  # float16 caches: twice the resident neurons of float32 ones, or more
            f32, _ = mlx_flash.load(llama16, mode=mode, memory_budget=budget, prefetch=False, stream_embeddings="off")
            assert plan.held_neuron_bytes and plan.capacity >= 2 * f32.runtime.plan.capacity
            assert model.runtime.store.weights_bytes <= plan.ffn_dram_bytes


def test_held_budget_is_a_share_of_the_float32_model(llama16):
    a, _ = mlx_flash.load(llama16, mode="naive", memory_budget="90%", prefetch=False)
    b, _ = mlx_flash.load(llama16, mode="naive", memory_budget="90%", resident_dtype="float16",
                          prefetch=False)
    assert a.runtime.budget_bytes == b.runtime.budget_bytes
    arena = b.layers[0].self_attn.q_proj._arena.nbytes  # counted in the resident bytes
    assert b.runtime.plan.resident_bytes - arena < 0.6 * a.runtime.plan.resident_bytes


def test_held_dtype_errors(llama16, tmp_path):
    with pytest.raises(FlashError, match="would round"):
        mlx_flash.load(llama16, resident_dtype="bfloat16")
    with pytest.raises(FlashError, match="unsupported resident dtype"):
        mlx_flash.load(llama16, resident_dtype="int8")
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    f32 = convert(src, tmp_path / "flash32", dtype="float32", progress=False)
    with pytest.raises(FlashError, match="convert it with --dtype float16"):
        mlx_flash.load(f32, resident_dtype="float16")


def test_held_hybrid_plan_fills_the_budget():
    n, layers, f = 100, 4, 12  # 12 bytes per float32 neuron, 6 held
    plan = make_plan("hybrid", 1000 + n * f + 3 * layers * 6 * 10, 1000, 0, f, layers, n,
                     held_neuron_bytes=6)
    assert plan.capacity == 30 and plan.scratch_rows == 70 and plan.arena_rows == 30
    assert plan.weights_bytes <= plan.budget_bytes
    with pytest.raises(FlashError):
        make_plan("flash", None, 0, 0, f, layers, n, held_neuron_bytes=6)


def test_held_hybrid_with_prefetch_converts_the_next_layer_meanwhile(llama16, reference):
    model, _ = mlx_flash.load(llama16, mode="hybrid", resident_dtype="float16")  # prefetch default
    store = model.runtime.store
    assert model.runtime.plan.prefetch and len(store.arenas) == 2 and len(store.buffers) == 2
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), reference[1], rtol=1e-5, atol=1e-4)
    assert greedy(model) == reference[0]
    assert store.weights_bytes <= model.runtime.plan.ffn_dram_bytes


@pytest.mark.skipif(kernels_module()[0] is None, reason="native kernels not built")
def test_held_dense_verify_pass_equals_its_decode_steps_to_the_bit(llama16):
    # a pass of a few positions (speculative decoding's verify pass) goes through the same
    # one-token kernels as a decode step, position by position: the FFN's and the tied
    # output head's values are a decode step's exactly
    model, _ = mlx_flash.load(llama16, mode="dense", resident_dtype="float16")
    d = model.args.hidden_size
    x = mx.array(np.random.default_rng(3).standard_normal((1, 3, d)).astype(np.float32))
    ffn = model.layers[0].mlp
    both = np.array(ffn(x))
    steps = np.concatenate([np.array(ffn(x[:, i : i + 1])) for i in range(3)], axis=1)
    assert (both == steps).all()
    head = model.model.embed_tokens
    assert (np.array(head.as_linear(x)) ==
            np.concatenate([np.array(head.as_linear(x[:, i : i + 1])) for i in range(3)], axis=1)).all()


def test_only_the_lm_head_computes_a_prompts_pass_lazily(llama16):
    # a prompt chunk's logits are dropped by mlx_lm's prefill: the head computes them lazily
    # (never, when dropped; runtime/memory.py then counts no chunk of logits), the other
    # held weights eagerly through the arena
    model, _ = mlx_flash.load(llama16, mode="dense", resident_dtype="float16")
    assert model.lm_head._head and not model.layers[0].self_attn.q_proj._head
    x = mx.array(np.random.default_rng(5).standard_normal((1, 9, model.args.hidden_size)).astype(np.float32))
    w = model.lm_head.weight.astype(mx.float32)
    np.testing.assert_allclose(np.array(model.lm_head(x)), np.array(x @ w.T), rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(kernels_module()[0] is None, reason="native kernels not built")
def test_held_hybrid_decode_step_reads_its_float16_cache_in_place(llama16, reference):
    # a decode step: the held float16 rows and the streamed ones through the kernels, nothing
    # converted into the arenas; a prompt: converted (also after decode steps, whose prefetch
    # converted nothing); the tokens and logits of the float32 model either way
    model, _ = mlx_flash.load(llama16, mode="hybrid", resident_dtype="float16")  # (half of each layer held)
    store, d = model.runtime.store, model.args.hidden_size
    assert model.runtime.plan.prefetch
    assert 0 < model.runtime.plan.capacity < model.runtime.plan.n_neurons
    one = mx.array(np.ones((1, 1, d), dtype=np.float32))
    parts = store.rows(0, one)
    assert len(parts) == 2 and all(p.select is not None for p in parts)
    assert parts[0].select[0]["up"].dtype == np.float16 and parts[1].select[0]["up"].dtype == np.float32
    assert [int(i) for p in parts for i in np.array(p.ids)] == list(range(model.runtime.plan.n_neurons))
    prompt = store.rows(1, mx.array(np.ones((1, 8, d), dtype=np.float32)))
    assert all(p.select is None and p.up.dtype == mx.float32 for p in prompt)
    assert greedy(model) == reference[0]
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), reference[1], rtol=1e-5, atol=1e-4)
    model.runtime.close()


@pytest.mark.skipif(kernels_module()[0] is None, reason="native kernels not built")
@pytest.mark.parametrize("mode", ["dense", "hybrid"])
def test_a_held_model_s_batch_step_goes_through_the_pass_kernels(llama16, mode, monkeypatch):
    """A batch's decode step of more than SMALL_PASS sequences over weights held at float16 (a
    dense FFN, a hybrid's float16 cache and its streamed float32 rows, the attention and the tied
    head): each row converted once into the pass kernels' tiles (gather_mm / gather_mm_cols), not
    a float32 arena for BLAS, where the CPU has AVX2 or AVX-512; BLAS at level 0. Each prompt
    gets the tokens it gets alone at every level, and a step's values are each sequence's
    decode step's to float32's rounding."""
    from mlx_flash import kernels as K
    from test_batch import EIGHT
    from test_parity import greedy as greedy_of

    module = kernels_module()[0]
    top = module.simd(99)
    calls = {"gather_mm": 0, "gather_mm_cols": 0}
    real_mm, real_cols = K.gather_mm, K.gather_mm_cols
    monkeypatch.setattr(K, "gather_mm", lambda *a, **k: calls.__setitem__("gather_mm", calls["gather_mm"] + 1)
                        or real_mm(*a, **k))
    monkeypatch.setattr(K, "gather_mm_cols", lambda *a, **k: calls.__setitem__("gather_mm_cols",
                                                                              calls["gather_mm_cols"] + 1)
                        or real_cols(*a, **k))
    model, tok = mlx_flash.load(llama16, mode=mode, resident_dtype="float16", progress=False)
    try:
        d = model.args.hidden_size
        x = mx.array(np.random.default_rng(4).standard_normal((8, 1, d)).astype(np.float32))
        ffn, q = model.layers[0].mlp, model.layers[0].self_attn.q_proj
        prompts = [[t % model.args.vocab_size for t in p] for p in EIGHT]  # (a small vocabulary)
        alone = [greedy_of(model, p, 5) for p in prompts]
        for level in range(top, -1, -1):
            module.simd(level)
            calls.update(gather_mm=0, gather_mm_cols=0)
            r = mlx_flash.batch_generate(model, tok, prompts, max_tokens=5, stop=False)
            assert r.tokens == alone, level
            used = K.batched(module)
            assert all((n > 0) == used for n in calls.values()), (level, calls)
            for f in (ffn, q, model.model.embed_tokens.as_linear):
                step = np.array(f(x))
                each = np.concatenate([np.array(f(x[i:i + 1])) for i in range(8)])
                assert np.abs(step - each).max() <= 1e-5 * np.abs(each).max(), (level, f)
    finally:
        module.simd(top)
        model.runtime.close()

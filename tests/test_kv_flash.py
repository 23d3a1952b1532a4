"""The KV cache on flash (issue 13 item 5): keys and values written to a file as they are made,
read back in checked chunks by each token's attention; chosen by --memory-limit when the
cache in DRAM would leave the weights too little."""

import gc
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_flash
from mlx_flash.errors import FlashError
from mlx_flash.io.reader import FlashReader
from mlx_flash.models.attention import chunked_attention
from mlx_flash.runtime import memory
from mlx_flash.runtime.stores.kv import FlashKV, FlashKVCache, block_positions
from test_parity import TOKENS, greedy

MB = 10**6


def _store(tmp_path, context=300, chunk_bytes=9000, dtype=mx.float32, heads=2, dim=16, prefetch=True):
    return FlashKV(tmp_path, 2, heads, dim, dim, context, dtype, FlashReader(threads=4), chunk_bytes=chunk_bytes,
                   prefetch=prefetch)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_attention_over_flash_equals_attention_over_dram(tmp_path, dtype):
    """Prompt chunks and single tokens, the positions spread over several chunks read back, a
    partial block in DRAM: the output equals mlx_lm's cache and attention's."""
    mx.random.seed(0)
    kv = _store(tmp_path, dtype=dtype)
    assert kv.block == block_positions(kv.row) == 4096 // kv.row  # (rows of 2 x 2 x 16 values)
    ref = KVCache()
    chunks_seen = 0
    for t in [37, 1, 1, 64, 1, 5, 1, 1, 100, 1]:
        q = mx.random.normal((1, 6, t, 16)).astype(dtype)
        k = mx.random.normal((1, 2, t, 16)).astype(dtype)
        v = mx.random.normal((1, 2, t, 16)).astype(dtype)
        off = kv.length[0]
        chunks_seen = max(chunks_seen, len(kv._chunks_of(0)))
        got = chunked_attention(q, off, kv.parts(0, k, v), 0.25)
        keys, values = ref.update_and_fetch(k, v)
        want = scaled_dot_product_attention(q, keys, values, cache=ref, scale=0.25,
                                            mask="causal" if t > 1 else None)
        tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}[dtype]
        assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < tol, t
    assert kv.length[0] == 212 and kv.flushed[0] == 212 // kv.block * kv.block
    assert chunks_seen >= 3  # (the chunks read back: more than one, and the partial block apart)
    kv.close()


def test_a_changed_byte_on_disk_is_found_on_the_next_read(tmp_path):
    kv = _store(tmp_path, prefetch=False)  # (a read prefetched before the change would be of the good bytes)
    k = mx.ones((1, 2, 40, 16))
    list(kv.parts(0, k, k))  # writes the whole blocks of 40 positions
    assert kv.flushed[0] >= kv.block
    # flip a byte of layer 0's first block, through the store's own (uncached) descriptor
    stage = kv._stage[: kv.block_bytes]
    os.preadv(kv._wfd, [stage], 0)
    stage[5] ^= 0xFF
    os.pwrite(kv._wfd, stage, 0)
    with pytest.raises(FlashError, match="layer 0's keys and values .* do not match the checksum"):
        list(kv.parts(0, k[:, :, :1], k[:, :, :1]))
    kv.close()


def test_a_context_past_the_file_is_a_clear_error(tmp_path):
    kv = _store(tmp_path, context=32)
    k = mx.ones((1, 2, 30, 16))
    list(kv.parts(0, k, k))
    with pytest.raises(FlashError, match="holds 32 positions"):
        list(kv.parts(0, k[:, :, :3], k[:, :, :3]))
    kv.close()


def test_the_file_is_gone_from_the_folder_at_once(tmp_path):
    kv = _store(tmp_path)
    assert os.listdir(tmp_path) == []  # (unlinked: the descriptors hold it until the process ends)
    kv.close()


def test_a_model_on_flash_decodes_as_in_dram(smollm2):
    """Same weights, the KV cache on flash or in DRAM: prompt logits within float32 rounding
    of a different summation order, greedy tokens identical."""
    dram, _ = mlx_flash.load(smollm2, progress=False)
    flash, _ = mlx_flash.load(smollm2, kv_cache="flash", ctx_size=128, progress=False)
    cache = make_prompt_cache(flash)
    assert all(isinstance(c, FlashKVCache) for c in cache)
    got = flash(mx.array([TOKENS]), cache=cache)[0]
    want = dram(mx.array([TOKENS]), cache=make_prompt_cache(dram))[0]
    # (logits up to ~30: 1e-4 apart is 3e-6 of them; a running softmax against one in NumPy)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item(), mx.abs(got - want).max().item()
    assert greedy(flash, TOKENS, 10) == greedy(dram, TOKENS, 10)
    with pytest.raises(FlashError, match="a batch keeps its KV cache in DRAM"):
        mlx_flash.batch_generate(flash, _, ["Hello", "Bonjour"], max_tokens=2)
    dram.runtime.close()
    flash.runtime.close()


def test_kv_flash_options_are_checked(smollm2):
    with pytest.raises(FlashError, match="a quantized KV cache .* stays in DRAM"):
        mlx_flash.load(smollm2, kv_cache="flash", kv_bits=4, progress=False)
    with pytest.raises(FlashError, match="without either it changes nothing"):
        mlx_flash.load(smollm2, ctx_size=512, kv_cache="dram", progress=False)


def test_the_plan_holds_buffers_not_the_cache():
    shape = memory.Shape(n_layers=30, d_model=576, n_ff=1536, n_heads=9, kv_per_token=30 * 2 * 192, vocab=49152)
    dram = memory.plan_memory("700MB", shape, 4, 8192, baseline=100 * MB)
    flash = memory.plan_memory("700MB", shape, 4, 8192, baseline=100 * MB, kv_on_flash=True)
    assert dram.kv == 8192 * shape.kv_per_token * 4 and flash.kv < 20 * MB
    assert flash.weights > dram.weights + 250 * MB and "KV cache on flash" in flash.describe()


def test_auto_moves_the_cache_to_flash_when_the_limit_requires_it(smollm2, caplog):
    # 16384 tokens of SmolLM2's float32 keys and values take 755 MB: more than the limit leaves
    # (the runtime it measures can be less than this process's RSS: the leftovers of earlier
    # tests' models are not counted, and 8192 tokens' 377 MB once fitted)
    limit = memory.process_rss() + 250 * MB
    model, tok = mlx_flash.load(smollm2, mode="hybrid", memory_limit=str(limit), ctx_size=16384, progress=False)
    m = model.runtime.memory
    assert m.kv_on_flash and m.context == 16384 and m.kv < 20 * MB
    assert "the KV cache on flash (--kv-cache auto)" in caplog.text
    assert isinstance(make_prompt_cache(model)[0], FlashKVCache)
    assert mlx_flash.generate(model, tok, "Hello", max_tokens=4)
    model.runtime.close()
    del model, tok  # (a process that loads again has dropped the first model)
    gc.collect()
    small, _ = mlx_flash.load(smollm2, mode="hybrid", memory_limit=str(limit), ctx_size=64, progress=False)
    assert not small.runtime.memory.kv_on_flash  # (where it fits, it stays in DRAM)
    small.runtime.close()


def test_a_long_context_under_a_cgroup_of_the_limit(smollm2, tmp_path):
    """A context whose KV cache in DRAM (377 MB) is more than the whole limit: planned on
    flash, run inside a memory cgroup of the limit without an OOM kill."""
    from test_memory_limit import generate_in_cgroup

    text = generate_in_cgroup(smollm2, 300, tmp_path, "--ctx-size", "8192", "--prompt", "Tell me about the sea. " * 40)
    assert "the KV cache on flash (--kv-cache auto)" in text and "KV cache on flash" in text, text[-3000:]


def test_opt_positions_continue_on_flash(tmp_path):
    """OPT's learned positions come from the cache's offset: with the KV cache on flash, a
    prefill then single tokens give the logits of the whole sequence at once."""
    from helpers import make_opt_folder
    from mlx_flash.convert import convert

    src, _, _ = make_opt_folder(tmp_path / "hf", "opt", seed=1)
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    model, _ = mlx_flash.load(out, kv_cache="flash", ctx_size=64, progress=False)
    tokens = TOKENS[:9]
    whole = np.array(model(mx.array([tokens]))[0])
    cache = make_prompt_cache(model)
    parts = [np.array(model(mx.array([tokens[:5]]), cache=cache)[0])]
    parts += [np.array(model(mx.array([[t]]), cache=cache)[0]) for t in tokens[5:]]
    assert np.abs(np.concatenate(parts) - whole).max() < 1e-4
    model.runtime.close()

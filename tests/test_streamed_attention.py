"""Attention read from flash (runtime/stores/attention.py): when a quantized model's resident
weights leave a budget too little room for the FFN, some layers' projections stay in the
resident file and are read every token. Exact: the same values through the same kernels."""

import logging

import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.errors import BudgetTooSmall, FlashError
from mlx_flash.kernels import kernels_module
from mlx_flash.runtime.stores.attention import CHUNK, layers_to_stream
from helpers import flip_bit, make_llama_folder
from test_parity import TOKENS, greedy

pytestmark = pytest.mark.skipif(kernels_module()[0] is None, reason="native kernels not built")


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    """An 8-layer 4-bit llama whose attention is most of its resident weights (a 7B's shape:
    wide attention, a small vocabulary)."""
    tmp = tmp_path_factory.mktemp("streamed")
    src, _, _ = make_llama_folder(tmp / "hf", "qwen2", hidden_size=256, intermediate_size=256,
                                  num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8)
    return convert(src, tmp / "q4", progress=False, quant=QuantOptions(quantize=True, bits=4, group_size=32))


def _streamed_budget(folder, layers_freed):
    """A budget `layers_freed` layers' attention short of naive's needs with all of it held."""
    model, _ = mlx_flash.load(folder, mode="naive")
    rt = model.runtime
    need = rt.plan.ffn_dram_bytes + rt.resident.held_bytes
    one = 4 * (256 * 256 // 2 + 2 * 2 * 256 * 256 // 32)  # q, k, v, o at 4 bits with their scales
    rt.close()
    return need - layers_freed * one


def test_layers_to_stream_frees_the_deficit_with_the_fewest_layers_spread_out():
    mb = 1 << 20
    spans = dict.fromkeys(range(32), 42 * mb)
    assert layers_to_stream(spans, 0) == []
    assert layers_to_stream(spans, 1) == [0, 11, 21]  # 3 streamed, 2 buffers: about one layer freed
    assert layers_to_stream(spans, 1, prefetch=False) == [0, 16]
    got = layers_to_stream(spans, 42 * mb * 10)
    # 12 would free 10 layers less the buffers' rounding to whole 256 KiB reads: 13
    assert len(got) == 13 and got == sorted(set(got))
    assert len(layers_to_stream(spans, 42 * mb * 10 - 2 * CHUNK)) == 12
    assert layers_to_stream(spans, 42 * mb * 30) is None  # streaming all frees less than 30 layers


@pytest.mark.parametrize("mode", ["naive", "hybrid", "auto"])
def test_streamed_attention_gives_the_held_models_logits(q4_model, mode, caplog):
    dense, _ = mlx_flash.load(q4_model)
    x = mx.array([TOKENS])
    want, want_tokens = dense(x), greedy(dense, TOKENS, 6)
    dense.runtime.close()
    with caplog.at_level(logging.WARNING, logger="mlx_flash"):
        model, _ = mlx_flash.load(q4_model, mode=mode, memory_budget=str(_streamed_budget(q4_model, 2)))
    att = model.runtime.attention
    assert att is not None and 3 <= len(att.order) < 8, "the budget should stream some layers"
    assert "stays on flash, read every token" in caplog.text
    assert model.runtime.plan.weights_bytes <= model.runtime.budget_bytes
    got = model(x)  # a prompt: the dequantized chunks
    assert mx.array_equal(got, want).item()  # the same values through the same kernels: to the bit
    assert greedy(model, TOKENS, 6) == want_tokens  # decode: the matvec, prefetch across tokens
    s = model.runtime.stats()["summary"]
    assert s["streamed_attention"]["layers"] == att.order
    assert s["mean_bytes_read"] >= att.streamed_bytes  # the attention's reads are counted
    model.runtime.close()


def test_without_prefetch_and_without_checks_too(q4_model):
    dense, _ = mlx_flash.load(q4_model)
    want = greedy(dense, TOKENS, 4)
    dense.runtime.close()
    model, _ = mlx_flash.load(q4_model, mode="naive", prefetch=False, verify=False,
                              memory_budget=str(_streamed_budget(q4_model, 2)))
    assert model.runtime.attention is not None and model.runtime.attention.crcs is None
    assert len(model.runtime.attention.buffers) == 1
    assert greedy(model, TOKENS, 4) == want
    model.runtime.close()


def test_a_damaged_streamed_byte_is_found_on_the_token_that_reads_it(q4_model, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(q4_model, folder)
    model, _ = mlx_flash.load(folder, mode="naive", prefetch=False,
                              memory_budget=str(_streamed_budget(folder, 2)))
    att = model.runtime.attention
    layer = att.order[1]
    span = att.spans[layer]
    off, _, _ = span.matrices["self_attn.v_proj"][0]
    flip_bit(folder / "resident.safetensors", span.start + off + 100)  # damaged after loading: on disk only
    with pytest.raises(FlashError, match=rf"layer {layer}'s attention, bytes \d+\.\.\d+ \(self_attn.*\), does not match its checksum"):
        model(mx.array([TOKENS[:2]]))
    model.runtime.close()


def test_a_budget_that_streaming_cannot_meet_is_still_refused(q4_model):
    with pytest.raises(BudgetTooSmall, match="even with every layer's attention read from flash, the resident "
                       r"weights .* take \d+ MB and the least FFN plan"):
        mlx_flash.load(q4_model, mode="naive", memory_budget=str(_streamed_budget(q4_model, 9)))


def test_a_memory_limit_counts_only_what_loads(q4_model):
    """Before loading, the limit's check counts the resident file less the attention that may
    stay on flash; the plan's refusal names the least limit, which then runs."""
    from mlx_flash.layout.format import read_manifest
    from mlx_flash.runtime import FlashConfig, loaded_resident_bytes

    m = read_manifest(q4_model)
    size = (q4_model / m.resident["file"]).stat().st_size
    assert loaded_resident_bytes(q4_model, m, FlashConfig(mode="naive")) < size - 4 * 163840
    assert loaded_resident_bytes(q4_model, m, FlashConfig(mode="dense")) == size
    assert loaded_resident_bytes(q4_model, m, FlashConfig(mode="naive", resident_dtype="float32")) == size


def test_dense_and_sparse_modes_never_stream(q4_model):
    budget = str(_streamed_budget(q4_model, 2))
    with pytest.raises(BudgetTooSmall):
        mlx_flash.load(q4_model, mode="dense", memory_budget=budget)
    model, _ = mlx_flash.load(q4_model, mode="naive", memory_budget="100%")
    assert model.runtime.attention is None
    model.runtime.close()


def test_the_streamed_reads_count_in_the_cost_model(q4_model):
    model, _ = mlx_flash.load(q4_model, mode="naive", memory_budget=str(_streamed_budget(q4_model, 2)))
    rt = model.runtime
    work = rt.work()
    lay = rt.manifest.layout
    ffn = len(rt.manifest.ffn_files) * lay.n_neurons * lay.stride
    assert work.read_bytes == ffn + rt.attention.streamed_bytes
    rt.close()
    held, _ = mlx_flash.load(q4_model, mode="naive")
    assert work.computed == held.runtime.work().computed  # computed alike, held or streamed
    held.runtime.close()


def test_explain_says_which_attention_is_read(q4_model):
    from mlx_flash.plan.explain import explain

    model, _ = mlx_flash.load(q4_model, mode="auto", memory_budget=str(_streamed_budget(q4_model, 2)))
    att = model.runtime.attention
    text = explain(model.runtime)
    assert f"the attention of {len(att.order)} of 8 layers" in text and "read from flash every token" in text
    read = model.runtime.work().read_bytes
    assert f"{read / 1e6:.1f} MB" in text  # the chosen plan's reads include the attention's
    model.runtime.close()

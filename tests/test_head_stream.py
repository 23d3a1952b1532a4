"""The output head read from flash (runtime/stores/head.py, models/quantized.py StreamedHead): an
untied, quantized head stays in the resident file and each pass multiplies by every row, read
chunk by chunk and checked. A decode step's logits are the held head's to the bit (the same
kernel on the same bytes); a prompt's are BLAS's over the same values."""

import logging
import shutil

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.errors import BudgetTooSmall, FlashError, ModelFileError
from mlx_flash.layout.format import read_manifest
from mlx_flash.runtime import FlashConfig, loaded_resident_bytes
from mlx_flash.runtime.stores import head as head_store
from helpers import flip_bit, make_llama_folder
from test_parity import TOKENS, greedy


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An untied 4-bit llama (its head 4-bit too) and a tied one."""
    tmp = tmp_path_factory.mktemp("head")
    q4 = QuantOptions(quantize=True, bits=4, group_size=32)
    src, cfg, _ = make_llama_folder(tmp / "hf", "llama", num_hidden_layers=3)
    assert not cfg["tie_word_embeddings"]
    tied, _, _ = make_llama_folder(tmp / "hf-tied", "llama-tied", num_hidden_layers=3)
    return {"q4": convert(src, tmp / "q4", progress=False, quant=q4),
            "tied": convert(tied, tmp / "tied", progress=False, quant=q4),
            "q4-dip": convert(src, tmp / "q4-dip", progress=False, quant=q4, dip=True)}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 48 rows: a head of a few hundred rows in several chunks, the last one short."""
    monkeypatch.setattr(head_store, "CHUNK_ROWS", 48)


@pytest.mark.parametrize("mode", ["naive", "hybrid", "dense"])
def test_the_streamed_head_gives_the_held_logits(models, small_chunks, mode):
    held, _ = mlx_flash.load(models["q4"], mode=mode, stream_head="off")
    streamed, _ = mlx_flash.load(models["q4"], mode=mode, stream_head="on")
    rt = streamed.runtime
    assert rt.head is not None and type(streamed.lm_head).__name__ == "StreamedHead" and held.runtime.head is None
    assert rt.head.span.n_rows % 48 and len(rt.head.starts) > 2
    x = mx.array([TOKENS])
    assert np.abs(np.array(streamed(x)) - np.array(held(x))).max() < 1e-5  # a prompt: BLAS over the same values
    assert mx.array_equal(streamed(x[:, 3:4]), held(x[:, 3:4])).item()  # one position: the same kernel
    assert greedy(streamed, TOKENS, 8) == greedy(held, TOKENS, 8)
    # resident bytes drop by the head, less what the store holds instead (two buffers, checksums)
    span = rt.head.span
    assert held.runtime.resident.held_bytes - rt.resident.held_bytes == span.nbytes - rt.head.weights_bytes
    assert rt.head.weights_bytes == head_store.head_dram_bytes(span, True) < span.nbytes
    # every pass reads the whole head, and --stats counts it
    streamed(x[:, :1])
    held(x[:, :1])
    if mode != "dense":
        got, want = rt.store.stats.rows[-1], held.runtime.store.stats.rows[-1]
        assert got["bytes_read"] - want["bytes_read"] >= span.nbytes
    assert rt.stats()["summary"]["streamed_head"]["bytes_per_token"] == span.nbytes
    held.runtime.close()
    rt.close()


def test_generation_multiplies_a_prompt_chunks_last_position_only(models, small_chunks):
    held, tok = mlx_flash.load(models["q4"], mode="naive", stream_head="off")
    streamed, _ = mlx_flash.load(models["q4"], mode="naive", stream_head="on")
    store = streamed.runtime.head
    passes = []
    products = store.products
    store.products = lambda v: passes.append(v.shape[0]) or products(v)
    prompt = tok.decode(TOKENS * 3)
    want = mlx_flash.generate(held, tok, prompt, max_tokens=6)
    assert mlx_flash.generate(streamed, tok, prompt, max_tokens=6) == want
    assert passes and set(passes) == {1}  # (the prompt's chunk: its last position alone)
    assert not streamed.lm_head.last_only  # (outside generation: every position's logits)
    assert streamed(mx.array([TOKENS])).shape[1] == len(TOKENS)
    held.runtime.close()
    streamed.runtime.close()


@pytest.mark.parametrize("part", ["weight", "biases"])
def test_a_damaged_byte_is_found_on_the_pass_that_reads_it(models, tmp_path, small_chunks, part):
    folder = tmp_path / "copy"
    shutil.copytree(models["q4"], folder)
    model, _ = mlx_flash.load(folder, mode="naive", stream_head="on")
    span = model.runtime.head.span
    name, off, row, _ = next(p for p in span.parts if p[0].endswith(part))
    bad = 100
    flip_bit(folder / "resident.safetensors", off + bad * row + 1)  # damaged after loading: on disk only
    with pytest.raises(ModelFileError, match=rf"the output head's row {bad} \({name}, bytes \d+\.\.\d+\) does not "
                       "match its checksum, read twice"):
        model(mx.array([[1, 5]]))
    model.runtime.close()


def test_the_plan_streams_the_head_where_every_layers_attention_is_not_enough(models, small_chunks, caplog):
    folder = models["q4"]
    with pytest.raises(BudgetTooSmall) as e:
        mlx_flash.load(folder, mode="naive", memory_budget="20000", stream_head="off")
    need = e.value.needed  # with every layer's attention and the input embeddings on flash, the head held
    with caplog.at_level(logging.WARNING, logger="mlx_flash"):
        model, _ = mlx_flash.load(folder, mode="naive", memory_budget=str(need - 1024))
    rt = model.runtime
    assert rt.head is not None and rt.config.stream_head == "on"
    assert "the output head (" in caplog.text and "stays on flash: each pass reads it" in caplog.text
    assert rt.plan.weights_bytes <= rt.budget_bytes
    assert rt.work().read_bytes >= rt.head.span.nbytes  # the cost model counts its reads
    rt.close()
    # room enough: held
    model, _ = mlx_flash.load(folder, mode="naive", memory_budget=str(need + 4096))
    assert model.runtime.head is None and model.runtime.config.stream_head == "off"
    model.runtime.close()


def test_a_head_that_cannot_be_streamed_is_refused_by_name(models):
    with pytest.raises(FlashError, match="--stream-head on: .* output head cannot be read from flash"):
        mlx_flash.load(models["tied"], stream_head="on")
    with pytest.raises(FlashError, match="unknown --stream-head 'sometimes'"):
        mlx_flash.load(models["q4"], stream_head="sometimes")


def test_a_memory_limit_counts_the_head_as_not_loaded(models):
    for kind, drops in (("q4", True), ("tied", False)):
        folder = models[kind]
        m = read_manifest(folder)
        whole = loaded_resident_bytes(folder, m, FlashConfig(mode="hybrid", stream_embeddings="off"))
        limited = loaded_resident_bytes(folder, m, FlashConfig(mode="hybrid", memory_limit="8GB",
                                                               stream_embeddings="off"))
        assert (limited < whole - 4096) == drops


@pytest.mark.parametrize("source", ["dip", "dip-ca"])
def test_flash_mode_leaves_resident_weights_on_flash_where_they_exceed_the_budget(models, small_chunks, source):
    """Flash mode through the DIP store: a budget the resident weights alone exceed leaves the
    input embeddings, then layers' attention, then the output head on flash (as the exact modes
    do), where it used to be refused; the tokens are the unbudgeted run's (a DIP token's rows are
    the same whether read or cached; the streamed weights' kernels are the held ones')."""
    folder = models["q4-dip"]
    opts = dict(mode="flash", sparsity=source, density=0.5)
    free, _ = mlx_flash.load(folder, **opts)
    want = greedy(free, TOKENS, 8)
    held = free.runtime.resident.held_bytes
    free.runtime.close()
    with pytest.raises(BudgetTooSmall, match="the DIP store's scratch rows"):
        mlx_flash.load(folder, **opts, memory_budget="1000")
    model, _ = mlx_flash.load(folder, **opts, memory_budget=str(held))  # (nothing left for the FFN if all held)
    rt = model.runtime
    assert rt.embedding is not None and (rt.attention is not None or rt.head is not None)
    assert rt.plan.weights_bytes <= rt.budget_bytes
    got = greedy(model, TOKENS, 8)
    if source == "dip":  # (dip-ca prefers what its caches hold: a smaller cache may choose otherwise)
        assert got == want
    rt.close()


def test_a_flash_prompt_dequantizes_its_rows_a_block_at_a_time(models, monkeypatch):
    """A prompt chunk in the DIP store multiplies packed rows dequantized a block of ids at a time
    (its temporaries bounded), to the same logits as in one block."""
    from mlx_flash.runtime.stores import dip as dip_store

    folder = models["q4-dip"]
    x = mx.array([TOKENS])
    model, _ = mlx_flash.load(folder, mode="flash", sparsity="dip", density=0.5)
    assert model.runtime.store.packed_in is not None
    whole = np.array(model(x))
    monkeypatch.setattr(dip_store, "BLOCK", 7)
    blocks = np.array(model(x))
    assert np.abs(blocks - whole).max() < 1e-4
    model.runtime.close()

"""The input embedding read from flash (runtime/stores/embedding.py, models/quantized.py
StreamedEmbedding): an untied table stays in the resident file and each pass reads its tokens'
rows, checked. Exact: the same bytes through the same dequantization as the held table."""

import logging
import shutil
from pathlib import Path

import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.errors import BudgetTooSmall, FlashError, ModelFileError
from mlx_flash.layout.format import read_manifest
from mlx_flash.runtime import FlashConfig, dense_need, embedding_to_stream, loaded_resident_bytes
from helpers import flip_bit, make_llama_folder
from test_parity import TOKENS, greedy

PROMPT = TOKENS + [5, 5, 9]  # (repeated ids: a pass reads each distinct row once)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An untied llama at float32, float16 and 4 bits (the table quantized too), and a tied one at 4 bits."""
    tmp = tmp_path_factory.mktemp("embedding")
    src, cfg, _ = make_llama_folder(tmp / "hf", "llama", num_hidden_layers=4)
    assert not cfg["tie_word_embeddings"]
    tied, _, _ = make_llama_folder(tmp / "hf-tied", "llama-tied", num_hidden_layers=4)
    q4 = QuantOptions(quantize=True, bits=4, group_size=32)
    return {"f32": convert(src, tmp / "f32", dtype="float32", progress=False),
            "f16": convert(src, tmp / "f16", dtype="float16", progress=False),
            "q4": convert(src, tmp / "q4", progress=False, quant=q4),
            "tied": convert(tied, tmp / "tied", progress=False, quant=q4)}


def _held_and_streamed(folder, **options):
    held, _ = mlx_flash.load(folder, stream_embeddings="off", **options)
    streamed, _ = mlx_flash.load(folder, stream_embeddings="on", **options)
    return held, streamed


@pytest.mark.parametrize("kind", ["f32", "f16", "q4"])
def test_the_streamed_table_gives_the_held_logits_to_the_bit(models, kind):
    held, streamed = _held_and_streamed(models[kind])
    rt = streamed.runtime
    assert rt.embedding is not None and type(streamed.model.embed_tokens).__name__ == "StreamedEmbedding"
    assert held.runtime.embedding is None
    x = mx.array([PROMPT])
    want, got = held(x), streamed(x)
    assert got.dtype == want.dtype == mx.float32
    assert mx.array_equal(got, want).item()  # a prompt
    assert mx.array_equal(streamed(x[:, 3:4]), held(x[:, 3:4])).item()  # one position
    assert greedy(streamed, PROMPT, 8) == greedy(held, PROMPT, 8)  # decode, token by token
    # resident bytes drop by the table, less what the store holds instead (buffers, checksums)
    table = rt.embedding.span
    assert held.runtime.resident.held_bytes - rt.resident.held_bytes == table.nbytes - rt.embedding.weights_bytes
    assert rt.embedding.weights_bytes == table.dram_bytes(True) < table.nbytes
    held.runtime.close()
    rt.close()


def test_a_pass_reads_each_distinct_row_once(models):
    model, _ = mlx_flash.load(models["q4"], stream_embeddings="on")
    store = model.runtime.embedding
    before = store.reader.stats.reads_requested
    model(mx.array([PROMPT]))
    assert store.reader.stats.reads_requested - before == len(set(PROMPT)) * len(store.span.parts)
    with pytest.raises(ValueError, match="token id 100000 is outside the embedding table's"):
        model(mx.array([[1, 100000]]))
    want = model(mx.array([PROMPT]))
    model.runtime.close()
    unchecked, _ = mlx_flash.load(models["q4"], stream_embeddings="on", verify=False)
    assert unchecked.runtime.embedding.crcs is None
    assert mx.array_equal(unchecked(mx.array([PROMPT])), want).item()
    unchecked.runtime.close()


def test_a_long_prompt_is_read_in_pieces(models):
    from mlx_flash.runtime.stores.embedding import ROWS

    held, streamed = _held_and_streamed(models["q4"])
    ids = [(7 * i) % 260 for i in range(ROWS * 2 + 9)]  # more distinct rows than a buffer holds
    assert len(set(ids)) > ROWS
    x = mx.array([ids])
    assert mx.array_equal(streamed(x), held(x)).item()
    held.runtime.close()
    streamed.runtime.close()


@pytest.mark.parametrize("part", ["weight", "scales"])
def test_a_damaged_byte_is_found_on_the_pass_that_reads_its_row(models, tmp_path, part):
    folder = tmp_path / "copy"
    shutil.copytree(models["q4"], folder)
    model, _ = mlx_flash.load(folder, stream_embeddings="on")
    table = model.runtime.embedding.span
    name, off, row, _ = next(p for p in table.parts if p[0].endswith(part))
    token = 33
    flip_bit(folder / "resident.safetensors", off + token * row + 1)  # damaged after loading: on disk only
    model(mx.array([[1, 5, 9]]))  # other rows read as they are
    with pytest.raises(ModelFileError, match=rf"the input embedding's row {token} \({name}, bytes \d+\.\.\d+\) "
                       "does not match its checksum, read twice"):
        model(mx.array([[1, token]]))
    model.runtime.close()


def test_a_damaged_table_before_loading_is_refused(models, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(models["q4"], folder)
    flip_bit(folder / "resident.safetensors", -5, 1)  # (the last tensor's bytes: the sha256 no longer matches)
    with pytest.raises(ModelFileError, match="sha256"):
        mlx_flash.load(folder, stream_embeddings="on")


def _dense_bytes(folder, stream="off"):
    """What --mode dense holds (runtime.dense_need), the table held or not."""
    return dense_need(folder, read_manifest(folder), FlashConfig(stream_embeddings=stream))


def test_the_plan_streams_an_untied_table_where_the_model_does_not_fit(models, caplog):
    from mlx_flash.plan.explain import explain

    folder = models["q4"]
    assert _dense_bytes(folder, "on") < _dense_bytes(folder) - 1024
    budget = str(_dense_bytes(folder) - 1024)  # dense misses by a little: the table's bytes make room
    with caplog.at_level(logging.WARNING, logger="mlx_flash"):
        model, _ = mlx_flash.load(folder, memory_budget=budget)
    rt = model.runtime
    assert rt.embedding is not None and rt.config.stream_embeddings == "on" and rt.mode == "dense"
    assert "the input embeddings" in caplog.text and "stay on flash" in caplog.text
    assert rt.attention is None  # (the embedding is streamed first: it was enough)
    assert rt.plan.weights_bytes <= rt.budget_bytes
    text = explain(rt)
    assert "the input embeddings" in text and "are read from flash" in text
    read = rt.work().read_bytes
    assert read >= rt.embedding.span.row_bytes  # the cost model counts its reads
    s = rt.stats()["summary"]
    assert s["streamed_embedding"]["table_bytes"] == rt.embedding.span.nbytes
    rt.close()
    # the whole model fits: held
    model, _ = mlx_flash.load(folder, memory_budget="100%")
    assert model.runtime.embedding is None and model.runtime.config.stream_embeddings == "off"
    model.runtime.close()
    # told not to: held (and the budget then asks more of the rest)
    model, _ = mlx_flash.load(folder, memory_budget=budget, stream_embeddings="off")
    assert model.runtime.embedding is None
    model.runtime.close()


def test_naive_streams_the_table_only_where_it_must(models):
    folder = models["q4"]
    model, _ = mlx_flash.load(folder, mode="naive")
    rt = model.runtime
    need = rt.plan.ffn_dram_bytes + rt.resident.held_bytes
    rt.close()
    # (the header's estimate of the resident weights is a little above what loads)
    model, _ = mlx_flash.load(folder, mode="naive", memory_budget=str(need + 2048))
    assert model.runtime.embedding is None  # it fits: nothing to gain, naive reads every row anyway
    model.runtime.close()
    model, _ = mlx_flash.load(folder, mode="naive", memory_budget=str(need - 1024))
    assert model.runtime.embedding is not None and model.runtime.attention is None
    x = mx.array([PROMPT])
    held, _ = mlx_flash.load(folder, mode="naive", stream_embeddings="off")
    assert mx.array_equal(model(x), held(x)).item()
    # its reads join the pass's row in --stats: a row of each tensor
    model(x[:, :1])
    held(x[:, :1])
    got, want = model.runtime.store.stats.rows[-1], held.runtime.store.stats.rows[-1]
    assert got["reads"] - want["reads"] == len(model.runtime.embedding.span.parts)
    assert got["bytes_read"] > want["bytes_read"]
    held.runtime.close()
    model.runtime.close()


def test_a_tied_table_stays_whole(models, smollm2):
    from mlx_flash.plan.explain import explain

    for folder in (models["tied"], smollm2):
        m = read_manifest(folder)
        assert not embedding_to_stream(folder, m, FlashConfig(memory_budget="10%"))
        with pytest.raises(FlashError, match="tied to its output head, which multiplies by every row"):
            embedding_to_stream(folder, m, FlashConfig(stream_embeddings="on"))
        with pytest.raises(FlashError, match="tied to its output head"):
            mlx_flash.load(folder, stream_embeddings="on")
    model, _ = mlx_flash.load(models["tied"], memory_budget=str(_dense_bytes(models["tied"]) - 1024))
    assert model.runtime.embedding is None and model.runtime.tied_embeddings
    assert "tied to the output head" in explain(model.runtime)
    model.runtime.close()


def test_a_memory_limit_counts_the_table_as_not_loaded(models):
    for kind, drops in (("q4", True), ("tied", False)):
        folder = models[kind]
        m = read_manifest(folder)
        whole = loaded_resident_bytes(folder, m, FlashConfig(mode="dense"))
        limited = loaded_resident_bytes(folder, m, FlashConfig(mode="dense", memory_limit="8GB"))
        off = loaded_resident_bytes(folder, m, FlashConfig(mode="dense", memory_limit="8GB",
                                                           stream_embeddings="off"))
        assert off == whole
        assert (limited < whole) == drops


def test_a_budget_too_small_says_the_table_was_read_from_flash_too(models):
    with pytest.raises(BudgetTooSmall, match="even with every layer's attention, the input embeddings and the "
                       "output head read from flash"):
        mlx_flash.load(models["q4"], mode="naive", memory_budget="20000")


LARGE_MODEL = Path(__file__).resolve().parent.parent / "models" / "qwen2.5-coder-1.5b-instruct"


@pytest.mark.slow
def test_the_real_models_table_read_from_flash_gives_its_logits():
    """Qwen2.5-Coder-1.5B (untied: a 146 MB 4-bit input table beside an 8-bit head)."""
    if not (LARGE_MODEL / "manifest.json").exists():
        pytest.skip("the 1.5B model is not built (make model-large)")
    x = mx.array([[151644, 872, 198, 14990, 151645, 198, 151644, 77091, 198, 14990]])
    held, _ = mlx_flash.load(LARGE_MODEL, stream_embeddings="off")
    want, held_bytes = held(x), held.runtime.resident.held_bytes
    mx.eval(want)
    held.runtime.close()
    del held
    model, _ = mlx_flash.load(LARGE_MODEL, stream_embeddings="on")
    rt = model.runtime
    assert mx.array_equal(model(x), want).item()
    assert held_bytes - rt.resident.held_bytes == rt.embedding.streamed_bytes - rt.embedding.weights_bytes
    assert rt.embedding.streamed_bytes > 140e6 and rt.embedding.span.row_bytes == 960
    rt.close()

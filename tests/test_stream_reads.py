"""--stream-reads: naive / hybrid read a layer's streamed rows uncached (the paper's) or through
the page cache with the OS's read-ahead, each batch's pages dropped; the same values either way;
by default the faster by the cached machine profile."""

import logging

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.errors import FlashError
from mlx_flash.io import FlashReader
from mlx_flash.plan import profile as profile_mod
from mlx_flash.plan.profile import Profile, save_profile
from helpers import make_llama_folder
from test_parity import TOKENS, greedy


def test_a_readahead_reader_reads_the_same_bytes(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    with pytest.raises(ValueError, match="not with direct=True"):
        FlashReader(readahead=True)
    with FlashReader(threads=1, direct=False, readahead=True, max_read=1 << 20) as r:
        f = r.open(path)
        assert f.readahead and not f.direct and "read ahead" in repr(f)
        offs = [0, 1 << 20, 5000, (3 << 20) - 7]
        lens = [1 << 20, 1 << 20, 100, 7]
        for got, o, n in zip(r.read(f, offs, lens), offs, lens):
            assert bytes(got) == data[o:o + n].tobytes()
        rows = np.zeros((3, 4096), dtype=np.float32)
        r.read_bundles(f, [0, 2, 1], 1 << 20, ((0, 4096, "float32", rows),), [0, 1, 2])
        assert rows[1].tobytes() == data[2 << 20:(2 << 20) + 16384].tobytes()


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    src, _, _ = make_llama_folder(tmp / "hf", "llama", intermediate_size=256)
    return convert(src, tmp / "q4", progress=False, quant=QuantOptions(quantize=True, bits=4, group_size=32))


@pytest.mark.parametrize("mode", ["naive", "hybrid"])
def test_readahead_streams_give_the_same_tokens(q4, mode):
    dense, _ = mlx_flash.load(q4)
    want = greedy(dense, TOKENS, 6)
    x = mx.array([TOKENS])
    logits = dense(x)
    model, _ = mlx_flash.load(q4, mode=mode, memory_budget="60%", stream_reads="readahead")
    rt = model.runtime
    assert rt.store.reader.readahead
    assert mx.abs(model(x) - logits).max().item() <= 1e-5
    assert greedy(model, TOKENS, 6) == want
    work = rt.work()
    assert 0 < work.readahead_bytes == work.read_bytes  # every streamed FFN byte
    rt.close()
    model, _ = mlx_flash.load(q4, mode=mode, memory_budget="60%")  # no profile cached: uncached
    assert not model.runtime.store.reader.readahead and model.runtime.work().readahead_bytes == 0
    model.runtime.close()


def test_stream_reads_where_nothing_streams_is_refused(q4):
    for mode in ("dense", "flash"):
        with pytest.raises(FlashError, match="--stream-reads chooses how naive and hybrid read"):
            mlx_flash.load(q4, mode=mode, stream_reads="readahead")


def _profile(readahead, uncached):
    return Profile(disk={4096: 0.5, 262144: 1.0}, threads=32, compute={"float32": {10**6: 10.0}, "q4": {10**6: 20.0}},
                   layer_ms={"dense": {128: 1.0}}, token_ms={"dense": {128: 0.0}}, overlap=1.0,
                   machine=profile_mod.machine_key(), mlx=mx.__version__, device="cpu", measured="now",
                   stream={"readahead": readahead, "uncached": uncached})


def test_the_profile_chooses_the_faster_stream_and_says_so(q4, monkeypatch, tmp_path, caplog):
    from mlx_flash.io import reader as reader_mod

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path))
    save_profile(_profile(readahead=2.0, uncached=1.0))
    monkeypatch.setattr(reader_mod, "_logged", set())
    with caplog.at_level(logging.WARNING):
        model, _ = mlx_flash.load(q4, mode="naive", memory_budget="60%")
    assert model.runtime.store.reader.readahead
    assert "read-ahead" in caplog.text and "2.00 GB/s on this machine against 1.00 uncached" in caplog.text
    p = model.runtime.predict(profile_mod.load_profile())
    model.runtime.close()
    save_profile(_profile(readahead=1.05, uncached=1.0))  # within the noise: the paper's reads
    model, _ = mlx_flash.load(q4, mode="naive", memory_budget="60%")
    assert not model.runtime.store.reader.readahead
    q = model.runtime.predict(profile_mod.load_profile())
    assert q.io_ms > p.io_ms  # the cost model reads the faster stream's rate
    model.runtime.close()

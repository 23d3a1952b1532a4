"""The paper benchmark's parts: random checkpoints, the trace model, unbundled reads, the rows."""

import json

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.bench import paper
from mlx_flash.convert.random_model import RandomSource, build_checkpoint, parameter_count
from mlx_flash.bench.trace import TraceModel, TraceSource, fit_concentration, new_share
from mlx_flash.errors import FlashError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    return build_checkpoint("tiny-opt", "float16", home=home, progress=False), home


def test_shapes_have_the_papers_sizes():
    assert abs(parameter_count("opt-6.7b") / 1e9 - 6.66) < 0.01
    assert abs(parameter_count("llama-2-7b") / 1e9 - 6.74) < 0.01


def test_random_source_is_seeded_and_scaled():
    a, b = RandomSource("tiny-opt"), RandomSource("tiny-opt")
    name = "model.decoder.layers.0.fc1.weight"
    np.testing.assert_array_equal(a.read(name), b.read(name))
    assert abs(float(a.read(name).std()) - 0.02) < 0.002
    assert not np.array_equal(a.read(name), a.read("model.decoder.layers.1.fc1.weight"))
    assert (a.read("model.decoder.layers.0.final_layer_norm.weight") == 1).all()


def test_checkpoint_is_built_once_and_runs_exactly(tiny):
    folder, home = tiny
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    assert build_checkpoint("tiny-opt", "float16", home=home, progress=False) == folder
    assert (folder / "manifest.json").stat().st_mtime_ns == stamp
    dense, _ = mlx_flash.load(folder)
    naive, _ = mlx_flash.load(folder, mode="naive")
    x = mx.array([[3, 70, 9, 200]])
    np.testing.assert_allclose(np.array(naive(x)), np.array(dense(x)), atol=1e-5)


def test_trace_matches_the_papers_statistics():
    t = TraceModel(2, 16384, active=0.03, new=0.024, k=5, seed=3)
    assert abs(new_share(0.03, t.concentration, 5) - 0.024) < 1e-6
    s = t.statistics(300)
    assert abs(s["active"] - 0.03) < 0.002
    assert abs(s["new"] - 0.024) < 0.002
    # heterogeneous propensities are what windows exploit: fewer new neurons at larger k
    assert t.statistics(300, k=8)["new"] < s["new"] < t.statistics(300, k=1)["new"]
    with pytest.raises(FlashError, match="cannot have"):
        fit_concentration(0.03, 0.029, 5)


def test_trace_source_injects_predictor_errors():
    t = TraceModel(2, 16384, seed=1)
    src = TraceSource(t, d_model=16, predictor_rank=4, false_negative=0.05, false_positive=0.07)
    x = mx.random.normal((1, 3, 16))
    for layer in (0, 1):
        m = src.select(layer, x)
        assert m.shape == (3, 16384) and m.dtype == bool
    for _ in range(40):
        src.select(0, x[:, :1])
    s = src.stats
    assert abs(s["missed"] / s["active"] - 0.05) < 0.01
    assert abs(s["extra"] / s["active"] - 0.07) < 0.01
    assert src.resident_bytes == 2 * (16 * 4 + 4 * 16384) * 4


def test_unbundled_reads_fill_the_same_rows(tiny):
    from mlx_flash.cache import NeuronCache
    from mlx_flash.runtime.stores.base import read_into
    from mlx_flash.io import FlashReader
    from mlx_flash.layout.format import read_manifest

    folder, _ = tiny
    m = read_manifest(folder)
    lay = m.layout
    ids = np.array([3, 4, 100, 7, 511], dtype=np.int64)
    with FlashReader(threads=4) as r:
        f = r.open(folder / m.ffn_files[1]["file"])
        caches = []
        for bundled in (True, False):
            c = NeuronCache(8, lay.n_neurons, lay.d_model, lay.kinds)
            read_into(r, f, lay, ids, c, c.append(ids), bundled=bundled)
            caches.append(c)
            if not bundled:  # two reads per neuron, neighbours 3 and 4 not merged across kinds
                assert r.stats.reads_issued - issued == 2 * len(ids)
            issued = r.stats.reads_issued
    for k in lay.kinds:
        np.testing.assert_array_equal(caches[0].views[k][:5], caches[1].views[k][:5])
        assert np.abs(caches[0].views[k][:5]).sum() > 0


@pytest.mark.slow  # (30 s: every row of benchmark paper on a tiny model; -m slow runs it)
def test_paper_rows_end_to_end(tiny, tmp_path, monkeypatch):
    from mlx_flash.plan.profile import save_profile
    from test_plan import _profile, _rates

    _, home = tiny
    # a machine profile cached: every row gets the cost model's time beside its own
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "profiled"))
    save_profile(_profile(compute=_rates(float32=10.0, float16=5.0)), tmp_path / "profiled" / "profile.json")
    # the disk's own counters, made up: 1 GiB read in 1 busy second between any two reads of them
    from mlx_flash.io import device

    calls = iter(range(1000))
    monkeypatch.setattr(device, "counters", lambda path: (lambda n: (n << 30, float(n), 0))(next(calls)))
    res = paper.run("tiny-opt", "float16", memory_budget="90%", tokens=3, warmup=3,
                    windows=(0, 5), window_tokens=3, long_tokens=12, predictor_rank=8,
                    home=home, progress=False, log=lambda *a: None, disk_seconds=0.1)
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == list(paper.CONFIGS)
    from mlx_flash.layout.format import read_manifest

    lay = read_manifest(res["checkpoint"]).layout  # every bundle of both layers, every token
    assert rows["naive"]["flash_to_dram_gb"] * 1e9 == pytest.approx(lay.stride * 512 * 2, rel=0.01)
    for name in ("predictor", "windowing", "all"):
        assert rows[name]["flash_to_dram_gb"] < rows["naive"]["flash_to_dram_gb"] / 5
        assert abs(rows[name]["predictor_fn"] - 0.05) < 0.05
    # windowing reuses neurons: fewer bytes than the predictor alone; bundling: fewer reads
    assert rows["windowing"]["flash_to_dram_gb"] < rows["predictor"]["flash_to_dram_gb"]
    assert rows["all"]["reads"] < rows["windowing"]["reads"]
    assert rows["predictor"]["hit_rate"] < 0.2 < rows["all"]["hit_rate"]
    assert [f["window"] for f in res["fig7"]] == [0, 5] and len(res["fig8"]) == 12
    curves = res["disk_curves_gbs"]  # one per round; the floors take the best per chunk size
    assert len(curves) == 2 and all(v == max(cv[c] for cv in curves)
                                    for c, v in res["disk_curve_gbs"].items())
    for r in rows.values():
        assert r["floor_ms"] == pytest.approx(r["floor_io_ms"] + r["floor_mem_ms"])
        assert r["predicted_ms"] > 0 and r["measured_over_predicted"] == pytest.approx(r["total_ms"] / r["predicted_ms"])
        # and at the disk's rate during the decode: 1.07 GB/s, where the profile's curve has 2.0 at
        # 256 KiB (naive's reads: slower) and 0.5-0.6 at a few KiB (the sparse rows': faster)
        assert r["decode_disk_gbs"] == pytest.approx(2**30 / 1e9)
        assert r["measured_over_predicted_run_disk"] == pytest.approx(r["total_ms"] / r["predicted_run_disk_ms"])
        # and with the disk curve the round measured on the checkpoint (not the made-up profile's)
        assert r["measured_over_predicted_run_curve"] == pytest.approx(r["total_ms"] / r["predicted_run_curve_ms"])
    assert rows["naive"]["predicted_run_curve_ms"] != pytest.approx(rows["naive"]["predicted_ms"])
    assert len(res["disk_layer_curves_gbs"]) == 2  # (measured a layer's reads at a time, as the profile's)
    assert rows["naive"]["predicted_run_disk_ms"] > rows["naive"]["predicted_ms"]
    assert rows["all"]["predicted_run_disk_ms"] < rows["all"]["predicted_ms"]
    # naive reads more than the sparse rows, and the model says so
    assert rows["naive"]["predicted_ms"] > rows["all"]["predicted_ms"]
    md, written = paper.write_outputs(res, tmp_path, tmp_path / "paper.json")
    assert "## Table 3" in md and "| all |" in md and "measured / predicted at the round's disk curve" in md
    assert json.loads((tmp_path / "paper.json").read_text())["rows"][0]["config"] == "naive"
    assert all(p.exists() for p in written)


@pytest.mark.slow  # (about 50 s: a second checkpoint and its predictors; test_paper_rows_end_to_end covers one dtype)
def test_paper_compares_dtypes_in_one_run(tiny, tmp_path):
    """--dtype float16,q4: every row for each (a dtype's rows together, the dtypes alternating
    round after round), named by their weights. (The bytes
    ratio is the 7B shapes' figure: tiny-opt's bundles are mostly alignment.)"""
    _, home = tiny
    res = paper.run("tiny-opt", ["float16", "q4"], memory_budget="90%", configs=("naive", "all"),
                    tokens=3, warmup=2, rounds=1, windows=(), long_tokens=0, predictor_rank=8,
                    home=home, progress=False, log=lambda *a: None, disk_seconds=0.1)
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == ["naive [float16]", "all [float16]", "naive [q4]", "all [q4]"]
    assert [s["dtype"] for s in res["subjects"]] == ["float16", "q4"]
    assert res["subjects"][1]["resident_bytes"] < res["subjects"][0]["resident_bytes"] / 1.5  # + the arena, norms
    for name, r in rows.items():  # each row ran its own checkpoint's reader and plan
        assert r["dtype"] == name.split("[")[1][:-1] and r["tokens"] == (3 if "all" in name else 1)
    md, written = paper.write_outputs(res, tmp_path)
    assert "## Against float16" in md and "| all [q4] |" in md
    assert written[0].name == "paper-tiny-opt-float16+q4.md"

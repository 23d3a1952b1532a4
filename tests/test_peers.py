"""mlx_flash.benchmark peers: system specs, the memory cgroup runner, skipping llama.cpp,
the F32/F16 GGUFs, and one tiny end-to-end run through real child processes."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mlx_flash.bench import peers
from mlx_flash.errors import FlashError

MiB = 1 << 20


# --- the disk's rate during a decode ---


def test_disk_rate_from_the_devices_own_counters(tmp_path):
    from mlx_flash.io import device

    assert device.rate((0, 0.0, 0), (64 * MiB, 0.5, 0)) == pytest.approx(64 * MiB / 0.5 / 1e9)
    assert device.rate((0, 0.0, 0), (MiB, 0.5, 0)) is None  # too little read to time
    assert device.rate((0, 0.0, 0), (64 * MiB, 0.1, 0)) is None  # ... or too short a busy time
    assert device.rate((0, 0.0, 0), (64 * MiB, 0.5, 16 * MiB)) is None  # busy writing too
    assert device.rate((0, 0.0, 0), (64 * MiB, 0.5, MiB)) is not None
    assert device.rate(None, (64 * MiB, 0.5, 0)) is None and device.rate((0, 0.0, 0), None) is None
    assert device.counters("/proc/self/status") is None  # no block device under /proc
    assert device.counters(tmp_path / "missing") is None
    got = device.counters(__file__)  # the checkout's disk: counters where Linux exposes them
    if got is not None:
        assert len(got) == 3 and all(v >= 0 for v in got)


def test_the_device_module_loads_without_the_package(tmp_path):
    """benchmark peers' child loads io/device.py by path where mlx_flash is not installed (the
    llama.cpp peer's environment): an isolated interpreter, the file alone."""
    from mlx_flash.bench.peers import run

    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('d', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "assert 'mlx_flash' not in sys.modules; print(m.rate((0, 0.0, 0), (2**26, 1.0, 0)))")
    r = subprocess.run([sys.executable, "-I", "-c", code, str(run.DEVICE_MODULE)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) == pytest.approx(2**26 / 1e9)


# --- system specs ---


def test_parse_system_forms():
    s = peers.parse_system("mlx_flash:flash:dip:0.5")
    assert (s.runtime, s.mode, s.sparsity, s.density, s.limit) == ("mlx_flash", "flash", "dip", 0.5, None)
    s = peers.parse_system("mlx_flash:dense@none")
    assert (s.runtime, s.mode, s.limit, s.name) == ("mlx_flash", "dense", "none", "mlx_flash:dense")
    assert peers.parse_system("mlx_flash:naive@400MB").limit == "400MB"
    assert peers.parse_system("mlx_lm").runtime == "mlx_lm"
    s = peers.parse_system("mlx_flash:hybrid:f16@none")
    assert (s.mode, s.resident_dtype, s.limit) == ("hybrid", "float16", "none")
    s = peers.parse_system("mlx_flash:flash:dip:0.5:f16")
    assert (s.sparsity, s.density, s.resident_dtype) == ("dip", 0.5, "float16")
    assert peers.parse_system("mlx_flash:naive").resident_dtype is None
    assert peers.parse_system("llama.cpp-f16").gguf == "f16"
    names = [s.spec for s in peers.parse_systems(peers.DEFAULT_SYSTEMS)]
    assert names[0] == "mlx_flash:dense@none" and "llama.cpp-q4_1" in names  # the 4-bit default model's own
    # every sparsity source the runtime has (the calibrated ones too)
    from mlx_flash.sparsity import source_names

    assert set(peers.SPARSITIES) == set(source_names())
    assert peers.parse_system("mlx_flash:flash:calibrated-ca:0.65@544MB").sparsity == "calibrated-ca"


@pytest.mark.parametrize("spec, words", [
    ("", "empty"),
    ("vllm", "unknown system 'vllm'"),
    ("mlx_flash", "needs a mode"),
    ("mlx_flash:turbo", "unknown mlx_flash mode 'turbo'"),
    ("mlx_flash:dense:dip", "takes no sparsity"),
    ("mlx_flash:flash", "needs a sparsity source and a density"),
    ("mlx_flash:flash:dip", "needs a sparsity source and a density"),
    ("mlx_flash:flash:magic:0.5", "unknown sparsity 'magic'"),
    ("mlx_flash:flash:dip:half", "'half' is not a number"),
    ("mlx_flash:flash:dip:1.5", "not in (0, 1]"),
    ("mlx_flash:flash:dip:0", "not in (0, 1]"),
    ("mlx_lm:fast", "takes no options"),
    ("llama.cpp-q2", "unknown llama.cpp weights 'q2'"),
    ("llama.cpp", "unknown system"),
    ("mlx_lm@lots", "cannot read 'lots'"),
    ("mlx_lm@10", "under 1 MiB"),
])
def test_parse_system_rejects_bad_specs(spec, words):
    with pytest.raises(FlashError) as e:
        peers.parse_system(spec)
    msg = str(e.value)
    assert words in msg
    assert "valid:" in msg or "limit" in msg  # names the valid forms (or the bad limit)


def test_parse_systems_rejects_duplicates_and_nothing():
    with pytest.raises(FlashError, match="given twice"):
        peers.parse_systems("mlx_lm,mlx_lm")
    with pytest.raises(FlashError, match="no systems"):
        peers.parse_systems(" , ")


def test_parse_limit():
    assert peers.parse_limit("50%") == ("fraction", 0.5)
    assert peers.parse_limit("400MB") == ("bytes", 400 * 10**6)
    assert peers.parse_limit("512MiB") == ("bytes", 512 * MiB)
    assert peers.parse_limit("none") == ("none", None)
    for bad in ("-5%", "x%", "fifty"):
        with pytest.raises(FlashError, match="--limit"):
            peers.parse_limit(bad)


def test_parse_flash_budget():
    assert peers.parse_flash_budget("auto") == ("auto", None)
    assert peers.parse_flash_budget("limit") == ("limit", None)
    assert peers.parse_flash_budget("full") == ("full", None)
    assert peers.parse_flash_budget("40%") == ("fraction", 0.4)
    assert peers.parse_flash_budget("200MB") == ("bytes", 200 * 10**6)
    for bad in ("none", "most"):
        with pytest.raises(FlashError, match="--flash-budget"):
            peers.parse_flash_budget(bad)


# --- the memory cgroup runner ---


def _cgroup_or_skip():
    version, why = peers.cgroup_support()
    if version is None:
        pytest.skip(f"memory cgroup runner not testable here: {why}")
    return version


ALLOC = "import sys; b = b'x' * (int(sys.argv[1]) << 20); print(len(b))"


def test_cgroup_runner_reports_oom_kill_over_the_limit():
    _cgroup_or_skip()
    with peers.MemoryCgroupRunner() as runner:
        over = runner.run([sys.executable, "-c", ALLOC, "256"], limit_bytes=64 * MiB, timeout=120,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        under = runner.run([sys.executable, "-c", ALLOC, "8"], limit_bytes=64 * MiB, timeout=120,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        free = runner.run([sys.executable, "-c", ALLOC, "96"], limit_bytes=None, timeout=120,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        path = runner.path
    assert over.oom_killed and over.returncode == -9, over
    assert over.oom_kills >= 1 and over.limit_bytes == 64 * MiB
    assert not under.oom_killed and under.returncode == 0, under
    assert 8 * MiB < under.peak_bytes <= 64 * MiB
    assert not free.oom_killed and free.returncode == 0 and free.peak_bytes > 96 * MiB
    assert not path.exists()  # cleaned up


def test_cgroup_runner_moves_the_child_before_it_runs(tmp_path):
    _cgroup_or_skip()
    with peers.MemoryCgroupRunner() as runner, open(tmp_path / "out", "w") as out:
        r = runner.run([sys.executable, "-c", "print(open('/proc/self/cgroup').read())"],
                       limit_bytes=256 * MiB, timeout=60, stdout=out, stderr=subprocess.DEVNULL)
        name = runner.path.name
    assert r.returncode == 0
    assert f"/{name}/run1" in (tmp_path / "out").read_text()


def test_cgroup_support_explains_itself(tmp_path):
    version, why = peers.cgroup_support(v1_root=tmp_path / "nope", v2_root=tmp_path / "nope2")
    assert version is None
    assert "not root" in why or "no memory cgroup" in why


# --- llama.cpp ---


def test_llama_cpp_is_skipped_with_a_clear_message_when_not_importable():
    ok, _ = peers.check_import(sys.executable, "llama_cpp")
    if ok:
        pytest.skip("llama_cpp is importable in this venv")
    py, why = peers.llama_cpp_python(sys.executable)
    assert py is None
    assert "llama_cpp is not importable" in why and "make peers-setup" in why
    py, why = peers.llama_cpp_python("/nonexistent/python")
    assert py is None and "not found" in why


def test_float_ggufs_hold_the_float16_values(tmp_path):
    gguf = pytest.importorskip("gguf")
    from test_gguf import write_gguf

    src = tmp_path / "q.gguf"
    write_gguf(src)
    r_src = gguf.GGUFReader(str(src))
    for kind, ftype in (("f16", gguf.GGMLQuantizationType.F16), ("f32", gguf.GGMLQuantizationType.F32)):
        out = peers.write_float_gguf(src, tmp_path / f"{kind}.gguf", kind)
        r = gguf.GGUFReader(str(out))
        assert r.fields["general.file_type"].contents() == (0 if kind == "f32" else 1)
        assert r.fields["tokenizer.ggml.tokens"].contents() == r_src.fields["tokenizer.ggml.tokens"].contents()
        got = {t.name: t for t in r.tensors}
        assert [t.name for t in r.tensors] == [t.name for t in r_src.tensors]
        for t in r_src.tensors:
            o = got[t.name]
            assert o.shape.tolist() == t.shape.tolist()
            want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16).astype(np.float32)
            have = gguf.quants.dequantize(o.data, o.tensor_type)
            np.testing.assert_array_equal(have, want)
            assert o.tensor_type == (gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else ftype)
    assert not list(tmp_path.glob("*.partial"))


# --- end to end on a tiny model ---


@pytest.fixture(scope="module")
def tiny_flash(tiny_llama):
    return tiny_llama("peers", "float16", intermediate_size=256).flash


def test_several_limits_expand_every_system_without_its_own(tiny_flash):
    bench = peers.Peers(tiny_flash, "mlx_flash:dense@none,mlx_flash:naive,mlx_lm", limit="50%,300MB")
    assert [s.spec for s in bench.systems] == [
        "mlx_flash:dense@none", "mlx_flash:naive@50%", "mlx_flash:naive@300MB", "mlx_lm@50%", "mlx_lm@300MB"]
    assert bench.systems[2].limit == "300MB" and bench.reference == "mlx_flash:dense@none"
    # every option of a system stays with it at each limit (':f16' once got lost there)
    held = peers.Peers(tiny_flash, "mlx_flash:hybrid:f16,mlx_flash:flash:dip:0.5:f16", limit="50%,300MB").systems
    assert [(s.spec, s.resident_dtype, s.sparsity, s.density) for s in held] == [
        ("mlx_flash:hybrid:f16@50%", "float16", None, None), ("mlx_flash:hybrid:f16@300MB", "float16", None, None),
        ("mlx_flash:flash:dip:0.5:f16@50%", "float16", "dip", 0.5),
        ("mlx_flash:flash:dip:0.5:f16@300MB", "float16", "dip", 0.5)]
    with pytest.raises(FlashError, match="--limit"):
        peers.Peers(tiny_flash, "mlx_lm", limit="50%,lots")
    with pytest.raises(FlashError, match="--reference"):
        peers.Peers(tiny_flash, "mlx_lm", reference="llama.cpp-f32")


def test_limit_of_stored_is_a_share_of_the_files(tiny_flash, tmp_path, monkeypatch):
    """--limit-of stored: N% of the weights as stored (a quantized model's own bytes), not of
    the float32 weights; files only, no run."""
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    with pytest.raises(FlashError, match="--limit-of"):
        peers.Peers(tiny_flash, "mlx_lm", limit_of="float16")
    man = json.loads((tiny_flash / "manifest.json").read_text())
    stored = (tiny_flash / man["resident"]["file"]).stat().st_size + sum(f["size"] for f in man["ffn_files"])
    for of, share in (("float32", None), ("stored", stored)):
        bench = peers.Peers(tiny_flash, "mlx_flash:naive", limit="50%", limit_of=of, log=lambda m: None)
        bench.prepare()
        assert bench.stored_bytes == stored and bench.f32_bytes > 1.5 * stored  # float16 on flash
        bench.baselines = {"mlx_flash": {"rss_bytes": 100 * 10**6}}
        limit, budget = bench.limits(bench.systems[0])
        assert limit == 100 * 10**6 + int(0.5 * (share or bench.f32_bytes)) and budget is None


@pytest.mark.slow  # (over 10 s here: `make test-slow` runs it)
def test_tiny_run_end_to_end(tiny_flash, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    logs = []
    bench = peers.Peers(tiny_flash, "mlx_flash:naive,mlx_lm@none,llama.cpp-f32",
                        limit="200MB", prompt_tokens=120, tokens=4, rounds=1, cold=False,
                        llama_python="/nonexistent/python", flash_budget="auto", log=logs.append)
    res = bench.run()
    rows = {r["system"]: r for r in res["rows"]}
    assert rows["llama.cpp-f32"]["status"] == "skipped"
    assert "not importable" in rows["llama.cpp-f32"]["message"]
    for name in ("mlx_flash:naive", "mlx_lm@none"):
        assert rows[name]["status"] == "ok", (name, rows[name], logs)
        assert rows[name]["decode_tps"] > 0 and rows[name]["prompt_tps"] > 0
        assert rows[name]["rss_peak_bytes"] > 0
    assert res["info"]["reference"] == "mlx_flash:naive"
    assert rows["mlx_flash:naive"]["decode_vs_reference"] == 1.0
    runs = {r["system"]: r for r in res["runs"]}
    for r in runs.values():
        assert len(r["tokens"]) == 4 and r["prompt_tokens"] == res["info"]["prompt_tokens"]
    assert 100 < res["info"]["prompt_tokens"] <= 120
    if res["info"]["cgroup"] != "none":
        base = res["info"]["baselines"]["mlx_flash"]["rss_bytes"]
        naive = rows["mlx_flash:naive"]
        assert naive["limit_bytes"] == 200 * 10**6
        cal = res["info"]["calibration"]["mlx_flash:naive"]  # --flash-budget auto sized it
        assert cal["other_bytes"] == cal["rss_peak_bytes"] - cal["weights_bytes"] > base
        assert naive["memory_budget_bytes"] == cal["budget_bytes"] == int(
            naive["limit_bytes"] - cal["other_bytes"] - 0.05 * naive["limit_bytes"])
        assert rows["mlx_lm@none"]["limit_bytes"] is None
        assert naive["cgroup_peak_bytes"] > 0
    md = peers.markdown(res)
    assert "| mlx_flash:naive |" in md and "baselines" in md
    peers.write_csv(res, tmp_path / "p.csv")
    assert (tmp_path / "p.csv").read_text().count("\n") == 4
    assert "decode_disk_gbs" in (tmp_path / "p.csv").read_text().splitlines()[0]


def test_flash_budget_limit_hands_mlx_flash_the_cgroup_limit(tiny_flash, tmp_path, monkeypatch):
    """--flash-budget limit (the default): no sizing run; mlx_flash gets the cgroup's limit as its
    own --memory-limit and plans within it."""
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "home"))
    logs = []
    bench = peers.Peers(tiny_flash, "mlx_flash:hybrid@100MB,mlx_flash:naive", limit="250MB", prompt_tokens=40,
                        tokens=4, rounds=1, cold=False, reference="mlx_flash:hybrid@100MB", log=logs.append)
    res = bench.run()
    refused, row = res["rows"]
    assert refused["status"] == "refused" and "nothing left for the weights" in refused["message"], refused
    assert row["status"] == "ok", (row, logs)
    # the reference never ran: speeds are compared to the first system that did, and a note says so
    assert res["info"]["reference"] == "mlx_flash:naive" and row["decode_vs_reference"] == 1.0
    assert any("never ran to the end" in n for n in res["info"]["notes"])
    assert not res["info"]["calibration"]
    if res["info"]["cgroup"] != "none":
        run = res["runs"][1]
        # the cgroup's limit: the given one rounded down to pages
        assert 250 * 10**6 - 65536 < run["extra"]["memory_limit_bytes"] <= 250 * 10**6
        assert 0 < run["extra"]["memory_budget_bytes"] < 250 * 10**6 - run["extra"]["runtime_bytes"]


def test_the_prediction_at_the_decodes_disk_rate_scales_only_the_io(tiny_flash, tmp_path, monkeypatch):
    """The child predicts twice: with the probed disk, and at the rate the device delivered
    during the decode (the same curve scaled); a decode that gave no rate gets only the first."""
    import mlx_flash
    from mlx_flash.bench.peers import child
    from mlx_flash.plan.profile import Profile, load_profile, machine_key

    import mlx.core as mx

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path))
    rt = child.MLXFlashRuntime()
    rt.imports({})
    rt.model, rt.tok = mlx_flash.load(tiny_flash, mode="naive", memory_budget="2MB", progress=False)
    rt.profile = Profile(disk={4096: 0.5, 262144: 2.0}, threads=32, compute={"float32": {10**6: 10.0}},
                         layer_ms={"dense": {128: 1.0}}, token_ms={"dense": {128: 0.0}}, overlap=0.0,
                         machine=machine_key(), mlx=mx.__version__, device="cpu", measured="now")
    assert load_profile() is None  # (the test's own profile only)
    list(rt.generate({"suppress_ids": [], "prompt_ids": [1, 2, 3], "tokens": 3}))
    work = rt.model.runtime.work()
    assert work.read_bytes > 0
    io = rt.model.runtime.predict(rt.profile).io_ms
    none = rt.extra(None)  # a decode that gave no rate: no prediction at it
    assert "flash_predicted_ms" in none and "flash_predicted_run_disk_ms" not in none
    rate = rt.profile.disk_gbs(work.read_size) / 2  # the disk at half the probed rate: the I/O takes twice
    slow = rt.extra(rate)
    assert slow["flash_predicted_run_disk_ms"] == pytest.approx(slow["flash_predicted_ms"] + io)
    rt.model.runtime.close()

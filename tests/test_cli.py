"""The command-line tools, run as a user runs them: real processes, real folders."""

import os
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)


def run(*args, stdin=None):
    return subprocess.run(list(args), capture_output=True, text=True, input=stdin, timeout=300)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    m = tiny_llama("cli", "float16")
    return m.hf, m.flash


def test_generate_cli(tiny):
    _, flash = tiny
    r = run(f"{BIN}/mlx_flash.generate", "--model", str(flash), "--prompt", "hello world",
            "--max-tokens", "6", "--stats")
    assert r.returncode == 0, r.stderr
    assert "Generation: 6 tokens" in r.stdout and "Per token (decode, ms)" in r.stdout
    assert "BLAS:" in r.stderr


def test_python_m_entry_point(tiny):
    _, flash = tiny
    r = run(sys.executable, "-m", "mlx_flash", "generate", "--model", str(flash), "--prompt",
            "hi", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    r = run(sys.executable, "-m", "mlx_flash", "nonsense")
    assert r.returncode == 2 and "usage" in r.stderr


def test_chat_through_a_pipe(tiny):
    _, flash = tiny
    r = run(f"{BIN}/mlx_flash.chat", "--model", str(flash), "--max-tokens", "5",
            stdin="hello there\nwhat is the capital?\n")
    assert r.returncode == 0, r.stderr
    assert len([l for l in r.stdout.splitlines() if l.strip()]) >= 1


def test_generate_converts_a_hf_folder_on_first_use(tiny, tmp_path):
    src, _ = tiny
    r = subprocess.run([f"{BIN}/mlx_flash.generate", "--model", str(src), "--prompt", "hi",
                        "--max-tokens", "2"], capture_output=True, text=True,
                       env=dict(os.environ, MLX_FLASH_HOME=str(tmp_path)), timeout=300)
    assert r.returncode == 0, r.stderr
    assert list((tmp_path / "models").glob("*/manifest.json"))


def test_generate_flash_mode_stats_json(tiny, tmp_path):
    import json

    _, flash = tiny
    out = tmp_path / "stats.json"
    r = run(f"{BIN}/mlx_flash.generate", "--model", str(flash), "--prompt", "hello world",
            "--max-tokens", "5", "--mode", "flash", "--sparsity", "oracle", "--density", "0.5",
            "--window", "2", "--stats", "--stats-json", str(out))
    assert r.returncode == 0, r.stderr
    assert "memory management" in r.stdout
    d = json.loads(out.read_text())
    assert d["summary"]["mode"] == "flash" and d["summary"]["density"] == 0.5
    for key in ("peak_rss_bytes", "weights_in_dram_bytes", "memory_budget_bytes", "mean_io_ms"):
        assert key in d["summary"]
    decode = [t for t in d["tokens"] if t["tokens"] == 1]
    assert decode and all(k in decode[0] for k in ("io_ms", "mem_ms", "compute_ms", "bytes_read", "reads", "hit_rate"))


def test_generate_held_at_float16_cli(tiny):
    """--resident-dtype float16: the same greedy text as float32-resident, and a clear error
    for a dtype that would round the model."""
    _, flash = tiny
    args = [f"{BIN}/mlx_flash.generate", "--model", str(flash), "--prompt", "hello world",
            "--max-tokens", "6", "--mode", "hybrid"]
    a, b = run(*args), run(*args, "--resident-dtype", "float16")
    assert a.returncode == 0 and b.returncode == 0, b.stderr
    assert a.stdout.split("==========")[0] == b.stdout.split("==========")[0]
    assert "resident float16" in b.stderr
    c = run(*args, "--resident-dtype", "bfloat16")
    assert c.returncode != 0 and "would round" in c.stderr and "Traceback" not in c.stderr


def test_device_flag(tiny):
    """--device cpu computes there (the header says the compute dtype); --device gpu without a GPU
    backend is one clear line, exit 2."""
    import mlx.core as mx

    _, flash = tiny
    r = run(f"{BIN}/mlx_flash.generate", "--model", str(flash), "--prompt", "hi", "--max-tokens", "2",
            "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "compute float32" in r.stderr
    if mx.is_available(mx.gpu):
        pytest.skip("this MLX has a GPU: --device gpu runs")
    for cmd in ("mlx_flash.generate", "mlx_flash.eval"):
        extra = ["--task", "wikitext"] if cmd == "mlx_flash.eval" else []
        e = run(f"{BIN}/{cmd}", "--model", str(flash), "--device", "gpu", *extra)
        assert e.returncode == 2 and "Traceback" not in e.stderr, e.stderr
        assert "--device gpu: this MLX" in e.stderr and "no GPU backend" in e.stderr


def test_benchmark_paper_devices_are_checked_first():
    """benchmark paper --device cpu,gpu: every device is checked before the first run (no GPU: one
    line, exit 2, nothing built); an unknown device likewise."""
    import mlx.core as mx

    bad = ["nope"] + ([] if mx.is_available(mx.gpu) else ["cpu,gpu"])
    for dev in bad:
        e = run(f"{BIN}/mlx_flash.benchmark", "paper", "--shape", "opt-1.3b", "--device", dev, "--quiet")
        assert e.returncode == 2 and "Traceback" not in e.stderr, e.stderr
        assert "--device" in e.stderr and len(e.stderr.strip().splitlines()) == 1, e.stderr

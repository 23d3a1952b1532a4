"""mlx_flash.benchmark storage: a small, fast run of the whole thing."""

import csv
import json
import os
import subprocess
import sys

import pytest

from mlx_flash.bench.storage import fio_available, fit_latency_model, parse_size

BIN = os.path.dirname(sys.executable)


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("16K") == parse_size("16KiB") == 16384
    assert parse_size("1M") == 1 << 20 and parse_size("512") == 512
    assert parse_size("1.5GiB") == 3 << 29


def test_latency_model_recovers_its_parameters():
    l, B = 5e-6, 4e9  # 5 us per read, 4 GB/s
    pts = [(c, c / (l + c / B) / 1e9) for c in (4096, 16384, 65536, 1 << 20)]
    m = fit_latency_model(pts)
    assert m["latency_us"] == pytest.approx(5, rel=1e-6)
    assert m["stream_gbps"] == pytest.approx(4, rel=1e-6)
    assert m["gap_bytes"] == pytest.approx(20000, rel=1e-3)


def test_storage_benchmark_small_run(tmp_path, capsys):
    from mlx_flash.cli.benchmark import main

    f = tmp_path / "bench.bin"
    out = tmp_path / "res"
    js = tmp_path / "s.json"
    rc = main(["storage", "--file", str(f), "--size", "64MiB", "--chunks", "16K,64K",
               "--threads", "1,4", "--duration", "0.15", "--repeat", "1",
               "--acc-duration", "0.15", "--token-reads", "300", "--out", str(out),
               "--json", str(js), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "FlashReader, random uncached reads" in text and "token-like batch" in text
    assert f.stat().st_size == 64 << 20
    res = json.loads(js.read_text())
    for c in ("16384", "65536"):
        for t in ("1", "4"):
            assert res["flashreader"][c][t]["gbps"] > 0
            if fio_available():
                assert res["fio_psync"][c][t]["gbps"] > 0
    acc = res["acceptance"]
    assert acc["rounds"][0]["token_batch"] > 0
    if fio_available():
        assert "flashreader_vs_fio_psync_32k" in acc["ratios"]
    assert set(res["per_read_overhead"]) >= {"python"}
    rows = list(csv.DictReader(open(out / "storage.csv")))
    assert {r["tool"] for r in rows} >= {"flashreader"} and len(rows) >= 4
    try:
        import matplotlib  # noqa: F401

        assert (out / "storage.png").stat().st_size > 0
    except ImportError:
        assert "no PNG" in text

    # the file is reused; a size that does not match is one clear error
    rc = main(["storage", "--file", str(f), "--size", "32MiB", "--no-grid", "--repeat", "1"])
    assert rc == 2
    assert "exists with 67108864 bytes" in capsys.readouterr().err


def test_cli_entry_points(tmp_path):
    r = subprocess.run([f"{BIN}/mlx_flash.benchmark", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "storage" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "benchmark", "storage", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--json" in r.stdout

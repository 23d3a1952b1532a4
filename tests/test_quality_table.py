"""mlx_flash.eval.table on a tiny calibrated model: the rows, the files, resume, batch == token by token, the CLI."""

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

from mlx_flash.sparsity.calibrate import calibrate
from mlx_flash.sparsity.allocation import calibrate_thresholds
from mlx_flash.eval.tasks import MCItem

WORDS = "the quick brown fox jumps over the lazy dog hello world paris is the capital".split()


def _script():
    import mlx_flash.eval.table

    return mlx_flash.eval.table


def words(seed, n):
    return " ".join(np.random.default_rng(seed).choice(WORDS, n))


ITEMS = [
    MCItem("a", "Question: what is the capital?\nAnswer:", ["paris", "the lazy dog", "fox"], 0),
    MCItem("b", "the quick brown", ["fox jumps", "dog", "world, hello there", "x"], 1),
    MCItem("c", "hello", ["world", "capital is paris", "q", "the"], 2),
]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    out, _, _, _, d = tiny_llama("quality", "float32", dip=True)  # SwiGLU
    (d / "cal.txt").write_text(words(0, 1500))
    calibrate(out, data=str(d / "cal.txt"), tokens=512, seq_len=64, rank=16, max_rank=16, epochs=1,
              progress=False, log=lambda m: None)
    calibrate_thresholds(out, data=str(d / "cal.txt"), tokens=256, seq_len=64, progress=False,
                         log=lambda m: None)
    return out, d


def test_table_rows_files_and_batch_equals_token_by_token(tiny):
    qt = _script()
    folder, d = tiny
    tasks = {"wikitext": ("perplexity", words(1, 400), "words"),
             "arc_easy": ("choice", ITEMS, "items"), "arc_challenge": ("choice", ITEMS[:2], "items"),
             "hellaswag": ("choice", ITEMS, "items")}
    items = {"arc_easy": 3, "arc_challenge": 2, "hellaswag": 2}
    configs = qt.plan_configs([0.75, 0.5], [0.5], "85%", 64, items, 24, 0)
    assert [c["key"] for c in configs] == ["dense"] + [f"{s}@{x}" for x in (0.75, 0.5) for s in qt.SOURCES]
    out = d / "res" / "quality"
    checks = [("predictor", 0.5, "85%", 40), ("threshold", 0.5, None, 40)]
    state = qt.run_table(folder, out, tasks, configs, checks, probe_tokens=64, probe_densities=(0.5,),
                         context=32, progress=False, meta=dict(model="tiny", limits=dict(items, tokens=64)),
                         log=lambda m: None)
    rows = state["rows"]
    assert not [k for k, r in rows.items() if "error" in r]
    # multiple choice only at the mc densities (and dense); dip-ca token by token, WikiText only
    assert set(rows["dense"]["tasks"]) == set(rows["oracle@0.5"]["tasks"]) == set(qt.TASKS)
    assert set(rows["oracle@0.75"]["tasks"]) == set(rows["dip-ca@0.5"]["tasks"]) == {"wikitext"}
    assert rows["dip-ca@0.5"]["tasks"]["wikitext"]["incremental"] and rows["dip-ca@0.5"]["tasks"]["wikitext"]["n"] == 24
    assert not rows["dip@0.5"]["tasks"]["wikitext"]["incremental"]
    assert rows["dense"]["tasks"]["hellaswag"]["n"] == 2
    # the sources that do not look at their caches score the same either way, budget or not
    for ch in state["checks"].values():
        assert ch["tokens"] == 40
        assert ch["max_abs_nll_diff"] < 1e-4 and ch["first_apart"] is None, ch  # no near-tie flips here
        assert ch["mean_predict_ms"] > 0 and ch["mean_total_ms"] > ch["mean_predict_ms"]
    # the files
    table = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert [r["key"] for r in table] == [c["key"] for c in configs]
    assert table[0]["arc_easy_items"] == "3" and table[1]["arc_easy_items"] == ""
    md = out.with_suffix(".md").read_text()
    for s in ("| dense | 100% |", "| oracle | 75% |", "| dip-ca | 50% | 85%", "| predictor | 50% |",
              "| threshold | 50% | none | batch prefill |", "## The predictor", "| mean |",
              "- Weights float32 on flash"):
        assert s in md, s
    assert md.count("\n| 1 | 16 |") == 1  # layer 1 of the per-layer table
    layers = list(csv.DictReader(open(out.with_name("quality_predictor.csv"))))
    assert len(layers) == 2 and 0 <= float(layers[0]["fn_rate"]) <= 1
    assert json.loads(out.with_suffix(".json").read_text())["order"] == [c["key"] for c in configs]


def test_resume_keeps_finished_rows(tiny, tmp_path):
    qt = _script()
    folder, _ = tiny
    tasks = {"wikitext": ("perplexity", words(2, 200), "words")}
    configs = qt.plan_configs([0.5], [], "85%", 32, {}, 16, 0)[:2]  # dense, oracle@0.5
    out = tmp_path / "q"
    first = qt.run_table(folder, out, tasks, configs[:1], context=32, progress=False, log=lambda m: None)
    kept = []
    second = qt.run_table(folder, out, tasks, configs, context=32, progress=False, resume=True, log=kept.append)
    assert kept == ["[resume] dense: kept"]
    assert second["rows"]["dense"] == json.loads(json.dumps(first["rows"]["dense"]))
    assert "oracle@0.5" in second["rows"]


def test_eval_table_cli(tiny, tmp_path):
    """`mlx_flash.eval --table OUT` end to end, as a user runs it; a user's mistake is one line, exit 2."""
    import subprocess
    import sys

    folder, _ = tiny
    data = tmp_path / "data"
    (data / "wikitext-2-raw").mkdir(parents=True)
    (data / "wikitext-2-raw" / "wiki.test.raw").write_text(words(3, 300))
    out = tmp_path / "res" / "quality"
    cmd = [str(Path(sys.executable).parent / "mlx_flash.eval"), "--table", str(out), "--model", str(folder),
           "--data-dir", str(data), "--densities", "0.5", "--mc-densities", "", "--budget", "85%",
           "--tokens", "48", "--context", "32", "--dip-ca-tokens", "16", "--check-tokens", "16",
           "--probe-tokens", "32", "--arc-easy", "0", "--arc-challenge", "0", "--hellaswag", "0", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for name in ("quality.md", "quality.csv", "quality.json", "quality_predictor.csv"):
        assert (out.parent / name).is_file(), name
    state = json.loads(out.with_suffix(".json").read_text())
    assert state["meta"]["command"].startswith("mlx_flash.eval --table ")
    assert not [k for k, row in state["rows"].items() if "error" in row] and "| dip-ca | 50% |" in r.stdout
    for bad in (["--densities", "0.5,x"], ["--mode", "flash"], ["--model", str(tmp_path / "none")]):
        e = subprocess.run(cmd + bad, capture_output=True, text=True, timeout=120)
        assert e.returncode == 2 and "Traceback" not in e.stderr, e.stderr
        assert len(e.stderr.strip().splitlines()) == 1 and "mlx_flash.eval: error:" in e.stderr, e.stderr


def test_speed_rows_and_plot(tiny, tmp_path):
    """--speed-tokens: every row, dense and hybrid decoded under the budget in alternating rounds;
    the markdown's speed table, the CSV's columns and the PNG of perplexity against tokens/s."""
    qt = _script()
    folder, _ = tiny
    tasks = {"wikitext": ("perplexity", words(4, 200), "words")}
    configs = qt.plan_configs([0.5, 0.75], [], "85%", 32, {}, 16, 0, sources=["calibrated", "dip"])
    assert [c["key"] for c in configs] == ["dense", "calibrated@0.5", "dip@0.5", "calibrated@0.75", "dip@0.75"]
    out = tmp_path / "q"
    logs = []
    state = qt.run_table(folder, out, tasks, configs, context=32, progress=False, log=logs.append,
                         speed=(3, 2, "95%"))
    sp = state["speed"]["rows"]
    assert list(sp) == ["dense", "hybrid", "calibrated@0.5", "dip@0.5", "calibrated@0.75", "dip@0.75"]
    # two layers and an untied input embedding: the table left on flash makes room for hybrid's
    # two streaming buffers of a whole layer under 95 %
    for key, r in sp.items():
        assert "error" not in r, (key, r)
        assert len(r["rounds_ms"]) == 2 and r["ms_per_token"] > 0
        assert (r["budget_bytes"] is None) == (key == "dense")
    assert sp["dense"]["bytes_per_token"] == 0 and sp["calibrated@0.5"]["bytes_per_token"] > 0
    assert 0 < sp["calibrated@0.5"]["ffn_share"] < sp["calibrated@0.75"]["ffn_share"] <= 1
    md = out.with_suffix(".md").read_text()
    assert "## Decode speed under --memory-budget 95%" in md and re.search(r"\| hybrid \| 265\.04 \| [0-9.]+ \|", md)
    table = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert all(float(r["decode_ms_per_token"]) > 0 for r in table)
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 1000
    again = []
    qt.run_table(folder, out, tasks, configs, context=32, progress=False, resume=True, log=again.append,
                 speed=(3, 2, "95%"))
    assert "[resume] decode speed: kept" in again
    # a row that cannot load under its budget is reported, not measured
    qt.run_table(folder, tmp_path / "tight", tasks, configs[:1], context=32, progress=False, log=logs.append,
                 speed=(3, 2, "10%"))
    md = (tmp_path / "tight").with_suffix(".md").read_text()
    assert "| hybrid | 265.04 | not measured: " in md


def test_table_sources_errors(tiny, tmp_path):
    from mlx_flash.errors import FlashError

    folder, _ = tiny
    for kw, msg in ((dict(sources=["nope"]), "--sources: unknown nope"), (dict(sources=[]), "--sources"),
                    (dict(speed_tokens=-1), "--speed-tokens")):
        with pytest.raises(FlashError, match=msg):
            _script().quality_table(folder, tmp_path / "q", **kw)


def test_the_table_names_quantized_flash_weights():
    """A quantized model's table says its rows' bits and group, not the manifest's 16-bit dtype."""
    from types import SimpleNamespace

    from mlx_flash.layout.quant import QuantSpec

    qt = _script()
    manifest = SimpleNamespace(dtype="float16", layout=SimpleNamespace(quant=QuantSpec(4, 32, "float16")))
    assert qt.flash_weights(manifest) == "4-bit group 32 (float16 scales)"
    assert qt.flash_weights(SimpleNamespace(dtype="float16", layout=SimpleNamespace(quant=None))) == "float16"

"""Bad input: one clear line on stderr, a non-zero exit, never a traceback."""

import json
import os
import shutil
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def folders(tiny_llama):
    m = tiny_llama("err", "float32")
    return m.dir, m.hf, m.flash


def fails_cleanly(args, expect):
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert expect in lines[0], lines[0]
    return lines[0]


def convert_cmd(model, out):
    return [f"{BIN}/mlx_flash.convert", "--model", str(model), "--out", str(out), "--quiet"]


def gen_cmd(model):
    return [f"{BIN}/mlx_flash.generate", "--model", str(model), "--max-tokens", "2"]


def test_missing_source(tmp_path):
    fails_cleanly(convert_cmd(tmp_path / "nope", tmp_path / "o"), "no such file or folder")


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    fails_cleanly(convert_cmd(tmp_path / "empty", tmp_path / "o"), "no config.json")


def test_unknown_model_type(folders, tmp_path):
    _, src, _ = folders
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "rwkv9"
    (bad / "config.json").write_text(json.dumps(cfg))
    fails_cleanly(convert_cmd(bad, tmp_path / "o"), "unsupported model type 'rwkv9'")
    assert not (tmp_path / "o").exists()


def test_truncated_safetensors(folders, tmp_path):
    _, src, _ = folders
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    p = bad / "model.safetensors"
    os.truncate(p, os.path.getsize(p) // 2)
    fails_cleanly(convert_cmd(bad, tmp_path / "o"), "truncated")
    assert not (tmp_path / "o").exists()


def test_garbage_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"this is not a gguf file at all" * 10)
    fails_cleanly(convert_cmd(p, tmp_path / "o"), "model.gguf")


def test_not_a_flash_folder_for_generate(tmp_path):
    (tmp_path / "x").mkdir()
    fails_cleanly(gen_cmd(tmp_path / "x"), "no config.json")


def _copy(flash, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(flash, bad)
    return bad


def test_wrong_checksum_of_ffn_file(folders, tmp_path):
    _, _, flash = folders
    bad = _copy(flash, tmp_path)
    with open(bad / "ffn" / "layer_001.bin", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    fails_cleanly(gen_cmd(bad), "layer_001.bin: sha256 differs")


def test_wrong_checksum_of_resident_file(folders, tmp_path):
    _, _, flash = folders
    bad = _copy(flash, tmp_path)
    p = bad / "resident.safetensors"
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) - 10)
        f.write(b"\x01\x02\x03")
    fails_cleanly(gen_cmd(bad), "resident.safetensors: sha256 differs")


def test_truncated_ffn_file(folders, tmp_path):
    _, _, flash = folders
    bad = _copy(flash, tmp_path)
    os.truncate(bad / "ffn" / "layer_000.bin", 4096)
    fails_cleanly(gen_cmd(bad), "layer_000.bin: size 4096")


def test_missing_ffn_file(folders, tmp_path):
    _, _, flash = folders
    bad = _copy(flash, tmp_path)
    os.remove(bad / "ffn" / "layer_001.bin")
    fails_cleanly(gen_cmd(bad), "missing")


def test_manifest_from_the_future(folders, tmp_path):
    _, _, flash = folders
    bad = _copy(flash, tmp_path)
    m = json.loads((bad / "manifest.json").read_text())
    m["version"] = 99
    (bad / "manifest.json").write_text(json.dumps(m))
    fails_cleanly(gen_cmd(bad), "version 99 is not supported")


def test_bad_dtype_and_align(folders, tmp_path):
    _, src, _ = folders
    fails_cleanly(convert_cmd(src, tmp_path / "o") + ["--align", "1000"], "power of two")


def test_predictor_without_calibration(folders):
    _, _, flash = folders
    fails_cleanly(gen_cmd(flash) + ["--mode", "flash", "--sparsity", "predictor"], "run `mlx_flash.calibrate")


def test_budget_too_small_for_a_mode(folders):
    _, _, flash = folders
    fails_cleanly(gen_cmd(flash) + ["--mode", "dense", "--memory-budget", "10%"], "over the budget")
    fails_cleanly(gen_cmd(flash) + ["--mode", "flash", "--memory-budget", "12 parsecs"], "cannot read")


@pytest.mark.parametrize("flags, expect", [
    (["--mode", "dense", "--sparsity", "dip"], "--sparsity only applies to --mode flash"),
    (["--sparsity", "dip"], "no DIP orientation"),  # --mode auto with a sparsity option: flash
    (["--mode", "hybrid", "--density", "0.5", "--window", "8"], "--density, --window only apply to --mode flash"),
    (["--mode", "flash", "--sparsity", "dip", "--gamma", "0.5"], "--gamma re-weights what the cache holds"),
    (["--mode", "flash", "--sparsity", "oracle", "--eviction", "lru"], "--eviction chooses"),
    (["--no-prefetch"], "--mode dense reads none"),
    (["--memory-limit", "1GB", "--memory-budget", "50%"], "contradict each other"),
    (["--ctx-size", "512"], "without either it changes nothing"),
])
def test_options_that_would_be_ignored_are_refused(folders, flags, expect):
    """Issue 13 item 7: a flag that changes nothing in this configuration is a clear error,
    never silently ignored (before any weight is read)."""
    _, _, flash = folders
    fails_cleanly([f"{BIN}/mlx_flash.generate", "--model", str(flash), "--prompt", "hi", "--max-tokens", "2",
                   *flags], expect)

"""The converter: layout round trip, sources, atomicity, bounded memory, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mlx.core as mx

from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from mlx_flash.layout import BundleLayout, read_manifest
from mlx_flash.layout.format import sha256_file
from mlx_flash.layout.safetensors_io import SafetensorsFile
from helpers import make_llama_folder

BIN = os.path.dirname(sys.executable)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layout_round_trip(tmp_path, dtype):
    """Every bundle on disk holds exactly neuron i's gate/up rows and down column."""
    src, cfg, t = make_llama_folder(tmp_path / "hf", "llama")
    out = convert(src, tmp_path / "flash", dtype=dtype, progress=False)
    m = read_manifest(out)
    lay = m.layout
    assert lay.kinds == ("gate", "up", "down") and lay.stride % 512 == 0
    assert lay.n_neurons == cfg["intermediate_size"] and lay.d_model == cfg["hidden_size"]
    tol = {"float32": 0, "float16": 1e-3, "bfloat16": 1e-2}[dtype]
    for layer, entry in enumerate(m.ffn_files):
        path = out / entry["file"]
        assert os.path.getsize(path) == entry["size"] == lay.file_size
        assert sha256_file(path) == entry["sha256"]
        p = f"model.layers.{layer}.mlp."
        with open(path, "rb") as f:
            for i in (0, 17, lay.n_neurons - 1):
                f.seek(lay.offset(i))
                rows = lay.split(f.read(lay.stride))
                np.testing.assert_allclose(rows["gate"][0], t[p + "gate_proj.weight"][i], atol=tol)
                np.testing.assert_allclose(rows["up"][0], t[p + "up_proj.weight"][i], atol=tol)
                np.testing.assert_allclose(rows["down"][0], t[p + "down_proj.weight"][:, i], atol=tol)
    res = SafetensorsFile(out / "resident.safetensors")
    assert not any(".mlp." in n for n in res.names())
    np.testing.assert_allclose(
        res.read("model.embed_tokens.weight"), t["model.embed_tokens.weight"], atol=tol
    )


def test_bundle_padding_is_zero():
    lay = BundleLayout(("up", "down"), 10, 3, "float16", 512)
    assert lay.bundle_bytes == 40 and lay.stride == 512
    packed = lay.pack({"up": np.ones((3, 10)), "down": np.full((3, 10), 2.0)})
    assert packed.shape == (3, 512) and not packed[:, 40:].any()
    back = lay.split(packed.tobytes())
    assert (back["up"] == 1).all() and (back["down"] == 2).all()


def test_convert_is_idempotent_and_refuses_other_folders(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    mtime = os.path.getmtime(out / "manifest.json")
    assert convert(src, out, dtype="float32", progress=False) == out
    assert os.path.getmtime(out / "manifest.json") == mtime
    with pytest.raises(FlashError, match="--force"):
        convert(src, out, dtype="float16", progress=False)
    convert(src, out, dtype="float16", force=True, progress=False)
    assert read_manifest(out).dtype == "float16"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    with pytest.raises(FlashError, match="not an mlx_flash model"):
        convert(src, other, progress=False)


def test_mlx_lm_quantized_folder(tmp_path):
    """An mlx-lm 4-bit folder converts (dequantized) and matches mlx_lm on it."""
    from mlx_lm import convert as lm_convert
    from mlx_lm.utils import load_model

    import mlx_flash

    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", hidden_size=64, intermediate_size=128)
    q = tmp_path / "q4"
    lm_convert(str(src), mlx_path=str(q), quantize=True, q_group_size=32, q_bits=4)
    out = convert(q, tmp_path / "flash", dtype="float32", progress=False)
    model, _ = mlx_flash.load(out)
    ref, _ = load_model(q)
    x = mx.array([[1, 2, 3, 40, 50]])
    assert mx.abs(model(x) - ref(x).astype(mx.float32)).max().item() < 1e-3


def _hub_cache(tmp_path, src):
    """A real Hugging Face cache layout holding `src` as testorg/tiny@main."""
    root = tmp_path / "hub"
    snap = root / "models--testorg--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (root / "models--testorg--tiny" / "refs").mkdir()
    (root / "models--testorg--tiny" / "refs" / "main").write_text("a" * 40)
    return root


def _run(args, **env):
    e = dict(os.environ, **env)
    return subprocess.run(args, capture_output=True, text=True, env=e, timeout=300)


def test_hub_repo_id_offline(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    cache = _hub_cache(tmp_path, src)
    env = dict(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    r = _run([f"{BIN}/mlx_flash.convert", "--model", "testorg/tiny", "--out",
              str(tmp_path / "out"), "--quiet"], **env)
    assert r.returncode == 0, r.stderr
    assert read_manifest(tmp_path / "out").source == "testorg/tiny"
    r = _run([f"{BIN}/mlx_flash.convert", "--model", "testorg/missing", "--out",
              str(tmp_path / "out2"), "--quiet"], **env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "could not get 'testorg/missing'" in r.stderr
    assert not (tmp_path / "out2").exists()


def _big_model(tmp_path):
    # 16 layers x (1 M attention + 3.1 M FFN params) x 4 B ~= 280 MB of float32.
    return make_llama_folder(
        tmp_path / "big", "llama", hidden_size=512, intermediate_size=2048,
        num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8,
    )[0]


HWM = (
    "import re, sys\n"
    "def hwm():\n"
    "    s = open('/proc/self/status').read()\n"
    "    print('VmHWM', int(re.search(r'VmHWM:\\s+(\\d+)', s).group(1)) * 1024, file=sys.stderr)\n"
)


def _peak_rss(code):
    """Run Python code in a fresh process; return (rc, its own peak RSS (VmHWM), stderr).

    ru_maxrss of a child is useless here: Linux carries the parent's high-water
    mark across fork+exec, so the child reads the test runner's RSS.
    """
    r = subprocess.run([sys.executable, "-c", HWM + code + "\nhwm()"], capture_output=True, text=True)
    peak = int(r.stderr.rsplit("VmHWM", 1)[1].split()[0]) if "VmHWM" in r.stderr else 0
    return r.returncode, peak, r.stderr


def test_converter_memory_is_bounded_by_a_layer_not_the_model(tmp_path):
    src = _big_model(tmp_path)
    model_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    _, base, _ = _peak_rss("import mlx_flash.convert, mlx_flash.models.llama")
    rc, peak, err = _peak_rss(
        "from mlx_flash.convert import convert\n"
        f"convert({str(src)!r}, {str(tmp_path / 'out')!r}, dtype='float16', progress=False)"
    )
    assert rc == 0, err
    extra = peak - base
    # one layer's FFN in float32 is 12.6 MB; the embedding 4 MB: the model is 20x more
    print(f"converter peak RSS {peak / 1e6:.0f} MB, imports alone {base / 1e6:.0f} MB, model {model_bytes / 1e6:.0f} MB")
    assert extra < model_bytes / 4, f"converter used {extra / 1e6:.0f} MB over import for a {model_bytes / 1e6:.0f} MB model"


def test_killed_convert_leaves_no_folder_and_rerun_resumes(tmp_path):
    src = _big_model(tmp_path)
    out = tmp_path / "out"
    args = [f"{BIN}/mlx_flash.convert", "--model", str(src), "--out", str(out), "--dtype", "float32"]
    p = subprocess.Popen(args + ["--quiet"], stderr=subprocess.PIPE)
    deadline = time.time() + 120
    partial = tmp_path / ".out.partial"
    while time.time() < deadline:
        if (partial / "ffn" / "layer_003.bin").exists():
            break
        time.sleep(0.01)
    assert (partial / "ffn" / "layer_003.bin").exists(), "conversion never started writing FFN files"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not out.exists()  # never a half-written model folder
    journal = json.loads((partial / "journal.json").read_text())["done"]
    kept = {rel: (partial / rel).stat().st_mtime_ns for rel in journal}
    assert "resident.safetensors" in kept and "ffn/layer_000.bin" in kept
    r = _run(args + ["--quiet"])
    assert r.returncode == 0, r.stderr
    assert "resuming the conversion" in r.stderr
    m = read_manifest(out)
    assert m.dtype == "float32" and not partial.exists()
    assert not (out / "journal.json").exists() and not (out / "owner.pid").exists()
    for rel, mtime in kept.items():  # the files of the killed run were kept, not rewritten
        assert (out / rel).stat().st_mtime_ns == mtime, rel
    for e in m.ffn_files:  # and every file is whole
        assert sha256_file(out / e["file"]) == e["sha256"]
    assert sha256_file(out / m.resident["file"]) == m.resident["sha256"]
    # the result equals a conversion that was never interrupted
    clean = convert(src, tmp_path / "clean", dtype="float32", progress=False)
    assert [e["sha256"] for e in read_manifest(clean).ffn_files] == [e["sha256"] for e in m.ffn_files]


def test_partial_conversion_of_another_dtype_starts_afresh(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    partial = tmp_path / ".out.partial"
    (partial / "ffn").mkdir(parents=True)
    (partial / "ffn" / "layer_000.bin").write_bytes(b"junk")
    (partial / "journal.json").write_text(json.dumps(
        {"key": {"source": "x", "dtype": "float16", "align": 512, "dip": False},
         "done": {"ffn/layer_000.bin": [4, "0" * 64]}}))
    out = convert(src, tmp_path / "out", dtype="float32", progress=False)
    e = read_manifest(out).ffn_files[0]
    assert sha256_file(out / e["file"]) == e["sha256"] and not partial.exists()


def test_a_live_conversion_of_the_same_target_is_refused(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (partial / "owner.pid").write_text(str(sleeper.pid))
        with pytest.raises(FlashError, match="another conversion"):
            convert(src, tmp_path / "out", dtype="float32", progress=False)
        assert partial.exists()  # not ours to remove
    finally:
        sleeper.kill()
        sleeper.wait()
    assert read_manifest(convert(src, tmp_path / "out", dtype="float32", progress=False)).dtype == "float32"


def test_dip_orientation_round_trip(tmp_path):
    """--dip: input dim j's bundle holds gate[:, j] and up[:, j]; down rows stand alone."""
    src, cfg, t = make_llama_folder(tmp_path / "hf", "llama")
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False, dip=True)
    m = read_manifest(out)
    inp, down = m.dip["input"], m.dip["down"]
    assert inp["layout"].kinds == ("gate", "up") and inp["layout"].n_neurons == cfg["hidden_size"]
    assert inp["layout"].d_model == cfg["intermediate_size"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp."
        entry = inp["files"][layer]
        assert sha256_file(out / entry["file"]) == entry["sha256"]
        rows = inp["layout"].split((out / entry["file"]).read_bytes())
        np.testing.assert_array_equal(rows["gate"], t[p + "gate_proj.weight"].T)
        np.testing.assert_array_equal(rows["up"], t[p + "up_proj.weight"].T)
        rows = down["layout"].split((out / down["files"][layer]["file"]).read_bytes())
        np.testing.assert_array_equal(rows["down"], t[p + "down_proj.weight"].T)
    # a folder without --dip is not silently reused when --dip is asked for
    plain = convert(src, tmp_path / "plain", dtype="float32", progress=False)
    with pytest.raises(FlashError, match="--force"):
        convert(src, plain, dtype="float32", progress=False, dip=True)


def test_a_wrong_source_leaves_no_partial_folder(tmp_path):
    src, cfg, _ = make_llama_folder(tmp_path / "hf", "llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # a layer the weights do not have
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FlashError, match="no tensor"):
        convert(src, tmp_path / "out", dtype="float32", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()

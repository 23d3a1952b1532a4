"""Persimmon and Falcon (models/neox.py; mlx_lm has neither): logits against transformers on the
same random weights, float32 and 4 bits (an mlx_lm-style quantized folder against transformers on
its dequantized weights), in every exact mode; q/k/v fused in the checkpoint and split at
conversion, Falcon's layouts (multi-query, grouped with one or two LayerNorms, a head of keys a
query head) and names; the ReLU-fied variants (the paper's) run as trained."""

import json

import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from helpers import make_falcon_folder, make_persimmon_folder, mlx_quantized_folders
from reference import reference_logits
from test_parity import TOKENS, greedy
from test_quant import EXACT_MODES, assert_logits_in_modes

FOLDERS = {"persimmon": lambda d, **o: make_persimmon_folder(d, **o),
           **{f"falcon-{v}": (lambda v: lambda d, **o: make_falcon_folder(d, v, **o))(v)
              for v in ("7b", "40b", "11b", "sequential")}}


@pytest.mark.parametrize("family", FOLDERS)
def test_matches_transformers(tmp_path, family):
    src, _, _ = FOLDERS[family](tmp_path / "hf")
    folder = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    want = mx.array(reference_logits(src, TOKENS))[None]
    assert_logits_in_modes(folder, mx.array([TOKENS]), want, [dict(mode="dense"), dict(mode="naive")], family)


@pytest.mark.parametrize("family", ["persimmon", "falcon-40b"])
def test_every_exact_mode_gives_dense_logits_and_tokens(tmp_path, family):
    src, _, _ = FOLDERS[family](tmp_path / "hf")
    folder = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    dense, _ = mlx_flash.load(folder, mode="dense")
    x = mx.array([TOKENS])
    assert_logits_in_modes(folder, x, dense(x), EXACT_MODES[1:], family)
    hybrid, _ = mlx_flash.load(folder, mode="hybrid")
    assert greedy(hybrid, TOKENS) == greedy(dense, TOKENS)


@pytest.mark.parametrize("family", ["persimmon", "falcon-7b", "falcon-sequential"])
def test_4bit_matches_transformers_on_the_dequantized_weights(tmp_path, family):
    src, _, tensors = FOLDERS[family](tmp_path / "hf")
    quantized, dequantized = mlx_quantized_folders(src, tensors, tmp_path)
    out = convert(quantized, tmp_path / "flash", dtype="float32", progress=False)
    want = mx.array(reference_logits(dequantized, TOKENS))[None]
    assert_logits_in_modes(out, mx.array([TOKENS]), want, EXACT_MODES, family)


def test_a_relu_falcon_in_flash_mode_with_every_row_gives_dense_tokens(tmp_path):
    """A ReLU-fied Falcon (the paper's), biases in every projection, through the sparse path."""
    src, _, _ = make_falcon_folder(tmp_path / "hf", "sequential")
    folder = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    dense, _ = mlx_flash.load(folder, mode="dense")
    want = greedy(dense, TOKENS)
    for source in ("oracle", "threshold"):  # (both exact for ReLU: the rows whose activation is not 0)
        flash, _ = mlx_flash.load(folder, mode="flash", sparsity=source, density=1.0)
        assert greedy(flash, TOKENS) == want, source


@pytest.mark.parametrize("overrides, match", [
    (dict(alibi=True), "ALiBi"),
    (dict(new_decoder_architecture=True, num_kv_heads=3), "do not split into 3"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE scaling"),
])
def test_falcon_configs_we_cannot_run_are_refused(tmp_path, overrides, match):
    src, _, _ = make_falcon_folder(tmp_path / "hf")
    cfg = src / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **overrides}))
    with pytest.raises(FlashError, match=match):
        convert(src, tmp_path / "flash", dtype="float32", progress=False)


def test_a_fused_tensor_of_the_wrong_size_names_it(tmp_path):
    src, _, _ = make_persimmon_folder(tmp_path / "hf")
    cfg = src / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "hidden_size": 32}))
    with pytest.raises(FlashError, match="query_key_value.weight has 192 rows, expected 96"):
        convert(src, tmp_path / "flash", dtype="float32", progress=False)


def test_threshold_on_a_gelu_ffn_reads_the_density_asked_for(tmp_path):
    """A GELU FFN has no zeros: the threshold source takes the top |activations| at the density
    (it read every row, whatever --density said)."""
    src, _, _ = make_falcon_folder(tmp_path / "hf")
    folder = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    model, _ = mlx_flash.load(folder, mode="flash", sparsity="threshold", density=0.5)
    x = mx.random.normal((1, 1, 64))
    source = model.runtime.source
    masks = [source.select(i, x) for i in range(2)]
    assert all(m.sum() == 128 for m in masks), [m.sum() for m in masks]  # (half of 256 neurons)


@pytest.mark.parametrize("family", ["persimmon", "falcon-sequential"])
def test_the_papers_predictors_train_on_the_relu_families_and_run(tmp_path, family):
    """Squared ReLU (Persimmon) and a ReLU-fied Falcon: the low-rank predictors (paper §3.1) learn
    their active neurons, and flash mode runs with them."""
    from mlx_flash.layout import read_manifest
    from mlx_flash.sparsity.calibrate import calibrate
    from test_predictor import text

    size = {"persimmon": "intermediate_size", "falcon-sequential": "ffn_hidden_size"}[family]
    src, _, _ = FOLDERS[family](tmp_path / "hf", **{size: 256})
    folder = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    (tmp_path / "cal.txt").write_text(text(0))
    calibrate(folder, data=str(tmp_path / "cal.txt"), tokens=3072, seq_len=128, rank=64, max_rank=128, epochs=6,
              progress=False, log=lambda m: None)
    metrics = read_manifest(folder).calibration["metrics"]
    assert all(m["recall"] >= 0.95 and 0 < m["true_density"] < 1 for m in metrics), metrics
    model, tok = mlx_flash.load(folder, mode="flash", sparsity="predictor")
    assert isinstance(mlx_flash.generate(model, tok, "the sea", max_tokens=4), str)


def test_generate_under_a_memory_limit(tmp_path):
    """The CLI plans a Falcon's memory (its tied head and LayerNorms among the resident weights)
    and decodes in hybrid mode the tokens dense mode decodes."""
    import subprocess
    import sys

    src, _, _ = make_falcon_folder(tmp_path / "hf", "40b")
    folder = convert(src, tmp_path / "flash", dtype="float32", progress=False)

    def run(*flags):
        r = subprocess.run([sys.executable, "-m", "mlx_flash", "generate", "--model", str(folder), "--prompt",
                            "the sea", "--max-tokens", "6", "--temp", "0", *flags], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split("==========")[0]

    assert run("--mode", "hybrid", "--memory-limit", "400MB") == run("--mode", "dense")

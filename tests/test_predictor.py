"""Low-rank predictors: trained on a ReLU model's activations, they find the active neurons."""

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.sparsity.calibrate import _Recorder, calibrate
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from mlx_flash.layout import read_manifest
from mlx_flash.models.ffn import layer_ffn
from helpers import make_llama_folder

WORDS = "the quick brown fox jumps over the lazy dog hello world paris is the capital".split()


def text(seed, n=6000):
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n))


@pytest.fixture(scope="module")
def calibrated(tiny_llama):
    out, _, _, _, d = tiny_llama("pred", "float32", hidden_act="relu", intermediate_size=256)
    (d / "cal.txt").write_text(text(0))
    cal = calibrate(out, data=str(d / "cal.txt"), tokens=3072, seq_len=128, rank=64, max_rank=128,
                    epochs=6, progress=False, log=lambda m: None)
    return out, cal, d


def test_calibration_records_predictors_and_req(calibrated):
    out, cal, _ = calibrated
    m = read_manifest(out)
    assert m.calibration["predictors"]["target"] == "relu"
    req = m.calibration["req"]["per_layer"]
    assert len(req) == 2 and all(r == sorted(r) for r in req)  # Req grows with the window
    assert all(0 < r[0] <= 256 for r in req)
    for layer in m.calibration["metrics"]:
        assert layer["recall"] >= 0.95 and 0 < layer["true_density"] < 1


def test_recall_on_unseen_text_and_kl_to_dense(calibrated):
    out, cal, d = calibrated
    dense, tok = mlx_flash.load(out)
    model, _ = mlx_flash.load(out, mode="flash", sparsity="predictor")
    tokens = tok.encode(text(1, 400))[:256]
    # recall of truly active neurons on text the predictors never saw
    ffns = [layer_ffn(layer) for layer in dense.layers]
    rec = _Recorder(ffns[0].store, ffns, "relu", None)
    for f in ffns:
        f.store = rec
    mx.eval(dense(mx.array([tokens])))
    source = model.runtime.store.source
    for layer in range(2):
        x, y = rec.x[layer][0], rec.y[layer][0]
        pred = source.select(layer, mx.array(x))
        recall = (pred & y).sum() / y.sum()
        print(f"layer {layer}: recall {recall:.3f} on unseen text, predicted density {pred.mean():.3f}, true {y.mean():.3f}")
        assert recall >= 0.9, (layer, recall)
        assert pred.mean() < 0.95  # it does not simply select everything
    for f in ffns:
        f.store = rec.inner
    def log_softmax(logits):
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    logp_dense = log_softmax(dense(mx.array([tokens]))[0])
    logp_pred = log_softmax(model(mx.array([tokens]))[0])
    kl = (np.exp(logp_dense) * (logp_dense - logp_pred)).sum(-1).mean()
    print(f"predictor: mean KL(dense || predictor) = {kl:.4f}")
    assert kl < 0.05, kl  # stated bound: mean KL(dense || predictor) per token


def test_predictor_without_calibration_is_a_clear_error(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", hidden_act="relu")
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    with pytest.raises(FlashError, match="run `mlx_flash.calibrate"):
        mlx_flash.load(out, mode="flash", sparsity="predictor")

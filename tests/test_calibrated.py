"""Calibrated thresholds (issue 19): the search, the manifest, the `calibrated` sources' math."""

import json
import subprocess
import sys

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from mlx_flash.layout import read_manifest
from mlx_flash.models.host import mlx_only
from mlx_flash.sparsity.allocation import SHARE, STEP, allocation, calibrate_thresholds
from mlx_flash.sparsity.calibrate import calibrate
from helpers import make_llama_folder, make_opt_folder, thresholded_ffn

WORDS = "the quick brown fox jumps over the lazy dog hello world paris is the capital".split()
PROMPT = [1, 5, 9, 33, 70, 12, 4, 100, 7, 250, 3]


@pytest.fixture(scope="module")
def folder(tiny_llama):
    out, _, cfg, t, d = tiny_llama("calibrated", "float32", dip=True, intermediate_size=256, num_hidden_layers=4)
    rng = np.random.default_rng(0)
    (d / "cal.txt").write_text(" ".join(rng.choice(WORDS, 3000)))
    section = calibrate_thresholds(out, data=str(d / "cal.txt"), tokens=512, seq_len=64, progress=False,
                                   log=lambda m: None)
    return out, cfg, t, section, d


def test_the_search_path_reaches_each_density(folder):
    out, cfg, _, section, _ = folder
    assert read_manifest(out).calibration["thresholds"] == section
    n_layers = cfg["num_hidden_layers"]
    assert section["tokens"] == 512 and len(section["quantiles"]["in"]) == n_layers
    prev = None
    for target in (0.9, 0.7, 0.5, 0.3, 0.2):
        a = allocation(section, target)
        # the first allocation of the path at or below the target: one step under it at most
        assert a.bytes_share <= target + 1e-9
        assert a.bytes_share > target - STEP * SHARE.max() / n_layers - 1e-9
        if prev is not None:  # one path: a lower target only lowers densities
            assert (a.density <= prev.density + 1e-9).all()
        prev = a
        # thresholds are the recorded quantiles at each side's density
        for s, side in enumerate(("in", "out")):
            q = np.array(section["quantiles"][side])
            idx = np.rint(a.density[:, s] / STEP).astype(int)
            np.testing.assert_array_equal(a.threshold[:, s], q[np.arange(n_layers), idx])
    half = allocation(section, 0.5)
    assert not np.allclose(half.density, 0.5)  # the search did not stay uniform
    full = allocation(section, 1.0)
    assert (full.density == 1).all() and (full.threshold == 0).all()


def test_allocation_errors(folder):
    section = folder[3]
    with pytest.raises(FlashError, match="reach down to 0.2"):
        allocation(section, 0.1)
    with pytest.raises(FlashError, match="calibrate` again"):
        allocation(dict(section, version=99), 0.5)


def test_predictor_calibration_keeps_the_thresholds(folder):
    out, _, _, section, d = folder
    calibrate(out, data=str(d / "cal.txt"), tokens=512, seq_len=64, rank=8, max_rank=8, epochs=1,
              progress=False, log=lambda m: None)
    cal = read_manifest(out).calibration
    assert cal["thresholds"] == section and "predictors" in cal


def test_full_density_is_exact(folder):
    out = folder[0]
    dense, _ = mlx_flash.load(out)
    model, _ = mlx_flash.load(out, mode="flash", sparsity="calibrated", density=1.0, memory_budget="70%")
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))), np.array(dense(mx.array([PROMPT]))),
                               atol=1e-4)


def test_layer_output_follows_the_thresholds(folder):
    """One token through one layer: |x| >= t_in columns, then |h~| >= t_out rows."""
    out, cfg, t, section, _ = folder
    model, _ = mlx_flash.load(out, mode="flash", sparsity="calibrated", density=0.5, memory_budget="75%")
    for x1, t_in, _ in _layer_outputs_follow(model, cfg, t, allocation(section, 0.5)):
        kept_in = (np.abs(x1) >= t_in).mean()
        assert 0 < kept_in < 1  # a real cut at this density


def _layer_outputs_follow(model, cfg, t, a, wina=False):
    """Layers 0 and 2 of `model` on a random token equal thresholded_ffn at allocation a's
    thresholds; -> [(the token, t_in, t_out)]."""
    out = []
    for layer in (0, 2):
        x = np.random.default_rng(layer).standard_normal((1, 1, cfg["hidden_size"])).astype(np.float32)
        model.runtime.store.stats.begin(1)
        got = np.array(model.layers[layer].mlp(mx.array(x)))[0, 0]
        t_in, t_out = a.threshold[layer]
        np.testing.assert_allclose(got, thresholded_ffn(t, layer, x[0, 0], t_in, t_out, wina), rtol=1e-4, atol=1e-4)
        out.append((x[0, 0], t_in, t_out))
    return out


def test_cache_aware_with_gamma_one_is_plain(folder):
    out = folder[0]
    from mlx_lm.generate import generate_step

    def greedy(m):
        return [int(tok) for tok, _ in generate_step(mx.array(PROMPT), m, max_tokens=8)]

    a, _ = mlx_flash.load(out, mode="flash", sparsity="calibrated", density=0.5, memory_budget="75%")
    b, _ = mlx_flash.load(out, mode="flash", sparsity="calibrated-ca", density=0.5, memory_budget="75%",
                          gamma=1.0)
    c, _ = mlx_flash.load(out, mode="flash", sparsity="calibrated-ca", density=0.5, memory_budget="75%",
                          gamma=0.2)
    assert greedy(a) == greedy(b)
    greedy(c)
    assert b.runtime.store.thresholds == a.runtime.source.thresholds


def test_needs_the_calibration(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False, dip=True)
    with pytest.raises(FlashError, match="mlx_flash.calibrate"):
        mlx_flash.load(out, mode="flash", sparsity="calibrated", density=0.5)


def test_not_for_ungated_ffns(tmp_path):
    src, _, _ = make_opt_folder(tmp_path / "hf")
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    (tmp_path / "cal.txt").write_text(" ".join(WORDS * 40))
    with pytest.raises(FlashError, match="gated"):
        calibrate_thresholds(out, data=str(tmp_path / "cal.txt"), tokens=128, seq_len=32, progress=False)


def test_cli_prints_the_densities(folder, tmp_path):
    out, cfg, _, _, d = folder
    png = tmp_path / "d.png"
    r = subprocess.run([sys.executable, "-m", "mlx_flash.cli.calibrate", "--model", str(out), "--data",
                        str(d / "cal.txt"), "--search-tokens", "256", "--seq-len", "64", "--quiet",
                        "--plot", str(png)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "thresholds (a SwiGLU FFN" in r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert len(lines) == cfg["num_hidden_layers"]
    assert "--sparsity calibrated" in r.stdout
    assert png.exists() or "matplotlib is not installed" in r.stdout
    assert json.loads((out / "manifest.json").read_text())["calibration"]["thresholds"]["tokens"] == 256


def test_uniform_ablation(folder):
    from mlx_flash.sparsity.allocation import uniform

    section = read_manifest(folder[0]).calibration["thresholds"]  # the CLI test calibrated again
    u = uniform(section, 0.5)
    assert (u.density == 0.5).all() and abs(u.bytes_share - 0.5) < 1e-9
    for s, side in enumerate(("in", "out")):
        np.testing.assert_array_equal(u.threshold[:, s], np.array(section["quantiles"][side])[:, 10])
    mid = uniform(section, 0.525)  # between grid points: between their thresholds
    assert (mid.threshold <= u.threshold + 1e-12).all()
    model, _ = mlx_flash.load(folder[0], mode="flash", sparsity="calibrated-uniform", density=0.5)
    assert model.runtime.source.thresholds == [tuple(t) for t in u.threshold.tolist()]
    with pytest.raises(FlashError, match="reach down"):
        uniform(section, 0.1)


@pytest.mark.parametrize("source,budget", [("calibrated", "60%"), ("calibrated-ca", "60%"), ("dip", None),
                                           ("dip-ca", "55%")])
def test_one_token_kernels_match_the_masked_products(folder, source, budget):
    """The DIP store's one-token path (gather_axpy over the chosen rows, streamed ones from
    the scratch) computes what the masked products over every cached row compute."""
    from mlx_lm.models.cache import make_prompt_cache

    out = folder[0]
    logits = []
    for native in (True, False):
        model, _ = mlx_flash.load(out, mode="flash", sparsity=source, density=0.5, memory_budget=budget)
        store = model.runtime.store
        assert (store.kernels is not None) == native or native is False
        if not native:
            store.kernels = None
        cache = make_prompt_cache(model)
        model(mx.array([PROMPT[:4]]), cache=cache)
        logits.append(np.stack([np.array(model(mx.array([[t]]), cache=cache)[0, 0]) for t in PROMPT[4:]]))
        if budget:
            assert store.plan.dip_capacity[0] < store.d_model  # the caches cannot hold a whole layer
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4)


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    from mlx_flash.convert.quantize import QuantOptions

    d = tmp_path_factory.mktemp("calibrated-q4")
    src, _, _ = make_llama_folder(d / "hf", "llama", intermediate_size=256, num_hidden_layers=3)
    out = convert(src, d / "q4", progress=False, dip=True, quant=QuantOptions(quantize=True, bits=4, group_size=32))
    (d / "cal.txt").write_text(" ".join(np.random.default_rng(1).choice(WORDS, 2000)))
    calibrate_thresholds(out, data=str(d / "cal.txt"), tokens=256, seq_len=64, progress=False, log=lambda m: None)
    return out


@pytest.mark.parametrize("source,density,budget", [("dip", 1.0, "60%"), ("dip", 0.5, "50%"),
                                                   ("calibrated", 0.5, "60%"), ("calibrated-ca", 0.4, None)])
def test_packed_rows_compute_what_float32_rows_do(q4, source, density, budget):
    """The DIP store holding a 4-bit model's rows at their bits (the default on the CPU) gives
    the logits of the same rows dequantized as read (--ffn-rows float32), prompt and decode;
    its caches hold ~7x the rows in the same budget."""
    from mlx_lm.models.cache import make_prompt_cache

    logits, stores = [], []
    for rows in (None, "float32"):
        model, _ = mlx_flash.load(q4, mode="flash", sparsity=source, density=density, memory_budget=budget,
                                  ffn_rows=rows)
        stores.append(model.runtime.store)
        cache = make_prompt_cache(model)
        out = [np.array(model(mx.array([PROMPT[:5]]), cache=cache)[0])]
        out += [np.array(model(mx.array([[t]]), cache=cache)[0]) for t in PROMPT[5:]]
        logits.append(np.concatenate(out))
    packed, plain = stores
    assert packed.packed_in is not None and plain.packed_in is None
    if budget:
        assert packed.plan.dip_capacity[0] > plain.plan.dip_capacity[0]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4)


def test_wina_scores_weigh_each_side_by_its_weights_norms(folder, tmp_path):
    """--score wina: the thresholds compare |x_i| ||(G; U)[:, i]|| and |h~_j| ||D[j]||; the norms
    are written beside the manifest, held by the source and counted in its resident bytes."""
    import shutil

    from mlx_flash.sparsity.allocation import NORMS_FILE

    src, cfg, t, _, d = folder
    out = tmp_path / "wina"
    shutil.copytree(src, out)
    section = calibrate_thresholds(out, data=str(d / "cal.txt"), tokens=512, seq_len=64, progress=False,
                                   log=lambda m: None, score="wina")
    assert section["score"] == "wina" and section["norms"]["file"] == NORMS_FILE and (out / NORMS_FILE).exists()
    model, _ = mlx_flash.load(out, mode="flash", sparsity="calibrated", density=0.5, memory_budget="75%")
    src_ = model.runtime.source
    assert src_.score_norms is not None and src_.resident_bytes >= 4 * cfg["num_hidden_layers"] * (
        cfg["hidden_size"] + cfg["intermediate_size"])
    for layer, (x1, t_in, t_out) in zip((0, 2), _layer_outputs_follow(model, cfg, t, allocation(section, 0.5),
                                                                      wina=True)):
        # the weights matter: the magnitudes alone keep other entries
        assert not np.allclose(thresholded_ffn(t, layer, x1, t_in, t_out, wina=True),
                               thresholded_ffn(t, layer, x1, t_in, t_out))
    model.runtime.close()
    (out / NORMS_FILE).write_bytes(b"damaged")
    with pytest.raises(FlashError):
        mlx_flash.load(out, mode="flash", sparsity="calibrated", density=0.5)


def _whole_model_record(path, seqs):
    """The reference for layerwise.record: X and G with the whole model in DRAM at float32, G as
    mx.grad of each sequence's mean NLL with respect to a zero added to each FFN's output."""
    from mlx_flash.models.ffn import FFNRows

    model, _ = mlx_flash.load(path, mode="dense", resident_dtype="float32", ffn_rows="float32")
    rt = model.runtime
    d = rt.ffns[0].d_model
    X, G = [[] for _ in rt.ffns], [[] for _ in rt.ffns]

    class Probe:
        def __init__(self, inner):
            self.inner, self.delta = inner, None

        def rows(self, layer, x):
            parts = self.inner.rows(layer, x)
            if self.delta is None:
                X[layer].append(x.reshape(-1, d))
                return parts
            return [parts, FFNRows(up=None, down=mx.eye(d), h=self.delta[layer])]

    probe = rt.wrap_store(Probe)
    for s in seqs:
        inp, tgt = mx.array([s[:-1]]), mx.array(s[1:])
        probe.delta = None
        mx.eval(model(inp))

        def nll(deltas):
            probe.delta = deltas
            logits = model(inp)[0].astype(mx.float32)
            return mx.mean(mx.logsumexp(logits, -1) - mx.take_along_axis(logits, tgt[:, None], -1)[:, 0])

        with mlx_only():  # (the model differentiated: MLX's graph only)
            g = mx.grad(nll)([mx.zeros((1, len(s) - 1, d)) for _ in rt.ffns])
        for i, gi in enumerate(g):
            G[i].append(gi.reshape(-1, d))
    rt.unwrap_store()
    rt.close()
    return [mx.concatenate(x) for x in X], [mx.concatenate(g) for g in G]


@pytest.mark.parametrize("which", ["float32", "q4"])
def test_the_layer_by_layer_record_equals_the_whole_model_in_dram(folder, q4, which, monkeypatch):
    """layerwise.record (a layer's float32 weights at a time, the head a chunk of its vocabulary at
    a time, sequences a few at a time) records the FFN inputs and loss gradients the whole model
    held in DRAM and differentiated at once gives."""
    from mlx_flash.sparsity import layerwise

    path = folder[0] if which == "float32" else q4
    monkeypatch.setattr(layerwise, "VOCAB_CHUNK", 100)  # (a few hundred rows: several chunks, the last short)
    monkeypatch.setattr(layerwise, "SEQS_AT_ONCE", 2)
    rng = np.random.default_rng(5)
    seqs = [list(map(int, rng.integers(0, 250, 33))) for _ in range(3)]
    X, G, W = layerwise.record(path, read_manifest(path), seqs, progress=False)
    want_x, want_g = _whole_model_record(path, seqs)
    assert len(X) == len(want_x) == len(W)
    for x, g, wx, wg in zip(X, G, want_x, want_g):
        np.testing.assert_allclose(np.array(x), np.array(wx), atol=2e-5, rtol=1e-4)
        scale = float(mx.abs(wg).max())
        assert scale > 0 and float(mx.abs(g - wg).max()) <= 1e-4 * scale
    assert W.held and len(W.held) <= W.keep  # (the FFN rows of the last layers asked for, no more)



def test_the_search_spill_keeps_every_array_whether_held_or_on_disk():
    """layerwise.Spill: the last `hold` arrays in DRAM, the others written to its folder on
    eviction and read back; a move renames (in DRAM or on disk); close removes the folder."""
    from mlx_flash.sparsity.layerwise import Spill

    spill = Spill(hold=2)
    arrays = {("cur", i): mx.array(np.random.default_rng(i).standard_normal((5, 7)).astype(np.float32))
              for i in range(4)}
    for k, a in arrays.items():
        spill.put(k, a)
    assert len(spill.held) == 2 and len(list(spill.dir.glob("*.npy"))) == 2  # (two written on eviction)
    spill.move(("cur", 0), ("in", 0))  # (on disk)
    spill.move(("cur", 3), ("in", 3))  # (in DRAM)
    want = {("in", 0): arrays[("cur", 0)], ("cur", 1): arrays[("cur", 1)], ("cur", 2): arrays[("cur", 2)],
            ("in", 3): arrays[("cur", 3)]}
    for k, a in list(want.items()) * 2:  # (twice: every get re-holds one and evicts another)
        assert mx.array_equal(spill.get(k), a).item()
    spill.put(("cur", 1), arrays[("cur", 3)])  # (a new value replaces the one on disk or held)
    assert mx.array_equal(spill.get(("cur", 1)), arrays[("cur", 3)]).item()
    folder = spill.dir
    spill.close()
    assert not folder.exists()

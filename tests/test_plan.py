"""--mode auto, the cost model and the machine profile (mlx_flash/plan/): what a user who gives
only a memory limit can rely on."""

import json
import re
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_flash
from mlx_flash.errors import BudgetTooSmall, FlashError
from mlx_flash.kernels import kernels_module
from mlx_flash.plan import measure as probe
from mlx_flash.plan import profile as profile_mod
from mlx_flash.plan.choose import Candidate, choose_mode, variants
from mlx_flash.plan.cost import Prediction, Work, predict, predict_at_disk_rate
from mlx_flash.plan.profile import Profile, load_profile, save_profile
from mlx_flash.runtime.config import FlashConfig
from test_parity import TOKENS, greedy

MB = 10**6


def _rates(**gbs):
    """{form: {matrix elements: GB/s}}, one rate at every size."""
    return {form: {10**6: v} for form, v in gbs.items()}


def _profile(**kw):
    base = dict(disk={4096: 0.5, 262144: 2.0}, threads=32, compute=_rates(float32=10.0, q4=20.0),
                layer_ms={"dense": {128: 1.0}, "hybrid": {128: 2.0}, "naive": {128: 1.5}},
                token_ms={"dense": {128: 0.0}}, overlap=1.0, machine=profile_mod.machine_key(),
                mlx=mx.__version__, device="cpu", measured="now")
    return Profile(**(base | kw))


def test_cost_model_arithmetic():
    p = _profile()
    w = Work(read_bytes=200 * MB, read_size=262144, computed={"float32": 100 * MB, "q4": 40 * MB},
             overlapped=False, n_layers=10, mode="hybrid")
    got = predict(w, p)
    assert got.io_ms == pytest.approx(100.0)  # 200 MB at 2 GB/s
    assert got.compute_ms == pytest.approx(10.0 + 2.0 + 10 * 2.0)  # bytes at their rates + 10 layers x 2 ms
    assert got.total_ms == pytest.approx(got.io_ms + got.compute_ms)
    w.overlapped = True  # prefetch hiding all it can: the larger of the two, plus one layer's share of the smaller
    assert predict(w, p).total_ms == pytest.approx(100.0 + 32.0 / 10)
    p.overlap = 0.5  # hiding half of it (the reader's threads share the cores with the compute)
    assert predict(w, p).total_ms == pytest.approx(100.0 + 32.0 - 0.5 * 32.0 * 9 / 10)
    # flash mode's overlap hides reads behind the cached rows' compute only (10 MB: 1 ms), not behind all of it
    w.hideable = {"float32": 10 * MB}
    assert predict(w, p).total_ms == pytest.approx(100.0 + 32.0 - 0.5 * 1.0 * 9 / 10)
    w.hideable = None
    # rows dequantized into float32 on the way: the reader's cost a value, part of the I/O
    p.convert_ns = 2.0
    assert predict(Work(0, 1, {}, False, 0, "dense", converted_values=10**6), p).io_ms == pytest.approx(2.0)
    p.convert_ns = 0.0
    # rows placed as they are: the reader's copy and checks, a GB at the profile's place_s, part of the I/O
    p.place_s = 0.05
    placed = Work(200 * MB, 262144, {}, False, 0, "dense", placed_bytes=200 * MB)
    assert predict(placed, p).io_ms == pytest.approx(100.0 + 10.0)
    p.place_s = 0.0
    # each batch of reads (a layer's) waits its first read's latency beyond its bytes: part of the
    # I/O, so prefetch hides it with the rest
    p.batch_ms = 0.5
    assert predict(Work(0, 1, {}, False, 0, "dense", read_batches=10), p).io_ms == pytest.approx(5.0)
    w.read_batches, w.overlapped = 10, False
    assert predict(w, p).io_ms == pytest.approx(105.0)
    w.read_batches, w.overlapped, p.batch_ms = 0, True, 0.0
    # rows a cache moves within itself (memory management): their bytes at the float32 rate, never hidden
    w.moved_bytes = 10 * MB
    got = predict(w, p)
    assert got.mem_ms == pytest.approx(1.0) and got.total_ms == pytest.approx(100.0 + 32.0 - 0.5 * 32.0 * 9 / 10 + 1.0)
    w.moved_bytes = 0
    p.overlap, p.token_ms = 1.0, {"dense": {128: 3.0}}  # once a token, never hidden
    assert predict(w, p).total_ms == pytest.approx(100.0 + 32.0 / 10 + 3.0)
    assert predict(w, p).compute_ms == pytest.approx(32.0 + 3.0)
    # the disk curve is interpolated on log(read size): 64 KiB lies halfway between 4 KiB and 256 KiB
    assert p.disk_gbs(65536) == pytest.approx(0.5 + (2.0 - 0.5) * 4 / 6)
    with pytest.raises(FlashError, match="no compute rate for q8"):
        predict(Work(0, 1, {"q8": 1}, False, 1, "dense"), p)
    # compute rates by matrix size, interpolated on log(elements), the ends held beyond
    p = _profile(compute={"q4": {10**6: 4.0, 10**8: 12.0}})
    assert p.compute_gbs("q4", 10**7) == pytest.approx(8.0)
    assert p.compute_gbs("q4", 10**5) == 4.0 and p.compute_gbs("q4", 10**9) == 12.0 and p.compute_gbs("q4") == 12.0
    w = Work(0, 1, {"q4": 40 * MB}, False, 0, "dense", matrix_elements=10**7)
    assert predict(w, p).compute_ms == pytest.approx(5.0)  # 40 MB at 8 GB/s
    assert Profile.from_dict(p.as_dict()).compute == p.compute  # (JSON keys are strings)
    p.batch_ms = 0.25
    assert Profile.from_dict(p.as_dict()).batch_ms == 0.25
    # an FFN's packed rows at their kernels' own rate; where those were not measured (off the
    # CPU, where MLX computes both), at the resident matrices'
    assert p.compute_gbs("q4-rows", 10**7) == pytest.approx(8.0)
    p.compute["q4-rows"] = {10**6: 2.0}
    assert p.compute_gbs("q4-rows", 10**7) == 2.0 and p.compute_gbs("q4", 10**7) == pytest.approx(8.0)
    with pytest.raises(FlashError, match="no compute rate for q8"):
        p.compute_gbs("q8-rows")
    # the per-layer overhead by model width, interpolated, the ends held beyond
    p = _profile(layer_ms={"dense": {128: 1.0, 576: 2.0}})
    assert p.layer_cost("dense", 352) == pytest.approx(1.5) and p.layer_cost("dense", 4096) == 2.0
    assert p.layer_cost("naive", 64) == 1.0  # a mode not probed: dense's
    w = Work(0, 1, {}, False, 10, "dense", d_model=352)
    assert predict(w, p).compute_ms == pytest.approx(15.0)
    assert Profile.from_dict(p.as_dict()).layer_ms == p.layer_ms
    assert Profile.from_dict(p.as_dict()).token_ms == p.token_ms
    # the disk curve scaled to a rate measured later at one read size: its shape kept
    p = _profile()
    q = p.with_disk_rate(1.0, 262144)
    assert q.disk_gbs(262144) == pytest.approx(1.0) and q.disk_gbs(4096) == pytest.approx(0.25)
    assert p.disk == {4096: 0.5, 262144: 2.0}  # (a copy)
    w = Work(read_bytes=200 * MB, read_size=262144, computed={}, overlapped=False, n_layers=0, mode="dense")
    assert predict(w, q).io_ms == pytest.approx(2 * predict(w, p).io_ms)


def test_reads_landing_during_the_compute_they_overlap_slow_it():
    """With prefetch, the next layer's reads land while this layer computes and take from it
    (Profile.read_steal, s a GB): all of them when the compute spans the reads (a batch's step),
    the compute's share of the I/O when the disk is the longer (a disk-bound token: then hidden
    but for a layer's share); nothing without prefetch, nothing for a profile measured before it."""
    from dataclasses import replace

    p = _profile(read_steal=0.25)
    w = Work(read_bytes=200 * MB, read_size=262144, computed={"float32": 2000 * MB}, overlapped=True, n_layers=10,
             mode="hybrid")
    base = predict(w, replace(p, read_steal=0.0))  # io 100, compute 200 + 20 layers
    got = predict(w, p)
    assert got.compute_ms == pytest.approx(base.compute_ms + 50.0)  # 0.2 GB x 0.25 s: every read during it
    assert got.total_ms == pytest.approx(base.total_ms + 50.0)
    short = replace(w, computed={"float32": 300 * MB})  # compute 30 + 20 layers: half the I/O's 100 ms
    b, g = predict(short, replace(p, read_steal=0.0)), predict(short, p)
    assert g.compute_ms == pytest.approx(b.compute_ms + 50.0 * 0.5)  # the reads' share that lands during it
    assert g.total_ms == pytest.approx(b.total_ms + 25.0 / 10)  # hidden behind the disk but for a layer's share
    off = replace(w, overlapped=False)
    assert predict(off, p).total_ms == predict(off, replace(p, read_steal=0.0)).total_ms
    assert Profile.from_dict({k: v for k, v in p.as_dict().items() if k != "read_steal"}).read_steal == 0.0
    assert Profile.from_dict(p.as_dict()).read_steal == 0.25


def test_compute_beside_the_reads_slows_them():
    """The reads that land during a layer's compute keep only read_busy of their rate alone: the
    compute hides at most read_busy x its time of I/O. A token whose reads outlast its compute
    takes I/O + (1 - read_busy) x compute (but for a layer's share); one whose compute spans its
    reads even at that rate, the same as before; nothing changes without prefetch, nor for a
    profile measured before it (1.0)."""
    from dataclasses import replace

    p = _profile(read_busy=0.5)
    w = Work(read_bytes=200 * MB, read_size=262144, computed={"float32": 300 * MB}, overlapped=True, n_layers=10,
             mode="hybrid")  # I/O 100, compute 30 + 20 layers = 50
    alone = predict(w, replace(p, read_busy=1.0))
    assert alone.total_ms == pytest.approx(100.0 + 50.0 - 50.0 * 9 / 10)
    assert predict(w, p).total_ms == pytest.approx(100.0 + 50.0 - 0.5 * 50.0 * 9 / 10)
    assert predict(w, p).io_ms == alone.io_ms and predict(w, p).compute_ms == alone.compute_ms
    long = replace(w, computed={"float32": 3000 * MB})  # compute 320: it spans the 100 ms of reads at half the rate
    assert predict(long, p).total_ms == pytest.approx(predict(long, replace(p, read_busy=1.0)).total_ms)
    off = replace(w, overlapped=False)
    assert predict(off, p).total_ms == predict(off, replace(p, read_busy=1.0)).total_ms
    # flash mode's overlap: the reads hidden behind the cached rows' compute only (10 MB: 1 ms), at half
    # their rate there, and the reads landing during it cost it read_steal for that share of them:
    # 0.5 x 1 ms / 100 ms of 0.2 GB x 0.25 s
    flash = replace(w, hideable={"float32": 10 * MB})
    got = predict(flash, replace(p, read_steal=0.25))
    steal = 1e3 * 0.25 * 0.2 * 0.5 * 1.0 / 100.0
    assert got.total_ms == pytest.approx(100.0 + 50.0 + steal - 0.5 * (1.0 + steal) * 9 / 10)
    # predicted at a disk rate a run's counters gave: the run's own I/O path is in that rate already
    at = predict_at_disk_rate(replace(w, placed_bytes=200 * MB), replace(p, place_s=0.05), 2.0)
    assert at.total_ms == pytest.approx(alone.total_ms)
    assert Profile.from_dict({k: v for k, v in p.as_dict().items() if k != "read_busy"}).read_busy == 1.0
    assert Profile.from_dict(p.as_dict()).read_busy == 0.5


def test_a_batch_step_is_priced_from_the_profile_s_rates_for_a_step_of_that_many_sequences():
    """A decode step of B sequences reads what one token reads and multiplies every weight into
    B positions: up to SMALL_PASS as B one-position products (what the runtime runs), beyond at
    the profile's measured rates for a step of B, interpolated between the measured sizes; a
    profile without them prices B one-position steps and says so."""
    from dataclasses import replace

    from mlx_flash.kernels import SMALL_PASS

    p = _profile(compute=_rates(float32=10.0, q4=20.0), pass_compute={"q4": {10**6: {16: 2.0, 32: 1.5}}})
    w = Work(read_bytes=200 * MB, read_size=262144, computed={"q4": 40 * MB}, overlapped=False, n_layers=10,
             mode="hybrid")
    one = predict(w, p)
    assert one.compute_ms == pytest.approx(2.0 + 20.0) and one.positions == 1 and one.batch_priced

    def compute(b):
        got = predict(replace(w, positions=b), p)
        assert got.io_ms == one.io_ms and got.positions == b and got.batch_priced  # the step reads what a token does
        return got.compute_ms - 20.0  # less the 10 layers' 2 ms

    assert compute(SMALL_PASS) == pytest.approx(SMALL_PASS * 2.0)
    assert compute(16) == pytest.approx(20.0)  # 40 MB at 2 GB/s
    assert compute(SMALL_PASS + 1) == compute(10) == pytest.approx(20.0)  # fewer than measured: the tiles pad to 16
    assert compute(24) == pytest.approx(20.0 + (40 / 1.5 - 20.0) / 2)  # between measured sizes: linear
    assert compute(32) == pytest.approx(40 / 1.5) and compute(64) == pytest.approx(2 * 40 / 1.5)
    # a step is priced by what it cost against one position where measured (the quick probe: a 7B
    # matrix only), not by the measured size's absolute rate: a small matrix whose one-position rate
    # is a third of the large one's keeps the large one's ratio
    sized = _profile(compute={"q4": {10**6: 6.0, 10**8: 18.0}}, pass_compute={"q4": {10**8: {16: 6.0}}})
    small = replace(w, n_layers=0, computed={"q4": 6 * MB}, matrix_elements=10**6)
    assert predict(replace(small, positions=16), sized).compute_ms == pytest.approx(3 * predict(small, sized).compute_ms)
    # the FFN's packed rows take their own batch rates where measured, else the quantized matrices'
    rows = replace(w, computed={"q4-rows": 40 * MB}, positions=16)
    assert predict(rows, p).compute_ms == pytest.approx(20.0 + 20.0)
    p.pass_compute["q4-rows"] = {10**6: {16: 1.0}}
    assert predict(rows, p).compute_ms == pytest.approx(40.0 + 20.0)
    # no batch rates for a form: B one-position products, said by the prediction
    f32 = predict(replace(w, computed={"float32": 40 * MB}, positions=16), p)
    assert f32.compute_ms == pytest.approx(16 * 4.0 + 20.0) and not f32.batch_priced
    assert "a step of 16 sequences" in f32.describe() and "no batch rates" in f32.describe()
    assert f32.as_dict()["batch_priced"] is False
    # float32 weights (MLX multiplies a pass at once, as every form on a GPU): from one position's time
    p.pass_compute["float32"] = {10**6: {16: 1.0}}  # a step of 16 costs 10 positions' time
    f32 = replace(w, computed={"float32": 40 * MB}, n_layers=0)
    assert predict(replace(f32, positions=2), p).compute_ms == pytest.approx(4.0 + 4.0 * 9 / 15)
    assert predict(replace(f32, positions=16), p).compute_ms == pytest.approx(40.0)
    gpu = _profile(device="gpu", compute=_rates(q4=20.0), pass_compute={"q4": {10**6: {16: 2.0}}})
    assert predict(replace(w, n_layers=0, positions=2), gpu).compute_ms == pytest.approx(2.0 + 18.0 / 15)
    del p.pass_compute["float32"]
    assert not predict(replace(f32, positions=2), p).batch_priced  # (2 one-position steps: not what runs)
    assert predict(replace(w, positions=2), p).batch_priced  # (the kernels: position by position)
    # the rates survive the profile's JSON; a profile written before them loads without any
    back = Profile.from_dict(json.loads(json.dumps(p.as_dict())))
    assert back.pass_compute == p.pass_compute
    old = p.as_dict()
    del old["pass_compute"]
    assert Profile.from_dict(old).pass_compute == {}


def test_exact_work_counts_a_batch_of_reads_per_layer_and_store():
    from types import SimpleNamespace as NS

    from mlx_flash.plan.cost import exact_work

    lay = NS(kinds=("gate", "up", "down"), d_model=64, stride=1024, quant=None, dtype="float32", bundle_bytes=768)

    def plan(mode, held):
        return NS(n_layers=4, n_neurons=100, mode=mode, held_neuron_bytes=0, prefetch=True,
                  layer_capacity=lambda i: held)

    assert exact_work(plan("dense", 100), lay, False, {}, 1 << 18).read_batches == 0  # reads nothing
    assert exact_work(plan("hybrid", 50), lay, False, {}, 1 << 18).read_batches == 4  # a layer's stream
    w = exact_work(plan("naive", 0), lay, False, {}, 1 << 18, attention_read=(10 * MB, 3), kv_read=(MB, 4096, 4))
    assert w.read_batches == 4 + 3 + 4 and w.read_bytes == 4 * 100 * 1024 + 10 * MB
    # every byte read is placed into rows as it is (float32 rows of a float32 layout, the attention's
    # words, the KV cache's blocks) ...
    assert w.placed_bytes == 4 * 100 * 1024 + 10 * MB + MB and w.converted_values == 0
    # ... but rows converted on the way (a float16 layout read into float32 rows: convert_ns prices them)
    w16 = exact_work(plan("naive", 0), NS(**vars(lay) | {"dtype": "float16"}), False, {}, 1 << 18,
                     attention_read=(10 * MB, 3))
    assert w16.placed_bytes == 10 * MB and w16.converted_values == 4 * 100 * 3 * 64
    # rows held at their bits (packed): placed as they are
    q = NS(**vars(lay) | {"quant": NS(bits=4)})
    assert exact_work(plan("naive", 0), q, True, {}, 1 << 18).placed_bytes == 4 * 100 * 1024
    # a long context: the KV cache's chunks, several a layer, each a batch
    assert exact_work(plan("dense", 100), lay, False, {}, 1 << 18, kv_read=(64 * MB, 4 << 20, 16)).read_batches == 16
    # --unbundled: a batch a weight kind of a layer's rows
    assert exact_work(plan("hybrid", 50), lay, False, {}, 1 << 18, bundled=False).read_batches == 4 * 3
    # the attention of 3 streamed layers in a dense FFN: its batches alone
    assert exact_work(plan("dense", 100), lay, False, {}, 1 << 18, attention_read=(MB, 3)).read_batches == 3


def test_rows_held_at_16_bits_are_priced_at_the_kernels_that_read_them_in_place():
    """A float16-held FFN (dense, a hybrid's cache) is priced as float16-rows (gather_mv, then
    gather_axpy for the down rows: ~2/3 of HalfLinear's rate here), and at float16's rate by a
    profile that has none; the streamed rows at float32."""
    from dataclasses import replace
    from types import SimpleNamespace as NS

    from mlx_flash.plan.cost import exact_work

    lay = NS(kinds=("gate", "up", "down"), d_model=64, stride=1024, quant=None, dtype="float16", bundle_bytes=384)
    held = NS(n_layers=4, n_neurons=100, mode="hybrid", held_neuron_bytes=384, prefetch=False,
              layer_capacity=lambda i: 60)
    w = exact_work(held, lay, False, {}, 1 << 18)
    assert w.computed == {"float16-rows": 4 * 60 * 3 * 64 * 2, "float32": 4 * 40 * 3 * 64 * 4}
    p = _profile(compute=_rates(float32=10.0, float16=30.0))
    rows = dict(w.computed, float32=0)
    without = predict(replace(w, computed=rows), p).compute_ms
    p.compute["float16-rows"] = {k: 20.0 for k in p.compute["float16"]}
    assert predict(replace(w, computed=rows), p).compute_ms - without == pytest.approx(
        1e3 * rows["float16-rows"] / 1e9 * (1 / 20.0 - 1 / 30.0))


def _plan_of(budget, needs):
    def f(c):
        need = needs[c.label]
        if need > budget:
            raise BudgetTooSmall("x", budget, need, f"{c.label} needs {need}")
        return (type("P", (), {"layer_capacity": lambda self, i: 5, "n_neurons": 10})(), False, False)
    return f


def test_choose_mode_takes_the_first_exact_mode_that_fits():
    needs = {"dense": 300, "hybrid": 200, "naive": 150}

    def plan_of(budget):
        return _plan_of(budget, needs)

    cfg = FlashConfig()
    assert choose_mode(cfg, None, plan_of(0)).mode == "dense"  # no budget: everything in DRAM
    assert choose_mode(cfg, 400, plan_of(400)).mode == "dense"
    c = choose_mode(cfg, 250, plan_of(250))
    assert c.mode == "hybrid" and "dense needs 300" in c.reason
    assert [x.mode for x in c.candidates if x.plan is None] == ["dense"]
    assert choose_mode(cfg, 160, plan_of(160)).mode == "naive"
    with pytest.raises(BudgetTooSmall, match="x"):  # none fits: naive's error, the least DRAM
        choose_mode(cfg, 100, plan_of(100))
    # a sparsity option asks for flash, the one mode that is not exact
    assert choose_mode(FlashConfig(sparsity="dip", density=0.5), 250, plan_of(250)).mode == "flash"
    assert "no machine profile" in c.reason  # (the order decides, and says why)


def test_choose_mode_never_takes_a_hybrid_holding_no_neuron_where_naive_fits():
    """A hybrid whose budget holds no neuron reads what naive reads, with a cache's parts: naive
    instead, even where the cost model puts it a hair ahead."""
    empty = type("P", (), {"layer_capacity": lambda self, i: 0, "n_neurons": 10})()

    def plan_of(c):
        return (empty, False, False)

    def predict(c):
        return Prediction(0.0, 0.0, {"hybrid": 189, "naive": 190}.get(c.label, 500))

    c = choose_mode(FlashConfig(), 100, plan_of, [Candidate("hybrid"), Candidate("naive")], predict)
    assert c.mode == "naive" and "hybrid" not in c.reason
    assert "hold no neuron" in next(x.error for x in c.candidates if x.mode == "hybrid")


def test_choose_mode_with_a_profile_takes_the_fastest_predicted_plan_that_fits():
    """With predicted times, the minimum of the plans that fit, float16-held rows among them;
    without (no profile cached), the order of the bytes read: float16 rows before float32."""
    needs = {"dense": 300, "dense (float16 rows)": 170, "hybrid (float16 rows)": 120, "hybrid": 120, "naive": 100}
    times = {"dense": 10, "dense (float16 rows)": 30, "hybrid (float16 rows)": 45, "hybrid": 40, "naive": 50}

    def predict(c):
        return Prediction(0.0, 0.0, times[c.label])

    cfg = FlashConfig()
    c = choose_mode(cfg, 200, _plan_of(200, needs), variants(True), predict)
    assert c.label == "dense (float16 rows)" and c.rows16 and "30 ms/token" in c.reason and "hybrid 40" in c.reason
    c = choose_mode(cfg, 150, _plan_of(150, needs), variants(True), predict)
    assert c.mode == "hybrid" and not c.rows16  # float32 rows: fewer held, but faster here
    c = choose_mode(cfg, 150, _plan_of(150, needs), variants(True), None)
    assert c.label == "hybrid (float16 rows)"  # no profile: the fewest bytes
    c = choose_mode(cfg, 150, _plan_of(150, needs), variants(True), lambda c: None)
    assert c.label == "hybrid (float16 rows)"


def test_auto_under_a_budget_holds_what_fits_and_stays_exact(smollm2):
    dense, _ = mlx_flash.load(smollm2)
    assert dense.runtime.mode == "dense" and dense.runtime.choice.mode == "dense"
    want = dense(mx.array([TOKENS]))
    need = dense.runtime.plan.weights_bytes
    model, _ = mlx_flash.load(smollm2, memory_budget=str(int(need * 0.9)))
    rt = model.runtime
    assert rt.mode == "hybrid" and rt.choice.candidates[0].plan is None  # dense did not fit
    if getattr(rt.store, "packed", False):  # (rows at their bits: the native kernels compute them)
        lay = rt.manifest.layout  # the cost model counts every FFN row at the packed row kernels' rate
        assert rt.work().computed["q4-rows"] == rt.plan.n_layers * rt.plan.n_neurons * lay.bundle_bytes
    # more than the paper's half: as many neurons as the budget allows
    assert rt.plan.n_neurons // 2 < rt.plan.capacity < rt.plan.n_neurons
    assert rt.plan.weights_bytes <= int(need * 0.9)
    # exact to the bit: the held and the streamed rows' sums chain in dense's order (the held
    # neurons a whole number of the down columns' groups)
    assert rt.plan.capacity % rt.manifest.layout.quant.group_size == 0
    assert mx.array_equal(model(mx.array([TOKENS])), want).item()
    assert greedy(model, TOKENS, 8) == greedy(dense, TOKENS, 8)
    rt.close()


def test_profile_is_cached_per_machine_and_probed_when_missing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "profile.json"
    measured = []
    monkeypatch.setattr(probe, "measure", lambda quick=False, **kw: measured.append(quick) or _profile())
    assert load_profile(path) is None  # (the runtime's layers only read the cache)
    p = probe.ensure_profile(path)  # none cached: a quick probe, said, then cached
    assert measured == [True] and "quick probe" in capsys.readouterr().err
    assert Profile.from_dict(json.loads(path.read_text())).layer_ms == p.layer_ms
    assert probe.ensure_profile(path).compute == p.compute and measured == [True]  # read, not measured again
    save_profile(_profile(machine="another machine"), path)
    assert load_profile(path) is None
    probe.ensure_profile(path)
    assert measured == [True, True] and "another machine" in capsys.readouterr().err
    path.write_text("{not json")
    probe.ensure_profile(path)
    assert measured == [True, True, True] and "unreadable" in capsys.readouterr().err


def test_explain_and_stats_show_the_plan_and_the_prediction(smollm2, tmp_path):
    """The CLI with a cached profile: --explain lists every mode compared, --stats puts the
    prediction beside the measured time."""
    home = tmp_path / "home"
    # (hybrid's per-layer cost below naive's, so the cost model prefers hybrid at this budget)
    save_profile(_profile(compute=_rates(float32=10.0, q4=20.0, float16=5.0, bfloat16=5.0, q8=20.0),
                          layer_ms={"dense": {128: 1.0}, "hybrid": {128: 1.0}, "naive": {128: 1.5}}),
                 home / "profile.json")
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "generate", "--model", str(smollm2), "--prompt", "Hi",
                        "--max-tokens", "4", "--memory-budget", "72MB", "--explain", "--stats"],
                       capture_output=True, text=True, timeout=300, env=_env(home))
    assert r.returncode == 0, r.stderr
    assert "plan: --mode auto: hybrid (the fastest predicted" in r.stderr and "dense   does not fit" in r.stderr, r.stderr
    assert "<- chosen" in r.stderr and "naive" in r.stderr
    assert "Cost model: predicted" in r.stdout and "Mode hybrid" in r.stdout, r.stdout


def _check_quick_profile(p, small_file=False):
    """small_file: probed on a file smaller than a layer's reads (a SmolLM2 FFN file): the reads
    beside compute and their placing were not measured, and the profile says so."""
    assert p is not None and p.quick and set(p.layer_ms) == {"dense", "hybrid", "naive"}
    assert all(set(r) == {128, 576} and all(v >= 0 for v in r.values()) for r in p.layer_ms.values())
    assert set(p.token_ms) == set(p.layer_ms) and 0.0 <= p.overlap <= 1.0
    assert {"float32", "float16", "q4", "q8"} <= set(p.compute) and all(v > 0 for v in p.disk.values())
    assert min(p.disk) == 2048  # (a 4-bit 7B's unbundled neuron rows are read 2.5 KiB at a time)
    assert 0.0 <= p.convert_ns < 100.0  # (0.25-0.4 ns a value here; 0 where the reads alone took longer)
    # the checks' share of the cores at least, the reads' cost to the compute beside it (~0.1-0.2 s a GB here)
    assert 0.0 < p.read_steal < 5.0
    # and the compute's cost to the reads beside it: a share of their rate alone (0.92-0.95 here), and
    # what placing them into rows adds, s a GB (~0.04 here); both measured (a note where they were not)
    assert 0.0 < p.read_busy <= 1.0 and 0.0 <= p.place_s < 1.0
    noted = any("not measured" in n and "placing" in n for n in p.notes)
    assert noted == small_file and (not small_file or (p.read_busy, p.place_s) == (1.0, 0.0)), p.notes
    # a batch's decode step, every form at a 7B FFN matrix's size (the quick probe's one), 16 and 32 sequences
    assert set(p.compute) == set(p.pass_compute)
    assert all(list(r) == [11008 * 4096] and set(r[11008 * 4096]) == {16, 32} and min(r[11008 * 4096].values()) > 0
               for r in p.pass_compute.values())
    if kernels_module()[0] is not None and p.device == "cpu":  # the FFN's packed / held row kernels, apart
        assert {"q4-rows", "q8-rows", "float16-rows"} <= set(p.compute)
    assert all(len(r) == 3 and all(v > 0 for v in r.values()) for r in p.compute.values())  # three matrix sizes


@pytest.mark.slow  # (30-50 s: the same quick probe as the --explain test below, which checks the profile it writes)
def test_benchmark_profile_writes_one(tmp_path, smollm2):
    home = tmp_path / "home"
    ffn = next((smollm2 / "ffn").glob("*.bin")) if (smollm2 / "ffn").is_dir() else next(smollm2.glob("**/*.bin"))
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "benchmark", "profile", "--quick", "--file", str(ffn)],
                       capture_output=True, text=True, timeout=300, env=_env(home))
    assert r.returncode == 0, r.stderr
    _check_quick_profile(load_profile(home / "profile.json"), small_file=ffn.stat().st_size < 8192 * 4608)


def _env(home):
    import os

    return os.environ | {"MLX_FLASH_HOME": str(home)}


def test_explain_without_a_profile_says_so(smollm2, tmp_path, monkeypatch, capsys):
    """load(explain=True) from Python never measures the machine: with none cached it lists the
    modes, what each holds and reads, and says where predicted times come from."""
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path / "empty"))
    model, _ = mlx_flash.load(smollm2, memory_budget="72MB", explain=True, progress=False)
    err = capsys.readouterr().err
    assert "plan: --mode auto: hybrid" in err and "(no profile)" in err and "no machine profile is cached" in err
    assert not (tmp_path / "empty" / "profile.json").exists()
    model.runtime.close()


def test_auto_holds_a_float16_models_rows_at_float16_when_that_fits_and_stays_exact(tmp_path):
    """A float16 model computed in float32 whose float32 rows do not fit but whose float16 rows
    do: auto holds them at float16 (no profile cached: the fewest bytes read), the logits exact."""
    from mlx_flash.convert.random_model import build_checkpoint

    folder = build_checkpoint("tiny-llama", "float16", home=tmp_path, progress=False)
    dense, _ = mlx_flash.load(folder, mode="dense")
    x = mx.array([[1, 5, 9, 42, 7, 100]])
    want = dense(x)
    full = dense.runtime.plan.weights_bytes  # everything at float32
    dense.runtime.close()
    model, _ = mlx_flash.load(folder, memory_budget=str(int(full * 0.9)))  # (the resident part is most of it)
    rt = model.runtime
    if kernels_module()[0] is not None:  # (the CPU: held at float16 from the start, the kernels read it)
        assert rt.resident_dtype == "float16" and rt.choice.label == "dense" and rt.mode == "dense"
    else:
        assert rt.choice.label == "dense (float16 rows)" and rt.mode == "dense", rt.choice.describe()
        assert [c.label for c in rt.choice.candidates if c.plan is None] == ["dense"]
    assert rt.plan.weights_bytes <= int(full * 0.9) and rt.plan.held_neuron_bytes
    assert mx.abs(model(x) - want).max().item() <= 1e-5
    rt.close()


@pytest.mark.parametrize("kernels", [True, False])
def test_auto_holds_a_float16_models_resident_weights_at_float16_when_float32_leaves_no_plan(tmp_path, caplog,
                                                                                           monkeypatch, kernels):
    """The resident weights (embeddings, attention) at float32 do not fit, or fit but leave no
    exact plan room beside them: auto holds them at float16 as stored, says so, and stays exact.
    Where the native kernels run (kernels=True, on a build that has them) it holds them so from
    the start; without them (a build that lacks them: injected) when float32 leaves no plan."""
    from mlx_flash import loader
    from mlx_flash.convert.random_model import build_checkpoint
    from mlx_flash.plan import fit

    kernels = kernels and kernels_module()[0] is not None
    if not kernels:  # (the plan's choice of dtype, and the loader's modules)
        for m in (loader, fit):
            monkeypatch.setattr(m, "kernels_module", lambda: (None, "not built (injected)"))

    folder = build_checkpoint("tiny-llama", "float16", home=tmp_path, progress=False)
    dense, _ = mlx_flash.load(folder, mode="dense")
    x = mx.array([[1, 5, 9, 42, 7, 100]])
    want = dense(x)
    resident32 = dense.runtime.resident.held_bytes
    dense.runtime.close()
    # (here naive's buffers outweigh the resident part: at float32 it fits, and no plan beside it,
    # 2.38 MB for naive; at float16 naive takes 1.85 MB)
    for budget in (int(resident32 * 1.32),):
        caplog.clear()
        model, _ = mlx_flash.load(folder, memory_budget=str(budget))
        rt = model.runtime
        assert rt.resident_dtype == "float16" and rt.plan.weights_bytes <= budget, rt.choice.describe()
        # (without the kernels: found before the weights load, or once they have)
        assert re.search("the native kernels multiply them as" if kernels else
                         "beside the resident weights at float32; holding those at float16|"
                         "the least FFN plan .*; held at float16 as stored instead", caplog.text)
        assert mx.abs(model(x) - want).max().item() <= 1e-5
        rt.close()
    # an explicit mode keeps its resident dtype (refused before or after the weights load)
    # (and says how it would fit)
    with pytest.raises(BudgetTooSmall, match="(--mode naive needs|the least FFN plan).*--resident-dtype float16"):
        mlx_flash.load(folder, mode="naive", memory_budget=str(int(resident32 * 1.32)))


def test_auto_keeps_a_quantized_models_resident_weights_at_their_bits(tmp_path, caplog):
    """A quantized model's manifest says float16 (its scales): auto never holds its resident
    weights "at float16" (which would dequantize them, 4x the DRAM)."""
    from mlx_flash.convert.random_model import build_checkpoint

    folder = build_checkpoint("tiny-llama", "q4", home=tmp_path, progress=False)
    model, _ = mlx_flash.load(folder, memory_budget="60%")
    assert model.runtime.resident_dtype == "quantized"
    model.runtime.close()
    with pytest.raises(BudgetTooSmall):
        mlx_flash.load(folder, memory_budget="1KB")
    assert "float16" not in caplog.text


@pytest.mark.slow  # (70-80 s: the quick probe measures the machine in a child process; -m slow runs it)
def test_explain_without_a_profile_probes_in_a_child_process(smollm2, tmp_path):
    """The quick probe runs apart: the memory its probe models took must not count in the
    runtime a --memory-limit plan measures (in-process it took ~90 MB of a 300 MB limit)."""
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "mlx_flash", "generate", "--model", str(smollm2), "--prompt", "Hi",
           "--max-tokens", "2", "--memory-limit", "400MB"]
    first = subprocess.run(cmd + ["--explain"], capture_output=True, text=True, timeout=600, env=_env(home))
    assert first.returncode == 0, first.stderr
    assert "quick probe now, in a child process" in first.stderr
    _check_quick_profile(load_profile(home / "profile.json"))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(home))  # (cached now)
    runtime = [int(re.search(r"runtime (\d+) MB \(measured\)", r.stderr).group(1)) for r in (first, again)]
    assert runtime[0] <= runtime[1] + 10, runtime


def test_stats_predict_again_at_the_disk_rate_the_decode_got(smollm2, tmp_path, monkeypatch):
    """Runtime.stats(disk_gbs): the prediction at the rate the device delivered during the decode
    (generate --stats: io/device.py's counters), the profile's curve scaled: only the I/O moves."""
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path))
    save_profile(_profile(compute=_rates(float32=10.0, q4=20.0, float16=5.0, bfloat16=5.0, q8=20.0)))
    model, _ = mlx_flash.load(smollm2, mode="naive", memory_budget="60MB", progress=False)
    try:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
        plain = model.runtime.stats()["summary"]
        assert "predicted_at_run_disk" not in plain
        read_size = model.runtime.work().read_size
        got = model.runtime.stats(disk_gbs=_profile().disk_gbs(read_size) / 4)["summary"]
        at, p = got["predicted_at_run_disk"], got["predicted"]
        assert p["io_ms"] > 0 and at["io_ms"] == pytest.approx(4 * p["io_ms"])
        assert at["compute_ms"] == pytest.approx(p["compute_ms"])
        assert at["profile_disk_gbs"] == pytest.approx(4 * at["disk_gbs"])
    finally:
        model.runtime.close()

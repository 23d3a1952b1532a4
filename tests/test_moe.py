"""Mixture-of-experts models (issue 12): expert bundles on flash, an expert buffer sized by the
budget, parity with mlx_lm's own implementation of each family on the same weights."""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm import convert as mlx_lm_convert
from mlx_lm.utils import load_model

import mlx_flash
from mlx_flash.cache.eviction import EdgeMoE, simulate_hits
from mlx_flash.cache.expert_cache import ExpertCache
from mlx_flash.convert import convert
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.errors import BudgetTooSmall, FlashError
from mlx_flash.layout.format import read_manifest
from mlx_flash.layout.verify import verify_folder
from helpers import make_llama_folder, make_moe_folder
from test_parity import TOKENS, greedy

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def _budget(folder, slots):
    """A --memory-budget (bytes) that leaves the expert buffer `slots` slots."""
    model, _ = mlx_flash.load(folder)
    rt = model.runtime
    budget = rt.resident_bytes + slots * rt.store.slot_bytes
    rt.close()
    return str(budget)


def _check(out, ref, tol=1e-4):
    x = mx.array([TOKENS])
    want = ref(x)
    top_k = ref.args.num_experts_per_tok
    for options in (dict(), dict(memory_budget=_budget(out, top_k)), dict(memory_budget=_budget(out, 2 * top_k + 1))):
        model, _ = mlx_flash.load(out, **options)
        diff = mx.abs(model(x) - want).max().item()
        assert diff <= tol, f"{options}: max |logit diff| {diff}"
        assert greedy(model, TOKENS) == greedy(ref, TOKENS), options
        s = model.runtime.stats()["summary"]
        if options:
            assert model.runtime.mode == "experts" and s["expert_slots"] < s["experts_total"]
            assert s["experts_read"] > 0 and 0 <= s["hit_rate"] < 1
        else:
            assert model.runtime.mode == "dense" and s["experts_read"] == 0 and s["hit_rate"] == 1
        model.runtime.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_float_experts_match_mlx_lm(tmp_path, family):
    src, cfg, _ = make_moe_folder(tmp_path / "hf", family)
    out = convert(src, tmp_path / "flash", progress=False, dtype="float32")
    m = read_manifest(out)
    assert m.version == 3 and m.ffn_files == [] and m.experts["layout"].quant is None
    n_moe = sum(e is not None for e in m.experts["files"])
    assert n_moe == (cfg["num_hidden_layers"] - len(cfg.get("mlp_only_layers", [])))
    ref, _ = load_model(src)
    ref.set_dtype(mx.float32)
    _check(out, ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_experts_are_kept_and_match_mlx_lm(tmp_path, family, bits):
    src, _, _ = make_moe_folder(tmp_path / "hf", family)
    q = tmp_path / f"mlx-q{bits}"
    mlx_lm_convert(str(src), str(q), quantize=True, q_bits=bits, q_group_size=32, dtype="float16")
    out = convert(q, tmp_path / "flash", progress=False)
    lay = read_manifest(out).experts["layout"]
    assert (lay.quant.bits, lay.quant.group_size) == (bits, 32)
    ref, _ = load_model(q)
    ref.set_dtype(mx.float32)
    _check(out, ref)
    model, _ = mlx_flash.load(out, memory_budget=_budget(out, 6))
    assert model.runtime.store.host is not None  # one position's experts went through the native kernels
    model.runtime.close()


def test_quantize_float_experts_gives_mlx_lm_convert_values(tmp_path):
    """`convert -q` of a float MoE model stores the experts mlx_lm.convert -q makes, bit for bit."""
    src, _, _ = make_moe_folder(tmp_path / "hf", "qwen3_moe")
    q = tmp_path / "mlx-q4"
    mlx_lm_convert(str(src), str(q), quantize=True, q_bits=4, q_group_size=64, dtype="float16")
    ours = convert(src, tmp_path / "ours", progress=False, quant=QuantOptions(quantize=True, bits=4, group_size=64))
    theirs = convert(q, tmp_path / "theirs", progress=False)
    for a, b in zip(read_manifest(ours).experts["files"], read_manifest(theirs).experts["files"]):
        assert (a is None and b is None) or a["sha256"] == b["sha256"]


def test_a_flipped_byte_in_an_expert_is_found_on_the_token_that_reads_it(tmp_path):
    src, _, _ = make_moe_folder(tmp_path / "hf", "mixtral")
    out = convert(src, tmp_path / "flash", progress=False)
    lay = read_manifest(out).experts["layout"]
    path = out / "experts" / "layer_001.bin"
    data = bytearray(path.read_bytes())
    expert, offset = 2, lay.array_offset("up", "weight") + 10
    data[expert * lay.stride + offset] ^= 0x40
    path.write_bytes(bytes(data))
    damage = verify_folder(out)
    assert len(damage) == 1 and "bundle 2 (up" in str(damage[0])
    for options in (dict(mode="dense", verify=False), dict(memory_budget=_budget_unchecked(out), verify=False)):
        with pytest.raises(FlashError, match=r"layer 1, expert 2 \(up\)"):
            model, _ = mlx_flash.load(out, **options)
            for t in range(lay.n_experts * 4):  # until a token routes to it
                model(mx.array([[t % 200, (7 * t) % 200, (13 * t + 5) % 200]]))


def _budget_unchecked(folder):
    lay = read_manifest(folder).experts["layout"]
    resident = (folder / "resident.safetensors").stat().st_size * 2  # float16 on disk, float32 in DRAM
    return str(resident + 3 * lay.bundle_bytes * 2)


def test_what_a_moe_model_cannot_do_is_said(tmp_path):
    src, cfg, _ = make_moe_folder(tmp_path / "hf", "mixtral")
    out = convert(src, tmp_path / "flash", progress=False)
    with pytest.raises(BudgetTooSmall, match="one token's 2 experts of a layer .* need at least"):
        mlx_flash.load(out, memory_budget="1000")
    for options, match in ((dict(mode="naive"), "neuron modes do not apply"),
                           (dict(mode="flash", sparsity="oracle", density=0.5), "neuron modes do not apply"),
                           (dict(kv_cache="flash"), "keeps one sequence's KV cache in DRAM"),
                           (dict(mode="dense", memory_budget="50%"), "--memory-budget does not apply"),
                           (dict(mode="dense", memory_limit="8GB"), "--memory-limit does not apply")):
        with pytest.raises(FlashError, match=match):
            mlx_flash.load(out, **options)
    with pytest.raises(FlashError, match="--dip"):
        convert(src, tmp_path / "dip", progress=False, dip=True)
    dense, _, _ = make_llama_folder(tmp_path / "llama")
    with pytest.raises(FlashError, match="has no experts"):
        mlx_flash.load(convert(dense, tmp_path / "llama-flash", progress=False), expert_eviction="lru")
    other = tmp_path / "deepseek"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(cfg, model_type="deepseek_v3")))
    (src / "model.safetensors").rename(other / "model.safetensors")
    with pytest.raises(FlashError, match="unsupported model type 'deepseek_v3'"):
        convert(other, tmp_path / "ds", progress=False)


def test_edgemoe_evicts_rarely_used_experts_of_far_layers_first():
    n_layers, n_experts = 4, 4
    policy = EdgeMoE(n_layers * n_experts, n_experts, n_layers)
    ids = lambda layer, e: layer * n_experts + e  # noqa: E731
    policy.touch(np.array([ids(1, 0), ids(3, 0)]), 0)  # as often, as recently: layer 1 runs sooner
    policy.touch(np.array([ids(1, 0), ids(3, 0)]), 1)
    policy.touch(np.array([ids(2, 1)]), 2)  # used once
    cached = np.array([ids(1, 0), ids(3, 0), ids(2, 1)])
    # serving layer 0: layer 1 is next (distance 1), layer 2 at 2, layer 3 at 3
    assert policy.victims(cached, 1, np.array([ids(0, 3)]), 3).tolist() == [ids(2, 1)]  # 1/2 < 2/3 < 2/1
    assert policy.victims(cached, 2, np.array([ids(0, 3)]), 3).tolist() == [ids(2, 1), ids(3, 0)]
    # serving layer 2: layer 3 is next (2/1), layer 1 farthest (2/3)
    assert policy.victims(cached[:2], 1, np.array([ids(2, 3)]), 3).tolist() == [ids(1, 0)]


def test_expert_cache_places_every_wanted_expert_and_never_evicts_one_of_the_same_call():
    rng = np.random.default_rng(0)
    for policy in ("lru", "lfu", "edgemoe"):
        cache = ExpertCache(5, 8, 3, policy)
        for step in range(200):
            layer = step % 3
            ids = cache.ids(layer, np.unique(rng.integers(0, 8, size=3)))
            slots, missing, into = cache.place(ids)
            assert (slots >= 0).all() and len(set(slots.tolist())) == len(slots)
            assert (cache.id_in[slots] == ids).all()
            assert np.isin(missing, ids).all() and len(into) == len(missing)
        trace = [cache.ids(s % 3, np.unique(rng.integers(0, 8, size=3))) for s in range(300)]
        hits = simulate_hits(EdgeMoE(24, 8, 3) if policy == "edgemoe" else cache.policy.__class__(24), trace, 5)
        assert 0 <= hits <= 1


def test_the_router_look_ahead_reads_ahead_and_changes_nothing(tmp_path):
    """The next layer's router on this layer's residual names experts read in the background, right
    far more often than chance; the logits and tokens are the same (a wrong guess costs reads, never
    correctness)."""
    src, _, _ = make_moe_folder(tmp_path / "hf", "qwen3_moe", num_hidden_layers=4, num_experts=12, mlp_only_layers=[])
    out = convert(src, tmp_path / "flash", progress=False, dtype="float32")
    budget = _budget(out, 9)
    runs = {}
    for prefetch in (True, False):
        model, _ = mlx_flash.load(out, memory_budget=budget, prefetch=prefetch)
        logits = model(mx.array([TOKENS]))
        tokens = greedy(model, TOKENS, 24)
        runs[prefetch] = (logits, tokens, model.runtime.stats()["summary"])
        model.runtime.close()
    (a, ta, sa), (b, tb, sb) = runs[True], runs[False]
    assert mx.array_equal(a, b) and ta == tb
    assert "prefetch" not in sb
    p = sa["prefetch"]
    assert p["predicted"] > 0 and 0 <= p["predicted_used"] <= p["predicted"] and p["read_s"] >= p["waited_s"] >= 0
    chance = 3 / 12  # top-3 of 12 experts
    assert p["predicted_used"] / p["predicted"] > 1.5 * chance, p


def test_a_late_read_ahead_is_cancelled_and_changes_nothing(tmp_path, monkeypatch):
    """Reads slowed down (a fault injected: 30 ms a batch of one expert) so that each layer comes
    while its read-ahead is still going: the batches not begun are cancelled, their experts leave
    the buffer, and the logits and tokens are those of a run without the look-ahead."""
    from mlx_flash.runtime.stores import experts as store_module

    src, _, _ = make_moe_folder(tmp_path / "hf", "qwen3_moe", num_hidden_layers=4, num_experts=12, mlp_only_layers=[])
    out = convert(src, tmp_path / "flash", progress=False, dtype="float32")
    budget = _budget(out, 9)
    model, _ = mlx_flash.load(out, memory_budget=budget, prefetch=False)
    want_logits, want_tokens = model(mx.array([TOKENS])), greedy(model, TOKENS, 12)
    model.runtime.close()

    monkeypatch.setattr(store_module, "READ_AHEAD_BATCH", 1)
    model, _ = mlx_flash.load(out, memory_budget=budget, prefetch=True)
    store = model.runtime.store
    read = store._read_into

    def slow_read(layer, missing, into):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.03)
        read(layer, missing, into)

    store._read_into = slow_read
    for ffn in [layer.mlp.experts for layer in model.layers]:  # guess every expert: more than one batch
        if ffn.lookahead is not None:
            ffn.lookahead = (ffn.lookahead[0], lambda residual, inds: mx.arange(12)[None])
    logits, tokens = model(mx.array([TOKENS])), greedy(model, TOKENS, 12)
    summary = model.runtime.stats()["summary"]["prefetch"]
    model.runtime.close()
    assert mx.array_equal(logits, want_logits) and tokens == want_tokens
    assert summary["cancelled"] > 0 and summary["predicted"] > 0, summary
    cache = store.cache
    held = np.flatnonzero(cache.id_in >= 0)
    assert np.array_equal(cache.slot_of[cache.id_in[held]], held)  # each held id points to its slot
    assert np.array_equal(np.sort(np.flatnonzero(cache.slot_of >= 0)), np.sort(cache.id_in[held]))


def _quantized_moe(tmp_path):
    src, _, _ = make_moe_folder(tmp_path / "hf", "qwen3_moe", num_hidden_layers=4, num_experts=12, mlp_only_layers=[])
    return convert(src, tmp_path / "flash", progress=False, quant=QuantOptions(quantize=True, bits=4, group_size=64))


def _slowed(store, seconds):
    """The store's reads on its worker slowed by `seconds` each (a fault injected: the disk made slow)."""
    read = store._read_into

    def slow_read(layer, missing, into):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        read(layer, missing, into)

    store._read_into = slow_read


def test_missing_experts_read_while_the_cached_ones_compute_change_nothing(tmp_path, monkeypatch):
    """One position on the CPU: a layer's missing experts are read on the worker while the native kernels
    compute its cached ones, then computed. Logits and tokens are those of the layer waiting for every
    read (bit for bit: the same sums); the reads are counted once, and with reads and compute slowed
    alike (faults injected), part of the read time is hidden (none without the overlap)."""
    from mlx_flash.models import moe as moe_module

    compute = moe_module._one_position

    def slow_compute(*args, **kwargs):
        time.sleep(0.01)
        return compute(*args, **kwargs)

    monkeypatch.setattr(moe_module, "_one_position", slow_compute)
    out = _quantized_moe(tmp_path)
    budget = _budget(out, 9)
    runs = {}
    for overlap in (False, True):
        model, _ = mlx_flash.load(out, memory_budget=budget, prefetch=False, overlap=overlap)
        store = model.runtime.store
        assert store.overlap is overlap and store.host is not None
        logits = model(mx.array([TOKENS]))
        _slowed(store, 0.01)
        tokens = greedy(model, TOKENS, 16)
        runs[overlap] = (logits, tokens, model.runtime.stats()["summary"])
        model.runtime.close()
    (a, ta, sa), (b, tb, sb) = runs[False], runs[True]
    assert mx.array_equal(a, b) and ta == tb
    assert sa["experts_read"] == sb["experts_read"] > 0 and sa["bytes_read"] == sb["bytes_read"]
    assert sa["hidden_share"] == 0.0 and sa["io_s"] == sa["read_s"]
    assert sb["read_s"] > 0 and 0 < sb["hidden_share"] <= 1, sb


def test_the_look_ahead_and_the_overlap_together_change_nothing(tmp_path, monkeypatch):
    """The runtime's default on the CPU: the look-ahead guessing every expert (one at a time, reads
    slowed: most guesses are cancelled) queued behind each layer's own missing experts read while its
    cached ones compute. Logits and tokens are those of a run with neither; the buffer's books hold
    (each held expert points to its slot and back)."""
    from mlx_flash.runtime.stores import experts as store_module

    out = _quantized_moe(tmp_path)
    budget = _budget(out, 9)
    model, _ = mlx_flash.load(out, memory_budget=budget, prefetch=False, overlap=False)
    want_logits, want_tokens = model(mx.array([TOKENS])), greedy(model, TOKENS, 12)
    model.runtime.close()

    monkeypatch.setattr(store_module, "READ_AHEAD_BATCH", 1)
    model, _ = mlx_flash.load(out, memory_budget=budget)
    store = model.runtime.store
    assert store.prefetch and store.overlap
    _slowed(store, 0.01)
    for ffn in [layer.mlp.experts for layer in model.layers]:
        if ffn.lookahead is not None:
            ffn.lookahead = (ffn.lookahead[0], lambda residual, inds: mx.arange(12)[None])
    logits, tokens = model(mx.array([TOKENS])), greedy(model, TOKENS, 12)
    summary = model.runtime.stats()["summary"]
    model.runtime.close()
    assert mx.array_equal(logits, want_logits) and tokens == want_tokens
    assert summary["prefetch"]["predicted"] > 0 and summary["read_s"] > 0, summary
    cache = store.cache
    held = np.flatnonzero(cache.id_in >= 0)
    assert np.array_equal(cache.slot_of[cache.id_in[held]], held)
    assert np.array_equal(np.sort(np.flatnonzero(cache.slot_of >= 0)), np.sort(cache.id_in[held]))


def test_a_wait_interrupted_by_the_waiting_thread_still_waits_for_the_worker(monkeypatch):
    """Whatever interrupts the thread waiting for a worker's read (a signal handler's exception,
    Ctrl-C), the wait goes on until the worker returns (it writes into the slots until then), and the
    interruption is handed back to be raised once the books are settled."""
    from concurrent.futures import ThreadPoolExecutor

    from mlx_flash.runtime.stores import experts as store_module

    real_wait, calls = store_module.futures_wait, []

    def interrupted_once(fs):
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("a signal handler's")
        return real_wait(fs)

    monkeypatch.setattr(store_module, "futures_wait", interrupted_once)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: (time.sleep(0.2), "read")[1])
        result, interrupted = store_module._result(fut)
    assert fut.done() and result == "read" and isinstance(interrupted, TimeoutError) and len(calls) == 2


def test_a_missing_expert_that_fails_to_read_on_the_worker_is_said_and_forgotten(tmp_path):
    """The worker's read of a layer's own missing experts fails (EIO injected): the error names the file
    and reaches the caller from the layer that waits for it; the experts it was reading leave the
    buffer, and the next token reads them again and matches a run that never failed."""
    from mlx_flash.io import ReadError

    out = _quantized_moe(tmp_path)
    budget = _budget(out, 9)
    model, _ = mlx_flash.load(out, memory_budget=budget, prefetch=False, overlap=False)
    want = greedy(model, TOKENS, 6)
    model.runtime.close()

    model, _ = mlx_flash.load(out, memory_budget=budget, prefetch=False, overlap=True)
    store = model.runtime.store
    read = store._read_into
    failed = []

    def failing_read(layer, missing, into):
        if not failed and threading.current_thread() is not threading.main_thread():
            failed.append(missing.copy())
            raise ReadError(store.groups[layer][0].file.path, 0, "Input/output error (injected)")
        read(layer, missing, into)

    store._read_into = failing_read
    model(mx.array([TOKENS]))  # a prompt: read in the layer, not on the worker
    with pytest.raises(ReadError, match="injected"):
        greedy(model, TOKENS, 6)
    assert failed and (store.cache.slot_of[failed[0]] < 0).all()  # forgotten, not held half-read
    assert greedy(model, TOKENS, 6) == want
    model.runtime.close()


def test_a_reservation_given_back_restores_the_slots_previous_experts():
    cache = ExpertCache(4, 8, 2, "lru")
    cache.place(cache.ids(0, [0, 1, 2]))
    cache.place(cache.ids(1, [3]))  # full
    before = (cache.slot_of.copy(), cache.id_in.copy())
    missing, into, previous = cache.reserve(cache.ids(1, [5, 6]), protect=cache.ids(1, [3]))
    assert set(previous.tolist()) <= set(cache.ids(0, [0, 1, 2]).tolist()) and (cache.id_in[into] == missing).all()
    cache.give_back(missing[1:], into[1:], previous[1:])  # the first was read, the second cancelled
    assert cache.slot_of[missing[0]] == into[0] and cache.slot_of[missing[1]] == -1
    assert cache.slot_of[previous[1]] == into[1] and cache.id_in[into[1]] == previous[1]
    cache.give_back(missing[:1], into[:1], previous[:1])
    assert np.array_equal(cache.slot_of, before[0]) and np.array_equal(cache.id_in, before[1])


def test_benchmark_moe_writes_its_rows_and_the_replayed_hit_rates(tmp_path):
    from mlx_flash.bench.moe import ROWS, run_moe_bench

    res = run_moe_bench("tiny-moe", budgets=("50%",), tokens=6, rounds=1, warmup=1, out=tmp_path / "out",
                        progress=False, home=tmp_path / "home")
    assert [e["row"] for e in res["rows"]] == list(ROWS)
    rows = {e["row"]: e for e in res["rows"]}
    assert rows["naive"]["slots"] == res["top_k"] and rows["lru"]["slots"] > res["top_k"]
    assert rows["naive"]["hit_rate"] == 0 and rows["naive"]["read_mb_per_token"] > 0
    assert rows["edgemoe+lookahead"]["predicted"] > 0 and rows["edgemoe"]["predicted"] == 0
    sim = res["simulated_hit_rates"]["50%"]
    assert sim["belady"] >= max(sim["lru"], sim["lfu"], sim["edgemoe"]) - 1e-9
    text = (tmp_path / "out" / "moe-tiny-moe-q4-trace.md").read_text()
    assert "| 50% | edgemoe+lookahead |" in text and "Belady" in text


@pytest.mark.slow  # (over 10 s here: `make test-slow` runs it)
def test_a_wider_look_ahead_guesses_more(tmp_path):
    from mlx_flash.bench.moe import run_moe_bench

    def predicted(width):
        res = run_moe_bench("tiny-moe", budgets=("50%",), tokens=4, rounds=1, warmup=1, out=tmp_path / f"w{width}",
                            rows=("edgemoe+lookahead",), progress=False, home=tmp_path / "home",
                            lookahead_width=width)
        assert res["lookahead_width"] == (width or res["top_k"])
        return res["rows"][0]["predicted"], res["top_k"]

    narrow, k = predicted(None)
    wide, _ = predicted(3 * k)
    assert wide > narrow
    assert f"guesses {3 * k} experts a layer" in (tmp_path / f"w{3 * k}" / "moe-tiny-moe-q4-trace.md").read_text()
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "benchmark", "moe", "--routing", "model",
                        "--lookahead-width", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--lookahead-width: a positive number, with --routing trace" in r.stderr


def test_generate_under_a_cgroup_of_the_limit(tmp_path):
    """A mixture of experts larger than its --memory-limit decodes inside a memory cgroup of that size:
    no OOM kill, the peak RSS under the limit, the expert buffer holding part of the experts; a limit
    too small is a clear error naming the limit that would do."""
    import re
    import subprocess
    import sys

    from mlx_flash.convert.random_model import build_checkpoint
    from test_memory_limit import MB, _cgroup_runner

    folder = build_checkpoint("small-moe", "q4", home=tmp_path, progress=False)
    experts = sum(p.stat().st_size for p in (folder / "experts").glob("*.bin"))
    assert experts > 200 * MB
    for limit_mb, ok in ((300, True), (120, False)):
        cmd = [sys.executable, "-m", "mlx_flash", "generate", "--model", str(folder), "--memory-limit",
               f"{limit_mb}MB", "--prompt", "the sea", "--max-tokens", "12", "--stats"]
        log = tmp_path / f"out-{limit_mb}.txt"
        with _cgroup_runner() as runner, open(log, "w") as out:
            r = runner.run(cmd, limit_bytes=limit_mb * MB, timeout=600, stdout=out, stderr=subprocess.STDOUT)
        text = log.read_text()
        assert not r.oom_killed, (r, text[-2000:])
        if not ok:
            assert r.returncode == 2 and "raise --memory-limit to at least" in text, text[-2000:]
            continue
        assert r.returncode == 0 and r.peak_bytes <= limit_mb * MB, (r, text[-2000:])
        slots = re.search(r"Experts: (\d+) slots for (\d+) experts", text)
        assert slots and 4 <= int(slots.group(1)) < int(slots.group(2)), text[-2000:]


@pytest.mark.slow  # (over 10 s here: `make test-slow` runs it)
def test_a_qwen3moe_gguf_keeps_its_q4_1_experts_bit_exact(tmp_path, smollm2_gguf):
    """llama.cpp's merged *_exps tensors -> expert bundles holding the file's values, bit for bit."""
    import sys
    from pathlib import Path

    import gguf

    from mlx_flash.layout.quant import QuantSpec, dequantize

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from random_moe_gguf import SHAPE, write_random_moe_gguf

    shape = dict(SHAPE, d_model=64, n_layers=2, n_heads=4, n_kv=2, head_dim=32, n_ff=128, expert_ff=64,
                 experts=8, top_k=2)
    path = write_random_moe_gguf(tmp_path / "m.gguf", shape, smollm2_gguf, progress=False)
    out = convert(path, tmp_path / "flash", progress=False)
    m = read_manifest(out)
    lay = m.experts["layout"]
    assert m.model_type == "qwen3_moe" and lay.quant == QuantSpec(4, 32, "float16") and lay.n_experts == 8
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    raw = np.frombuffer((out / "experts" / "layer_001.bin").read_bytes(), dtype=np.uint8)
    for kind, name in (("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
        t = tensors[f"blk.1.{name}.weight"]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(8, *lay.shape(kind))
        for e in (0, 5):
            part = {}
            for arr, shp, dt in lay.arrays(kind):
                off = e * lay.stride + lay.array_offset(kind, arr)
                part[arr] = raw[off : off + lay.array_bytes(kind, arr)].view(np.uint32 if dt == "uint32" else np.float16)
            got = dequantize(part["weight"].reshape(shp[0], -1), part["scales"].reshape(shp[0], -1),
                             part["biases"].reshape(shp[0], -1), 4, 32, lay.shape(kind)[1])
            assert np.array_equal(got, want[e]), (kind, e)
    model, tok = mlx_flash.load(out, memory_budget=_budget(out, 4))
    text = mlx_flash.generate(model, tok, "The sea", max_tokens=4)
    assert isinstance(text, str) and model.runtime.stats()["summary"]["experts_read"] > 0


def test_the_routing_trace_is_skewed_correlated_and_repeatable_and_the_path_predictor_learns_it():
    from mlx_flash.bench.moe import RoutingTrace
    from mlx_flash.sparsity.expert_paths import ExpertPathPredictor

    a, b = RoutingTrace(6, 32, 4, seed=3).paths(300), RoutingTrace(6, 32, 4, seed=3).paths(300)
    assert all(np.array_equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))
    assert all(len(set(e.tolist())) == 4 for path in a for e in path)
    counts = np.bincount(np.concatenate([path[2] for path in a]), minlength=32)
    assert counts.max() > 2 * counts.mean() and counts.max() > 5 * counts.min()  # skewed
    repeat = np.mean([len(set(a[t][1]) & set(a[t - 1][1])) / 4 for t in range(1, 300)])
    assert repeat > 2 * 4 / 32  # consecutive tokens share experts more than chance
    predictor = ExpertPathPredictor(6, 32).fit(RoutingTrace(6, 32, 4, seed=3, tokens=1).paths(500))
    hits = np.mean([len(set(predictor.predict(2, path[2], 4)) & set(path[3])) / 4 for path in a])
    assert hits > 2 * 4 / 32, hits


def test_a_random_mlx_lm_folder_is_one_mlx_lm_loads_and_converts_to_the_benchmark_checkpoint(tmp_path):
    """benchmarks/moe-beyond-ram/moe_beyond_ram.py's input (a random model as mlx-lm folders hold one:
    stacked, quantized experts in shards): mlx_lm loads it, and its conversion is build_checkpoint's,
    file for file."""
    import hashlib

    from mlx_flash.convert.random_model import build_checkpoint, write_mlx_lm_folder

    src = write_mlx_lm_folder("tiny-moe", tmp_path / "src", shard_bytes=1 << 20, progress=False)
    assert len(list(src.glob("model-*.safetensors"))) > 1 and not (tmp_path / "src.partial").exists()
    ref_model, _ = load_model(src)
    out = convert(str(src), tmp_path / "flash", progress=False)
    ref = build_checkpoint("tiny-moe", "q4", home=tmp_path, progress=False)
    files = [f.relative_to(ref) for f in ref.rglob("*") if f.is_file() and f.name != "manifest.json"]
    assert len(files) > 8
    for f in files:
        assert hashlib.sha256((ref / f).read_bytes()).digest() == hashlib.sha256((out / f).read_bytes()).digest(), f
    model, _ = mlx_flash.load(out, dtype="float16")
    x = mx.array([TOKENS[:12]])
    assert mx.allclose(model(x), ref_model(x), atol=2e-2).item()


def test_experts_at_their_own_bits_are_read_narrow_and_compute_as_their_values(tmp_path):
    """--expert-bits: each expert stored at 2, 4 or 8 bits (a file per width), widened exactly into the
    expert buffer; the logits are those of the model whose experts hold exactly those values."""
    import shutil

    from mlx_flash.layout.quant import quantize
    from mlx_flash.models.moe import ModelArgs, expert_tensors
    from helpers import write_safetensors

    src, cfg, tensors = make_moe_folder(tmp_path / "hf", "qwen3_moe")
    args = ModelArgs.from_dict(cfg)
    bits = ((2, 8, 4, 2, 8, 4), None, (4, 4, 4, 4, 4, 4))  # layer 1 is dense; layer 2 one width below the widest
    fake = dict(tensors)  # the experts' values at their bits, as floats: the reference
    for layer, layer_bits in enumerate(bits):
        for kind, (_, names) in (expert_tensors(args, layer) or {}).items():
            for e, name in enumerate(names):
                fake[name] = quantize(tensors[name], layer_bits[e], 64, "float32").dequantized()
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, ref_dir / f.name)
    write_safetensors(ref_dir / "model.safetensors", fake)
    out = convert(src, tmp_path / "flash", progress=False, dtype="float32",
                  quant=QuantOptions(expert_bits=bits))
    m = read_manifest(out)
    assert m.experts["layout"].quant.bits == 8
    assert [g["bits"] for g in m.experts["files"][0]["groups"]] == [2, 4, 8]
    assert [g["bits"] for g in m.experts["files"][2]["groups"]] == [4]
    assert sorted(p.name for p in (out / "experts").glob("*.bin")) == [
        "layer_000.b2.bin", "layer_000.b4.bin", "layer_000.b8.bin", "layer_002.b4.bin"]
    assert verify_folder(out) == []
    ref, _ = load_model(ref_dir)
    ref.set_dtype(mx.float32)
    _check(out, ref)
    model, _ = mlx_flash.load(out, memory_budget=_budget(out, 3))
    model(mx.array([TOKENS]))
    s = model.runtime.stats()["summary"]  # bytes as stored: narrower experts read fewer
    assert 0 < s["bytes_read"] < s["experts_read"] * model.runtime.store.layout.bundle_bytes
    model.runtime.close()
    with pytest.raises(FlashError, match="layer 1: the layer has no experts"):
        convert(src, tmp_path / "bad", progress=False, quant=QuantOptions(expert_bits=(bits[0], bits[0], bits[2])))
    with pytest.raises(FlashError, match="at 3 bits"):
        QuantOptions(expert_bits=((3,) * 6, None, (4,) * 6))


@pytest.mark.slow  # (about 40 s: 13 evaluations of SmolLM2 and three conversions)
def test_expert_bits_auto_chooses_within_the_tolerance_and_the_folder_holds_its_choice(tmp_path, smollm2_gguf):
    """convert --expert-bits auto on real weights (SmolLM2 as 4 experts a layer, all routed:
    bench/dense_as_moe.py): every expert at 4-bit is past 5 %, so some experts stay at 8 bits and the
    least important go to 4; the calibration perplexity stays within the tolerance; the folder holds the
    choice; the float reference is gone."""
    from mlx_flash.bench.dense_as_moe import write_dense_as_moe
    from mlx_flash.convert.expert_bits import auto_expert_bits
    from mlx_flash.layout.experts import expert_bits
    from mlx_flash.sparsity.calibrate import DATA

    if not (DATA / "c4").is_dir():
        pytest.skip(f"no C4 calibration text at {DATA} (../shared beside the checkout)")
    src = write_dense_as_moe(smollm2_gguf, tmp_path / "hf", n_experts=4)
    out = tmp_path / "flash"
    with pytest.raises(FlashError, match="expert size 384 must be multiples of the quantization group size 128"):
        auto_expert_bits(src, out, QuantOptions(group_size=128), 0.05, tokens=128, progress=False)
    choice, options = auto_expert_bits(src, out, QuantOptions(), 0.05, tokens=128, progress=False)
    assert choice.uniform_ppl[4] > choice.reference_ppl * 1.05 >= choice.uniform_ppl[8]
    assert (choice.high, choice.low) == (8, 4) and 0 < choice.k < 120
    assert choice.ppl <= choice.reference_ppl * 1.05 and choice.evaluations <= 4 + 1 + 7
    convert(src, out, progress=False, quant=options)
    assert [tuple(b) for b in expert_bits(read_manifest(out).experts)] == list(choice.bits)
    assert sum(b == 4 for layer in choice.bits for b in layer) == choice.k
    assert not any(p.name.endswith("expert-bits-reference") for p in tmp_path.iterdir())
    model, _ = mlx_flash.load(out)
    assert model(mx.array([TOKENS])).shape[-1] > 0
    model.runtime.close()


def test_expert_bits_auto_on_a_random_model_runs_its_steps_and_says_what_it_cannot(tmp_path):
    """The search's steps on a tiny random model (its perplexity ignores quantization: every expert goes
    to the narrowest width within the tolerance, 2 bits); a group size the experts do not divide is
    refused before anything is searched."""
    from mlx_flash.convert.expert_bits import auto_expert_bits

    src, _, _ = make_moe_folder(tmp_path / "hf", "mixtral")
    text = _calibration_text(tmp_path)
    with pytest.raises(FlashError, match="expert size 96 must be multiples of the quantization group size 64"):
        auto_expert_bits(src, tmp_path / "flash", QuantOptions(), 0.05, data=text, tokens=128, progress=False)
    choice, options = auto_expert_bits(src, tmp_path / "flash", QuantOptions(group_size=32), 0.05, data=text,
                                       tokens=128, progress=False)
    assert choice.ppl <= choice.reference_ppl * 1.05 and set(choice.uniform_ppl) == {2, 4, 8}
    assert options.expert_bits == choice.bits and all(b == choice.high for layer in choice.bits for b in layer)
    assert not any(p.name.endswith("expert-bits-reference") for p in tmp_path.iterdir())


def test_calibrated_expert_paths_guess_ahead_and_change_nothing(tmp_path):
    """mlx_flash.calibrate on a mixture of experts records its expert paths (EdgeMoE §3.3.2) into the
    folder; --expert-predictor paths reads ahead by them: the logits are unchanged, the look-ahead counted;
    without a calibration, or on a dense model, the option is a clear error."""
    from mlx_flash.convert.random_model import build_checkpoint
    from mlx_flash.cli.calibrate import main as calibrate_main

    folder = build_checkpoint("tiny-moe", "q4", home=tmp_path, progress=False)
    x = mx.array([TOKENS])
    with pytest.raises(FlashError, match="run mlx_flash.calibrate"):
        mlx_flash.load(folder, memory_budget="50%", expert_predictor="paths")
    calibrate_main(["--model", str(folder), "--data", _calibration_text(tmp_path), "--tokens", "512", "--seq-len",
                    "128", "--quiet"])
    entry = read_manifest(folder).calibration["expert_paths"]
    assert entry["layers"] == [0, 1, 2, 3] and entry["tokens"] >= 512 and 0 <= entry["precision"] <= 1
    assert verify_folder(folder) == []
    want = mlx_flash.load(folder)[0](x)
    model, _ = mlx_flash.load(folder, memory_budget="30%", expert_predictor="paths")
    for _ in range(3):
        assert mx.abs(model(x) - want).max().item() <= 1e-5
    assert model.runtime.stats()["summary"]["prefetch"]["predicted"] > 0
    model.runtime.close()
    with pytest.raises(FlashError, match="has no experts"):
        mlx_flash.load(make_llama_folder(tmp_path / "dense")[0], expert_predictor="paths")


@pytest.mark.slow  # (over 10 s here: `make test-slow` runs it)
def test_k_quant_gguf_experts_keep_their_values(tmp_path, smollm2_gguf, capsys):
    """A GGUF whose merged experts are Q4_K keeps them at 4 bits, group 32: a Q4_K sub-block is an
    MLX affine group (convert/kquants.py), its values kept, its scale and bias rounded to float16."""
    import sys
    from pathlib import Path

    import gguf

    from mlx_flash.layout.quant import QuantSpec

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from random_moe_gguf import SHAPE, write_random_moe_gguf

    shape = dict(SHAPE, d_model=256, n_layers=1, n_heads=4, n_kv=2, head_dim=64, n_ff=256, expert_ff=256,
                 experts=4, top_k=2)
    path = write_random_moe_gguf(tmp_path / "m.gguf", shape, smollm2_gguf, progress=False, expert_type="q4_k")
    out = convert(path, tmp_path / "flash", progress=False)
    assert "re-quantized" not in capsys.readouterr().err
    lay = read_manifest(out).experts["layout"]
    assert lay.quant == QuantSpec(4, 32, "float16")
    model, _ = mlx_flash.load(out)
    want = gguf.quants.dequantize(*(lambda t: (t.data, t.tensor_type))(
        {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.0.ffn_up_exps.weight"]))
    store = model.runtime.store
    slot = int(store.cache.slot_of[2])
    w, s, b = (np.array(a[slot]) for a in store.weights["up"])
    got = np.array(mx.dequantize(mx.array(w), mx.array(s), mx.array(b), 32, 4))
    want = want.reshape(4, 256, 256)[2]
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()  # (float16 scales and biases only)
    model.runtime.close()


def _calibration_text(folder):
    """A calibration text of its own (../shared/data is not beside every checkout)."""
    words = "the quick brown fox jumps over the lazy dog hello world paris is the capital".split()
    path = folder / "cal.txt"
    path.write_text(" ".join(np.random.default_rng(0).choice(words, 3000)))
    return str(path)

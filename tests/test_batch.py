"""Batch decode (FlexGen §4.2's block schedule, issue 13 item 6): many prompts decoded together
through the flash runtime give each prompt the tokens it gets alone, and the CLI's batch file
and the benchmark behave as a user expects."""

import json
import re
import subprocess
import sys

import pytest

import mlx_flash
from mlx_flash.convert.random_model import build_checkpoint
from mlx_flash.errors import FlashError
from test_parity import greedy

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [42, 17], [300, 301, 302, 303, 5]]  # unequal: left padding


@pytest.mark.parametrize("mode, budget", [("dense", None), ("hybrid", "300MB"), ("naive", "300MB")])
def test_a_batch_decodes_what_each_prompt_decodes_alone(smollm2, mode, budget):
    model, tok = mlx_flash.load(smollm2, mode=mode, memory_budget=budget, progress=False)
    r = mlx_flash.batch_generate(model, tok, PROMPTS, max_tokens=6, stop=False)
    assert r.tokens == [greedy(model, p, 6) for p in PROMPTS]
    assert r.generation_tokens == 18 and r.steps == 6 and r.finish_reasons == ["length"] * 3
    model.runtime.close()


EIGHT = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [42, 17], [300, 301, 302, 303, 5], [11, 12], [907, 5, 64],
         [250, 251, 252, 253], [77], [500, 13, 14, 15, 16, 17]]  # more than kernels.SMALL_PASS


@pytest.mark.parametrize("mode, budget", [("dense", None), ("hybrid", "300MB")])
def test_a_batch_step_through_the_pass_kernels_decodes_what_each_prompt_decodes_alone(smollm2, mode, budget,
                                                                                     monkeypatch, caplog):
    """A decode step of more than SMALL_PASS sequences multiplies each packed row into every
    sequence at once (qmm_rows / qmm_cols for the FFN, qmm for the quantized attention and head)
    where the CPU has AVX2 or AVX-512, and through BLAS where not (level 0): each prompt gets its
    tokens alone at every level."""
    from mlx_flash import kernels as K
    from mlx_flash.kernels import passes

    module, why = K.kernels_module()
    if module is None:
        pytest.skip(f"native kernels: {why}")
    top = module.simd(99)
    calls = {"qmm_rows": 0, "qmm_cols": 0, "qmm": 0}
    for name in ("qmm_rows", "qmm_cols"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, real=real, name=name, **k: calls.__setitem__(name, calls[name] + 1)
                            or real(*a, **k))
    real_matmul = K.QuantMatrix.matmul
    monkeypatch.setattr(K.QuantMatrix, "matmul", lambda self, *a, **k: calls.__setitem__("qmm", calls["qmm"] + 1)
                        or real_matmul(self, *a, **k))
    model, tok = mlx_flash.load(smollm2, mode=mode, memory_budget=budget, progress=False)
    try:
        alone = [greedy(model, p, 5) for p in EIGHT]
        for level in range(top, -1, -1):
            module.simd(level)
            for name in calls:
                calls[name] = 0
            passes._SAID.clear()
            caplog.clear()
            r = mlx_flash.batch_generate(model, tok, EIGHT, max_tokens=5, stop=False)
            assert r.tokens == alone, level
            used = K.batched(module)
            assert all((n > 0) == used for n in calls.values()), (level, calls)
            said = [m for m in caplog.messages if "not the pass kernels" in m]
            assert len(said) == (0 if used else 1), said  # (where BLAS takes the step: said once)
    finally:
        module.simd(top)
        model.runtime.close()


@pytest.mark.parametrize("mode, budget", [("dense", None), ("hybrid", "300MB")])
def test_a_prompt_goes_through_the_pass_kernels_only_when_asked(smollm2, mode, budget, monkeypatch):
    """A prompt's chunk goes through dequantized chunks + BLAS (the parity rule); with
    kernels.PROMPT_PASS set, a chunk of more than SMALL_PASS and up to that many positions
    multiplies each packed row into every position at once (qmm_rows / qmm_cols) where the CPU runs
    the tiles: its logits those of BLAS to float32 summation order, the greedy tokens the same; a
    longer chunk goes through BLAS."""
    import mlx.core as mx

    from mlx_flash import kernels as K
    from mlx_flash.kernels import passes

    module, why = K.kernels_module()
    if module is None or not K.batched(module):
        pytest.skip(f"the pass kernels' tiles do not run here ({why or 'SIMD level 0'})")
    calls = []
    for name in ("qmm_rows", "qmm_cols"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    model, tok = mlx_flash.load(smollm2, mode=mode, memory_budget=budget, progress=False)
    try:
        ids = tok.encode("The history of the printing press begins in the fifteenth century, when")
        x = mx.array([ids])
        assert passes.PROMPT_PASS == 0
        blas = model(x)
        want = greedy(model, ids, 6)
        assert not calls
        monkeypatch.setattr(passes, "PROMPT_PASS", len(ids))
        tiles = model(x)
        assert calls  # (the FFN's rows: through the tiles)
        # the logits (magnitude ~20-30) move by float32 summation order alone (tests/test_quant.py)
        assert mx.abs(tiles - blas).max().item() < 1e-4 * max(1.0, mx.abs(blas).max().item())
        assert greedy(model, ids, 6) == want
        monkeypatch.setattr(passes, "PROMPT_PASS", len(ids) - 1)  # a chunk one longer than it: BLAS
        calls.clear()
        model(x)
        assert not calls
    finally:
        model.runtime.close()


def test_the_profile_s_timing_of_large_batches_leaves_the_fallback_note_to_the_user_s_batches(monkeypatch, caplog):
    """The machine profile times batch steps through BLAS on purpose where the pass kernels do not
    run (SIMD level 0): said nothing then, and said at the user's first such batch."""
    import logging

    import mlx.core as mx

    from mlx_flash import kernels as K
    from mlx_flash.kernels import passes

    module, why = K.kernels_module()
    if module is None:
        pytest.skip(f"native kernels: {why}")
    monkeypatch.setattr(passes, "_SAID", set())
    x = mx.zeros((passes.BATCH_PASS + 8, 1, 64))
    with caplog.at_level(logging.WARNING, logger="mlx_flash"):
        with K.pass_notes_off():
            assert not K.pass_kernels(module, x)
        assert not [r for r in caplog.records if "not the pass kernels" in r.getMessage()]
        assert not K.pass_kernels(module, x)
        assert [r for r in caplog.records if f"more than the {passes.BATCH_PASS} they take" in r.getMessage()]


def test_batch_on_opt_positions_under_left_padding(tmp_path):
    """OPT's learned positions start after each sequence's padding, not at the batch's start."""
    folder = build_checkpoint("tiny-opt", "float32", home=tmp_path, progress=False)
    model, tok = mlx_flash.load(folder, mode="hybrid", memory_budget="5MB", progress=False)
    r = mlx_flash.batch_generate(model, tok, PROMPTS, max_tokens=5, stop=False)
    assert r.tokens == [greedy(model, p, 5) for p in PROMPTS]
    model.runtime.close()


def test_batch_refusals(smollm2):
    model, tok = mlx_flash.load(smollm2, progress=False)
    with pytest.raises(FlashError, match="no prompts"):
        mlx_flash.batch_generate(model, tok, [])
    with pytest.raises(FlashError, match="prompt 2 is empty"):
        mlx_flash.batch_generate(model, tok, [[1], []])
    with pytest.raises(FlashError, match="prompt 2 has token id 49152, outside the model's vocabulary"):
        mlx_flash.batch_generate(model, tok, [[1], [5, 49152]])
    with pytest.raises(FlashError, match="the prompt has token id -1, outside"):
        mlx_flash.generate(model, tok, [5, -1], max_tokens=2)
    model.runtime.close()


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "mlx_flash", *args], capture_output=True, text=True,
                          timeout=600, **kw)


def test_cli_batch_file(smollm2, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text('"Name a colour."\n\n{"prompt": "Count to three."}\n')
    out = tmp_path / "answers.jsonl"
    r = _cli("generate", "--model", str(smollm2), "--batch-file", str(src), "--batch-out", str(out),
             "--max-tokens", "6", "--mode", "hybrid", "--memory-budget", "300MB", "--stats")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ["Name a colour.", "Count to three."]
    assert all(0 < x["tokens"] <= 6 and x["finish_reason"] in ("length", "stop") for x in lines)
    assert "Batch of 2:" in r.stdout and "tokens-per-sec" in r.stdout and "Mode hybrid" in r.stdout


@pytest.mark.parametrize("content, extra, expect", [
    ('"ok"\n{not json\n', [], "prompts.jsonl:2: not JSON"),
    ('{"text": "no prompt key"}\n', [], "prompts.jsonl:1: expected a non-empty string"),
    ("\n\n", [], "no prompts in it"),
    ('"ok"\n', ["--prompt", "Hi"], "--prompt and --batch-file: give one"),
    ('"ok"\n', ["--kv-bits", "4"], "a batch's is held at the compute dtype"),
])
def test_cli_batch_file_errors(smollm2, tmp_path, content, extra, expect):
    src = tmp_path / "prompts.jsonl"
    src.write_text(content)
    r = _cli("generate", "--model", str(smollm2), "--batch-file", str(src), "--max-tokens", "2", *extra)
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_batch_under_a_memory_limit_holds_its_planned_caches(smollm2):
    from mlx_flash.runtime import memory

    limit = memory.process_rss() + 300 * 10**6
    model, tok = mlx_flash.load(smollm2, mode="hybrid", memory_limit=str(limit), ctx_size=32, batch_size=3,
                                progress=False)
    m = model.runtime.memory
    assert m.batch == 3 and m.kv == 3 * 32 * m.shape.kv_per_token * 4 and "x 3 sequences" in m.describe()
    one = memory.plan_memory(str(limit), m.shape, 4, 32, baseline=m.baseline)
    assert one.kv * 3 == m.kv and one.weights > m.weights
    r = mlx_flash.batch_generate(model, tok, PROMPTS, max_tokens=6, stop=False)
    assert r.tokens == [greedy(model, p, 6) for p in PROMPTS]
    with pytest.raises(FlashError, match="4 prompts, and the --memory-limit plan holds KV caches for 3"):
        mlx_flash.batch_generate(model, tok, PROMPTS + [[5]], max_tokens=2)
    with pytest.raises(FlashError, match="exceed the 32 tokens of context"):
        mlx_flash.batch_generate(model, tok, PROMPTS, max_tokens=30)
    model.runtime.close()
    with pytest.raises(FlashError, match="without a limit batch_generate takes any number"):
        mlx_flash.load(smollm2, batch_size=4, progress=False)


def test_auto_under_a_memory_limit_for_a_batch_prices_the_batch_s_step(smollm2, tmp_path, monkeypatch):
    """--mode auto for batch_size sequences compares the plans by the cost model's decode step of
    that many sequences (the profile's batch rates), and --explain shows that step."""
    from mlx_flash.plan.explain import explain
    from mlx_flash.plan.profile import save_profile
    from mlx_flash.runtime import memory
    from test_plan import _profile, _rates

    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path))
    rates = _rates(float32=10.0, q4=20.0, float16=5.0, bfloat16=5.0, q8=20.0)
    save_profile(_profile(compute=rates, pass_compute={f: {10**6: {16: v / 4}} for f, (v,) in
                                                       ((f, tuple(r.values())) for f, r in rates.items())}),
                 tmp_path / "profile.json")
    limit = memory.process_rss() + 300 * 10**6
    model, _ = mlx_flash.load(smollm2, memory_limit=str(limit), ctx_size=32, batch_size=8, progress=False)
    try:
        choice = model.runtime.choice
        assert "ms a decode step of 8 sequences" in choice.reason, choice.reason
        assert "no rates for a batch's step" not in choice.reason
        assert all(c.prediction.positions == 8 and c.prediction.batch_priced for c in choice.candidates
                   if c.prediction is not None)
        assert "predicted per step of 8 sequences" in explain(model.runtime)
    finally:
        model.runtime.close()
    # a profile measured before the batch rates: each plan's step priced as 8 one-position steps, said
    save_profile(_profile(compute=rates), tmp_path / "profile.json")
    model, _ = mlx_flash.load(smollm2, memory_limit=str(limit), ctx_size=32, batch_size=8, progress=False)
    try:
        assert "priced as 8 one-position steps" in model.runtime.choice.reason, model.runtime.choice.reason
        assert "the profile has no batch rates" in explain(model.runtime)
    finally:
        model.runtime.close()


def test_cli_batch_file_under_a_cgroup_of_the_limit(smollm2, tmp_path):
    from test_memory_limit import _cgroup_runner

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(f"Tell me about the number {i}.") + "\n" for i in range(8)))
    cmd = [sys.executable, "-m", "mlx_flash", "generate", "--model", str(smollm2), "--batch-file", str(src),
           "--max-tokens", "8", "--memory-limit", "360MB", "--stats"]
    log = tmp_path / "out.txt"
    with _cgroup_runner() as runner, open(log, "w") as out:
        r = runner.run(cmd, limit_bytes=360 * 10**6, timeout=600, stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert not r.oom_killed and r.returncode == 0, (r, text[-2000:])
    assert "x 8 sequences" in text and "Batch of 8:" in text, text[-2000:]
    peak = re.search(r"peak RSS (\d+) MB", text)  # (a decode step's logits computed a chunk of the table at a time)
    assert peak and int(peak.group(1)) <= 360, text[-2000:]


@pytest.mark.slow  # (over 10 s here: `make test-slow` runs it)
def test_benchmark_batch_writes_its_table(tmp_path):
    """... with the cost model's step beside the measured one where a machine profile is cached."""
    import os

    from mlx_flash.plan.profile import save_profile
    from test_plan import _profile

    # (a disk far slower than any here, 1-4 MB/s: the prediction at the disk probed in the run differs)
    save_profile(_profile(pass_compute={"q4": {10**6: {16: 2.0}}, "float32": {10**6: {16: 1.0}}},
                          disk={4096: 0.001, 262144: 0.004}), tmp_path / "profile.json")
    r = _cli("benchmark", "batch", "--shape", "tiny-llama", "--dtype", "q4", "--batch", "5", "--tokens", "3",
             "--rounds", "2", "--out", str(tmp_path / "out"), env=os.environ | {"MLX_FLASH_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "out" / "batch-tiny-llama-q4-hybrid.json").read_text())
    assert [row["batch"] for row in res["rows"]] == [1, 5]  # one-by-one always in the same run
    assert all(len(row["runs"]) == 2 and row["decode_tps"] > 0 for row in res["rows"])
    assert res["rows"][1]["runs"][0]["generated"] == 15
    one, five = res["rows"]
    assert one["predicted"]["total_ms"] > 0 and "positions" not in one["predicted"]
    # five sequences: a step of 16's rate (the tiles pad to 16), 10x (q4) and 10x (float32) one position's
    p = five["predicted"]
    assert p["positions"] == 5 and p["batch_priced"] and p["compute_ms"] > one["predicted"]["compute_ms"]
    assert five["measured_over_predicted"] == pytest.approx(five["step_ms"] / p["total_ms"])
    # and again at the disk probed on the checkpoint at the start of each round (the median): faster
    # than the profile's, so less I/O predicted
    assert len(res["disk_curves_gbs"]) == 2 and all(c and min(c.values()) > 0.01 for c in res["disk_curves_gbs"])
    for row in res["rows"]:
        assert row["predicted_run_curve_ms"] < row["predicted"]["total_ms"] - 0.5 * row["predicted"]["io_ms"]
        assert row["measured_over_predicted_run_curve"] == pytest.approx(row["step_ms"] / row["predicted_run_curve_ms"])
    table = (tmp_path / "out" / "batch-tiny-llama-q4-hybrid.md").read_text()
    assert "| 5 |" in table and "measured ÷ predicted" in table and "measured ÷ predicted at the run's disk" in table
    assert "disk during the runs" in table and all("disk_gbs" in x for row in res["rows"] for x in row["runs"])


def test_benchmark_batch_predicts_again_at_the_disk_the_decode_got(tmp_path, monkeypatch):
    """The device's counters around each run give the rate the disk delivered while it read
    (io/device.py); each row is predicted again at the median of its runs' rates. Here the
    counters say 0.04 GB/s, ten times the profile's disk at 256 KiB: less I/O predicted."""
    from mlx_flash.bench import batch
    from mlx_flash.io import device
    from test_plan import _profile

    ticks = iter(range(10**6))

    def counters(path):  # every call 64 MB more read in 1.6 s more busy: 0.04 GB/s between two
        i = next(ticks)
        return i * 64 * 10**6, i * 1.6, 0

    monkeypatch.setattr(device, "counters", counters)
    monkeypatch.setenv("MLX_FLASH_HOME", str(tmp_path))
    profile = _profile(pass_compute={"q4": {10**6: {16: 2.0}}, "float32": {10**6: {16: 1.0}}},
                       disk={4096: 0.001, 262144: 0.004})
    res = batch.run_batch_bench("tiny-llama", "q4", batches=(1, 3), tokens=2, prompt_tokens=4, rounds=1,
                                progress=False, profile=profile)
    for row in res["rows"]:
        assert row["decode_disk_gbs"] == pytest.approx(0.04)
        assert row["predicted_run_disk_ms"] < row["predicted"]["total_ms"] - 0.5 * row["predicted"]["io_ms"]
        assert row["measured_over_predicted_run_disk"] == pytest.approx(row["step_ms"] / row["predicted_run_disk_ms"])
    assert "| 0.04 |" in batch.report(res, profile)


def test_benchmark_batch_under_a_memory_limit_plans_each_size(tmp_path):
    import os

    r = _cli("benchmark", "batch", "--shape", "tiny-llama", "--dtype", "q4", "--batch", "3", "--tokens", "3",
             "--rounds", "2", "--memory-limit", "400MB", "--out", str(tmp_path / "out"),
             env=os.environ | {"MLX_FLASH_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "out" / "batch-tiny-llama-q4-hybrid-limit.json").read_text())
    assert res["memory_limit"] == "400MB" and res["memory_budget"] is None
    assert [row["batch"] for row in res["rows"]] == [1, 3] and all(row["decode_tps"] > 0 for row in res["rows"])
    assert "--memory-limit 400MB" in (tmp_path / "out" / "batch-tiny-llama-q4-hybrid-limit.md").read_text()
    r = _cli("benchmark", "batch", "--shape", "tiny-llama", "--memory-limit", "400MB", "--memory-budget", "50%",
             "--out", str(tmp_path / "x"), env=os.environ | {"MLX_FLASH_HOME": str(tmp_path)})
    assert r.returncode == 2 and "give one" in r.stderr, r.stderr


def test_benchmark_batch_of_a_model_held_at_float16(tmp_path):
    """--resident-dtype float16: a float16 checkpoint held as stored (its batch steps through the
    16-bit pass kernels where the CPU has them), said in the table and the file's name; refused
    for a checkpoint that is not float16."""
    r = _cli("benchmark", "batch", "--shape", "tiny-llama", "--dtype", "float16", "--mode", "dense", "--batch", "5",
             "--tokens", "2", "--rounds", "1", "--resident-dtype", "float16", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "batch-tiny-llama-float16-dense-held-float16.json").read_text())
    assert res["resident_dtype"] == "float16" and [row["batch"] for row in res["rows"]] == [1, 5]
    assert "held at float16" in (tmp_path / "batch-tiny-llama-float16-dense-held-float16.md").read_text()
    r = _cli("benchmark", "batch", "--shape", "tiny-llama", "--dtype", "q4", "--resident-dtype", "float16",
             "--out", str(tmp_path))
    assert r.returncode != 0 and "--dtype q4 has none" in r.stderr and "Traceback" not in r.stderr

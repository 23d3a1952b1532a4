"""--memory-limit: the whole process under one number (runtime/memory.py): the plan's parts,
its errors, the context check of generate, and real runs under a memory cgroup of that size."""

import gc
import re
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_flash
from mlx_flash.errors import BudgetTooSmall, FlashError
from mlx_flash.runtime import memory
from mlx_flash.runtime.memory import Shape, plan_memory

MB = 10**6
SHAPE = Shape(n_layers=30, d_model=576, n_ff=1536, n_heads=9, kv_per_token=30 * 384, vocab=49152)


def test_plan_takes_every_part_off_the_limit(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    p = plan_memory("400MB", SHAPE, 4, context=1024, baseline=100 * MB)
    assert p.limit == 400 * MB and p.baseline == 100 * MB and p.context == 1024
    assert p.kv == 1024 * SHAPE.kv_per_token * 4
    assert p.weights == p.limit - p.baseline - p.kv - p.activations - p.mlx_cache - p.margin > 0
    # the prompt chunk: the largest whose temporaries take at most a quarter of what is left
    room = p.limit - p.baseline - p.kv - p.mlx_cache - p.margin
    assert p.activations <= room // 4
    bigger = [s for s in memory.PREFILL_STEPS if s > p.prefill_step]
    assert all(memory.activation_bytes(SHAPE, s, 1024, 4) > room // 4 for s in bigger)
    # a longer context: a larger KV cache, fewer weights
    assert plan_memory("400MB", SHAPE, 4, context=2048, baseline=100 * MB).weights < p.weights
    assert "KV cache" in p.describe() and "1024 tokens" in p.describe()
    # a context shorter than every chunk: the chunk is the context (a prompt is no longer)
    short = plan_memory("4GB", SHAPE, 4, context=40, baseline=100 * MB)
    assert short.prefill_step == 40 and short.activations == memory.activation_bytes(SHAPE, 40, 40, 4)
    # a prompt chunk's logits are never computed (mlx_lm's prefill drops them, every lm_head
    # computes a prompt's lazily): the vocabulary counts one position a sequence, whatever the chunk
    wide = Shape(**{**SHAPE.__dict__, "vocab": 2 * SHAPE.vocab})
    for chunk in (32, 512):
        assert memory.activation_bytes(wide, chunk, 1024, 4) - memory.activation_bytes(SHAPE, chunk, 1024, 4) \
            == memory.SMALL_PASS * SHAPE.vocab * 4
    # a batch's decode step through the pass kernels holds float32 host arrays of the FFN's width
    # for every sequence (gate, up, their product, x transposed in C), whatever the chunk and dtype,
    # and each kernel thread keeps a column tile (64 rows of d_model floats, rounded up to 16)
    narrow = Shape(**{**SHAPE.__dict__, "vocab": 1})  # (the logits apart)
    tiles = memory.default_threads() * 64 * -(-SHAPE.d_model // 16) * 16 * 4
    for sequences in (memory.SMALL_PASS + 1, 256):
        step = sequences * (4 * SHAPE.n_ff + 2 * SHAPE.d_model) * 4
        assert memory.activation_bytes(narrow, sequences, 64, 2, sequences=sequences) >= step + tiles
    # so does a prompt chunk of more than SMALL_PASS and up to kernels.PROMPT_PASS positions, when
    # set (stop 48; 0, its default: every prompt chunk through BLAS)
    chunk = memory.SMALL_PASS + 1
    step = chunk * (4 * SHAPE.n_ff + 2 * SHAPE.d_model) * 4
    assert memory.activation_bytes(narrow, chunk, 64, 2) < step + tiles
    monkeypatch.setattr(memory.passes, "PROMPT_PASS", 256)
    for chunk in (memory.SMALL_PASS + 1, 256):
        step = chunk * (4 * SHAPE.n_ff + 2 * SHAPE.d_model) * 4
        assert memory.activation_bytes(narrow, chunk, 64, 2) >= step + tiles
    small = memory.SMALL_PASS * (4 * SHAPE.n_ff + 2 * SHAPE.d_model) * 4
    assert memory.activation_bytes(narrow, memory.SMALL_PASS, 64, 2) < small + tiles  # (one-position kernels)


def test_plan_errors_name_the_parts(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    with pytest.raises(FlashError, match="nothing left for the weights.*runtime 150 MB.*raise --memory-limit"):
        plan_memory("180MB", SHAPE, 4, context=256, baseline=150 * MB)
    with pytest.raises(FlashError, match="lower --ctx-size"):
        plan_memory("300MB", SHAPE, 4, context=100_000, baseline=50 * MB)
    with pytest.raises(FlashError, match="--memory-limit"):
        plan_memory("lots", SHAPE, 4)
    with pytest.raises(FlashError, match="--ctx-size must be at least 1"):
        plan_memory("1GB", SHAPE, 4, context=0)


def test_a_budget_too_small_is_restated_as_the_smallest_limit_that_holds_it(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    p = plan_memory("300MB", SHAPE, 4, context=256, baseline=100 * MB)
    short = BudgetTooSmall("memory budget ...", p.weights, p.weights + 37 * MB, "the resident weights take X")
    text = str(p.restate(short))
    assert text.startswith(f"--memory-limit 300 MB leaves {p.weights / 1e6:.0f} MB for weights")
    assert "the resident weights take X" in text and "memory budget" not in text
    need = int(re.search(r"at least (\d+) MB", text).group(1)) * MB
    at = lambda limit, base=100 * MB: plan_memory(str(limit), SHAPE, 4, context=256, baseline=base).weights  # noqa: E731
    assert at(need) >= short.needed  # that limit holds it (its margin and chunks grew with it)
    # ... in a run that measures its runtime a few MB larger too (flaky before: a second
    # process measured 1-2 MB more and the named limit fell short)
    assert at(need, 100 * MB + memory.BASELINE_NOISE) >= short.needed
    # and it is no more than that noise above the smallest that does
    assert at(need - memory.BASELINE_NOISE - 2 * MB) < short.needed
    assert "--kv-bits" not in text  # (8-bit KV would not make 37 MB of room here)
    # another way to fit, where the error has one: said after the limit that would hold it
    hinted = BudgetTooSmall("memory budget ...", p.weights, p.weights + 37 * MB, "X", ", or Y")
    assert str(hinted) == "memory budget ..., or Y" and str(p.restate(hinted)).endswith(" MB, or Y")


def test_shorter_prompt_chunks_leave_the_weights_more(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    p = plan_memory("400MB", SHAPE, 4, context=2048, baseline=100 * MB)
    shorter = p.shorter_chunks()
    assert [q.prefill_step for q in shorter] == [s for s in memory.PREFILL_STEPS if s < p.prefill_step]
    assert all(a.weights < b.weights for a, b in zip([p] + shorter, shorter))
    assert all(q.activations == memory.activation_bytes(SHAPE, q.prefill_step, 2048, 4) for q in shorter)
    assert all((q.kv, q.margin, q.context) == (p.kv, p.margin, p.context) for q in shorter)
    assert plan_memory("4GB", SHAPE, 4, context=40, baseline=100 * MB).shorter_chunks()[-1].prefill_step == 32


def test_the_loader_shortens_the_prompt_chunks_before_it_gives_up(smollm2, monkeypatch, caplog):
    """A 2048-token KV cache held in DRAM (--kv-cache dram): at the chunks the rule chose, the
    weights' share cannot hold the resident weights and the least FFN plan; at shorter chunks it
    can, and the loader takes them, said in a line. (The runtime fixed at 120 MB: the window is a
    few MB wide.)"""
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    monkeypatch.setattr(memory, "process_rss", lambda: 120 * MB)
    model, tok = mlx_flash.load(smollm2, memory_limit="313MB", ctx_size=2048, kv_cache="dram")
    m = model.runtime.memory
    rule = plan_memory("313MB", m.shape, 4, context=2048, baseline=120 * MB)
    assert m.prefill_step < rule.prefill_step and not m.kv_on_flash, caplog.text
    assert f"prompt chunks of {m.prefill_step} tokens, not {rule.prefill_step}" in caplog.text
    assert mlx_flash.generate(model, tok, "Hi there", max_tokens=2)
    del model
    gc.collect()


@pytest.mark.parametrize("mode", ["auto", "dense"])
def test_the_prompt_chunks_shorten_where_that_lets_the_whole_model_fit(smollm2, monkeypatch, caplog, mode):
    """--mode auto (or dense asked for): where the rule's prompt chunks leave the weights less than
    dense needs and a shorter chunk does not, the shorter chunk (dense decodes without reading;
    its prompt reads nothing either)."""
    from mlx_flash.layout.format import read_manifest
    from mlx_flash.runtime import dense_need, make_config

    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    monkeypatch.setattr(memory, "process_rss", lambda: 120 * MB)
    model, _ = mlx_flash.load(smollm2, memory_limit="2GB", ctx_size=2048)
    shape = model.runtime.memory.shape
    del model
    gc.collect()
    dense = dense_need(smollm2, read_manifest(smollm2), make_config({}))
    at = lambda mb: plan_memory(f"{mb}MB", shape, 4, context=2048, baseline=120 * MB)  # noqa: E731
    limit = next(mb for mb in range(300, 1000) if at(mb).weights < dense <= at(mb).shorter_chunks()[-1].weights)
    model, tok = mlx_flash.load(smollm2, mode=mode, memory_limit=f"{limit}MB", ctx_size=2048, kv_cache="dram")
    m = model.runtime.memory
    assert m.prefill_step < at(limit).prefill_step and m.weights >= dense, caplog.text
    assert f"not {at(limit).prefill_step}: " in caplog.text and f"dense needs {dense / 1e6:.0f} MB" in caplog.text
    assert model.runtime.plan.mode == "dense", caplog.text
    assert mlx_flash.generate(model, tok, "Hi there", max_tokens=2)
    del model
    gc.collect()


def test_a_budget_short_by_less_than_the_kv_caches_share_names_kv_bits(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    p = plan_memory("300MB", SHAPE, 4, context=2048, baseline=100 * MB)
    kv8 = plan_memory("300MB", SHAPE, 4, context=2048, baseline=100 * MB + memory.BASELINE_NOISE,
                      kv_itemsize=memory.kv_value_bytes(4, 8))
    assert kv8.kv < p.kv / 3
    short = BudgetTooSmall("x", p.weights, (p.weights + kv8.weights) // 2, "naive needs N")
    text = str(p.restate(short))
    assert f"or keep it with --kv-bits 8 (the KV cache at 8 bits: {kv8.kv / 1e6:.0f} MB" in text, text
    quantized = plan_memory("300MB", SHAPE, 4, context=2048, baseline=100 * MB, kv_itemsize=memory.kv_value_bytes(4, 8))
    assert "--kv-bits" not in str(quantized.restate(short))  # (already quantized)


def test_a_limit_whose_share_cannot_hold_the_resident_weights_says_so_in_its_terms(smollm2):
    def run(limit):
        return subprocess.run([sys.executable, "-m", "mlx_flash", "generate", "--model", str(smollm2),
                               "--mode", "hybrid", "--memory-limit", limit, "--prompt", "Hi", "--max-tokens", "2"],
                              capture_output=True, text=True, timeout=300)

    # Past the check before loading (the runtime measured here and the tokenizer's load), short of
    # the resident weights (~200 MB): the first figure is the machine's, so it is read, not assumed.
    first = re.search(r"nothing left for the weights: .* at least (\d+) MB", run("100MB").stderr)
    assert first, "the check before loading names the limit it needs"
    limit = int(first.group(1)) + 10
    r = run(f"{limit}MB")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--memory-limit {limit} MB leaves" in r.stderr and "memory budget" not in r.stderr, r.stderr
    # (a short context: the KV cache on flash would take more DRAM than in it, and is not tried)
    assert "KV cache on flash" not in r.stderr, r.stderr
    # (a quantized model: what it needs with every layer's attention left on flash)
    need = re.search(r"even with every layer's attention read from flash, the resident weights .* take (\d+) MB "
                     r"and the least FFN plan .*: raise --memory-limit to at least (\d+) MB", r.stderr)
    assert need, r.stderr
    r = run(f"{need.group(2)}MB")  # the limit it names holds them (hybrid may still want more)
    assert "resident weights alone" not in r.stderr and "even with every layer's" not in r.stderr, r.stderr


def test_a_share_is_of_the_machine_and_a_cgroup_caps_it(monkeypatch, capsys):
    monkeypatch.setattr(memory, "physical_memory", lambda: 8000 * MB)
    monkeypatch.setattr(memory, "cgroup_limit", lambda: None)
    assert plan_memory("25%", SHAPE, 4, baseline=100 * MB).limit == 2000 * MB
    monkeypatch.setattr(memory, "cgroup_limit", lambda: 1000 * MB)
    p = plan_memory("25%", SHAPE, 4, baseline=100 * MB)
    assert p.limit == 1000 * MB and "cgroup" in capsys.readouterr().err


def test_contradicting_options_are_refused(smollm2):
    with pytest.raises(FlashError, match="contradict each other"):
        mlx_flash.load(smollm2, memory_limit="1GB", memory_budget="50%")
    with pytest.raises(FlashError, match="without either it changes nothing"):
        mlx_flash.load(smollm2, ctx_size=512)


def test_the_context_can_be_counted_by_the_tokenizer(smollm2, tmp_path):
    # load(context_of=): the plan's context from the loaded tokenizer, where no ctx_size is given
    limit = str(memory.process_rss() + 250 * MB)
    model, _ = mlx_flash.load(smollm2, mode="hybrid", memory_limit=limit, context_of=lambda tok: 77)
    assert model.runtime.memory.context == 77
    model.runtime.close()
    del model  # (a second load measures what this process holds: not the first model)
    gc.collect()
    model, _ = mlx_flash.load(smollm2, mode="hybrid", memory_limit=limit, ctx_size=64, context_of=lambda tok: 77)
    assert model.runtime.memory.context == 64  # (a context given wins)
    model.runtime.close()
    # generate: the tokens it will feed (the prompt in the chat template; not its bytes, ~3x
    # more here), counted as its context check counts them, + --max-tokens
    prompt = "Tell me about the sea. " * 30
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "generate", "--model", str(smollm2), "--memory-limit",
                        "400MB", "--mode", "hybrid", "--prompt", prompt, "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_flash.cli.generate import build_prompt

    n = len(build_prompt(load_tokenizer(smollm2), prompt))
    assert f"({n + 8} tokens)" in r.stderr and 2 * n < len(prompt.encode()), r.stderr[-2000:]


def test_load_plans_the_budget_and_generate_checks_the_context(smollm2):
    # the limit is the whole process's: this test process's own resident set (whatever the tests
    # before it left) plus room for the model's resident weights and a small cache
    limit = memory.process_rss() + 250 * MB
    model, tok = mlx_flash.load(smollm2, mode="hybrid", memory_limit=str(limit), ctx_size=64)
    rt = model.runtime
    m = rt.memory
    assert m is not None and m.context == 64 and rt.budget_bytes == m.weights
    assert rt.plan.weights_bytes <= m.weights
    s = rt.stats()["summary"]["memory_limit"]
    assert s["limit_bytes"] == limit and s["weights_bytes"] == m.weights
    assert mlx_flash.generate(model, tok, "Hello", max_tokens=4)  # fits: runs
    # the KV caches: the planned context allocated once (what the plan counts), not grown
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    assert len(cache) == len(model.layers)
    model(mx.array([[1] * 10]), cache=cache)
    model(mx.array([[1] * 40]), cache=cache)
    kv = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert all(c.keys.shape[2] == 64 and c.offset == 50 for c in cache) and kv == m.kv
    with pytest.raises(FlashError, match="exceed the 64 tokens of context"):
        mlx_flash.generate(model, tok, "word " * 80, max_tokens=4)
    rt.close()


def _cgroup_runner():
    from mlx_flash.bench import peers

    version, why = peers.cgroup_support()
    if version is None:
        pytest.skip(f"memory cgroups not usable here: {why}")
    return peers.MemoryCgroupRunner(name=f"mlx_flash_limit_{__import__('os').getpid()}")


def generate_in_cgroup(model, limit_mb, tmp_path, *args):
    """`mlx_flash generate --model MODEL --memory-limit LIMIT ARGS --max-tokens 16 --stats`, started inside a
    memory cgroup of exactly the limit (its imports counted from the first byte) -> its output, once
    checked: not OOM-killed, exit 0, the peak RSS it reports (which also counts the shared libraries
    other processes loaded first) and the cgroup's own peak under the limit."""
    cmd = [sys.executable, "-m", "mlx_flash", "generate", "--model", str(model), "--memory-limit", f"{limit_mb}MB",
           *args, "--max-tokens", "16", "--stats"]
    log = tmp_path / "out.txt"
    with _cgroup_runner() as runner, open(log, "w") as out:
        r = runner.run(cmd, limit_bytes=limit_mb * MB, timeout=600, stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert not r.oom_killed and r.returncode == 0, (r, text[-2000:])
    assert r.peak_bytes <= limit_mb * MB
    peak = re.search(r"peak RSS (\d+) MB", text)
    assert peak and int(peak.group(1)) <= limit_mb, text[-2000:]
    return text


@pytest.mark.parametrize("mode, limit_mb", [("dense", 380), ("hybrid", 300), ("naive", 300), ("flash", 300)])
def test_generate_under_a_cgroup_of_the_limit(smollm2, tmp_path, mode, limit_mb):
    """The process under a cgroup of the limit, in each mode (generate_in_cgroup)."""
    args = ["--mode", mode, "--prompt", "Tell me about the sea."]
    if mode == "flash":
        args += ["--sparsity", "dip-ca", "--density", "0.5"]
    if mode == "hybrid":  # the context given on the command line (an int option with no default)
        args += ["--ctx-size", "96"]
    text = generate_in_cgroup(smollm2, limit_mb, tmp_path, *args)
    assert mode != "hybrid" or "(96 tokens)" in text, text[-2000:]


@pytest.fixture(scope="module")
def smollm2_f16(smollm2_gguf, tmp_path_factory):
    """SmolLM2 at float16: the default GGUF's values dequantized (275 MB; ~10 s)."""
    from mlx_flash.convert import convert
    from mlx_flash.convert.quantize import QuantOptions

    return convert(smollm2_gguf, tmp_path_factory.mktemp("f16") / "smollm2-f16", dtype="float16",
                   quant=QuantOptions(dequantize=True), progress=False)


@pytest.mark.parametrize("limit_mb, mode", [(530, "dense"), (408, "hybrid")])
def test_a_float16_model_under_a_cgroup_of_the_limit(smollm2_f16, tmp_path, limit_mb, mode):
    """--mode auto on float16 SmolLM2 under a memory cgroup of the limit (about the peers' runtime
    + 80 % and 60 % of its float32 weights): held at float16 as stored, dense where it fits, else hybrid;
    no OOM kill, the peak RSS under the limit. (A prompt chunk's logits are not counted in the
    plan: no lm_head computes them.)"""
    text = generate_in_cgroup(smollm2_f16, limit_mb, tmp_path, "--ctx-size", "256", "--prompt",
                              "Tell me about the sea. " * 30)
    from mlx_flash.kernels import kernels_module

    if kernels_module()[0] is not None:  # (without them held at float32: another plan)
        assert "the weights held at float16 as stored" in text and f"Mode {mode}," in text, text[-2000:]


@pytest.mark.parametrize("limit_mb", [150, 132])  # (132: the peers' runtime + 50 % of the 4-bit model)
def test_a_limit_too_small_is_a_clear_error_not_a_kill(smollm2, limit_mb):
    cmd = [sys.executable, "-m", "mlx_flash", "generate", "--model", str(smollm2), "--mode", "hybrid",
           "--memory-limit", f"{limit_mb}MB", "--prompt", "Hi", "--max-tokens", "4"]
    with _cgroup_runner() as runner:
        r = runner.run(cmd, limit_bytes=limit_mb * MB, timeout=600, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    assert not r.oom_killed and r.returncode == 2, r


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_rss is the peak RSS off Linux")
def test_a_second_load_does_not_count_the_first_models_leftovers(smollm2):
    # a process that loads a model, closes it and loads another (a server, a script) measures
    # its runtime again at the next load: what the last left in MLX's buffer cache and the
    # C heap is given back first (before: 119 then 165 MB measured). Loads 2 and 3 are compared,
    # not 1 and 2: the first load makes what a process makes once (its threads' stacks, BLAS's
    # buffers, code pages first run), which the next loads measure as runtime: 110 -> 130 MB
    # here, 122 -> 149 on CI's machine (stop 48). After that, ~8-14 MB a load that glibc's
    # malloc_trim cannot give back (the heap's fragments: 130, 138, 151, 157, 158, 159 MB at
    # loads 2-7). Without the release at load, the second load measures 183 MB and the third
    # does not fit the limit.
    code = f"""
import gc, mlx_flash
for _ in range(3):
    m, t = mlx_flash.load({str(smollm2)!r}, memory_limit="350MB")
    print("runtime", m.runtime.memory.baseline)
    m.runtime.close()
    del m, t
    gc.collect()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    runtimes = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("runtime")]
    assert runtimes[2] - runtimes[1] < 25 * MB and runtimes[1] - runtimes[0] < 60 * MB, [m / MB for m in runtimes]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_rss is the peak RSS off Linux")
def test_a_load_under_a_limit_names_the_models_still_referenced(smollm2):
    # a model closed but still referenced (a script's variable) keeps its weights in the process,
    # which the next load under a limit measures as its runtime: that load says why (here the
    # error: no room left), naming the model; once it is dropped, nothing is said
    code = f"""
import gc, mlx_flash
from mlx_flash.errors import FlashError
first, t = mlx_flash.load({str(smollm2)!r}, progress=False)
first.runtime.close()
try:
    mlx_flash.load({str(smollm2)!r}, memory_limit="350MB", progress=False)
    print("second loaded")
except FlashError as e:
    print("error:", e)
del first, t
gc.collect()
import sys; print("dropped", file=sys.stderr, flush=True)
m, t = mlx_flash.load({str(smollm2)!r}, memory_limit="350MB", progress=False)
print("third loaded")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "third loaded" in r.stdout, r.stderr[-2000:]
    before, after = r.stderr.split("dropped\n")
    said = r.stdout + before  # (the second load's error on stdout, or its warning on stderr)
    assert f"1 model(s) loaded before in this process and still referenced ({smollm2})" in said, said[-2000:]
    assert "still referenced" not in after, after[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_rss is the peak RSS off Linux")
def test_a_load_planned_again_does_not_count_its_first_attempt(smollm2):
    # dense under a limit whose KV cache in DRAM leaves too little: the plan, made before any
    # weight loads, puts the KV cache on flash; every placement it tries counts the same runtime
    # (no model loaded yet, none loaded twice). What the load adds to the
    # imports' RSS (the tokenizer, the model's skeleton) is measured first, in a process of its own:
    # the window where only the KV cache on flash fits is a few MB wide
    probe = f"""
import mlx_flash
from mlx_flash.runtime import memory
rss = memory.process_rss()
m, t = mlx_flash.load({str(smollm2)!r}, mode="dense", memory_limit="2GB", ctx_size=2048, progress=False)
print("added", m.runtime.memory.baseline - rss)
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    added = int(r.stdout.strip().splitlines()[-1].split()[1])
    code = f"""
import mlx_flash, mlx_flash.plan.fit as L
from mlx_flash.runtime import memory
MB = 10**6
shape = memory.Shape(n_layers=30, d_model=576, n_ff=1536, n_heads=9, kv_per_token=30 * 2 * 192, vocab=49152)
rss = memory.process_rss()
def weights(lim):
    try:
        return memory.plan_memory(str(lim), shape, 4, 2048, baseline=rss + {added}).weights
    except Exception:  # (nothing left for them)
        return 0
limit = next(lim for lim in range(rss + 100 * MB, rss + 800 * MB, 5 * MB) if weights(lim) > 60 * MB)
print("limit", limit, "added", {added})
seen = []
plan = L.plan_memory
def spy(*a, **k):
    seen.append(memory.process_rss())
    return plan(*a, **k)
L.plan_memory = spy
m, t = mlx_flash.load({str(smollm2)!r}, mode="dense", memory_limit=str(limit), ctx_size=2048, progress=False)
print("flash", m.runtime.memory.kv_on_flash)
print("runtimes", *seen)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "flash True" in r.stdout, r.stdout + r.stderr[-2000:]
    seen = [int(v) for v in r.stdout.split("runtimes")[1].split()]
    # the first model counted would add its ~90 MB (the third reading); what the allocator keeps of
    # it measured 22 MB here and 25.2 in a CI run (stop 45), against a bound of 25 then
    assert len(seen) >= 2 and seen[-1] - seen[0] < 45 * MB, [v / MB for v in seen]


def test_the_least_ffn_plan_counts_the_tables_a_run_reads(smollm2):
    """The scale tables a plan holds are the down columns' (read_tables), not the scale files'
    size: those also hold the DIP layout's tables, which only a DIP source reads (on
    Qwen2.5-Coder-1.5B 144.5 MB of files against 48.2 MB read)."""
    from mlx_flash.layout.format import read_manifest, read_tables

    m = read_manifest(smollm2)
    read = sum(a.nbytes for layer in read_tables(smollm2, m, m.layout) for pair in layer.values() for a in pair)
    assert read > 0 and m.layout.table_bytes * len(m.ffn_files) == read
    if m.dip is not None:  # (the default model is converted with --dip)
        assert sum(e["size"] for e in m.scales) > 2 * read

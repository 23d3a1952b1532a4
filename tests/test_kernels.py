"""The native quantized matvec (kernels/_matvec.c) and the modules that use it (models/quantized.py)."""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_flash
from mlx_flash.kernels import QuantMatrix, default_threads, kernels_module
from mlx_flash.models.quantized import NativeQuantizedEmbedding, NativeQuantizedLinear, native_modules
from mlx_flash.runtime import FlashConfig, keep_quantized

kernels, why = kernels_module()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"native kernels: {why}")


SIMD_TOP = kernels.simd(99) if kernels else 0  # the widest loops this CPU has (3: AVX-512 VNNI, 2: AVX-512 BF16, 1: AVX2)


@pytest.fixture
def simd_and_threads():
    """Every case runs at every SIMD level this CPU has (down to the portable loops), on one and two threads."""
    yield [(s, t) for s in range(SIMD_TOP, -1, -1) for t in (1, 2)]
    kernels.simd(SIMD_TOP)
    kernels.set_threads(default_threads())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_qmv_matches_mlx_quantized_matmul(bits, group, simd_and_threads):
    for i, dtype in enumerate((mx.float16, mx.bfloat16, mx.float32)):
        key = mx.random.key(bits * 1000 + group * 10 + i)
        w = (mx.random.normal((67, 384), key=key) * 0.05).astype(dtype)  # 67 rows: uneven shares
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
        x = mx.random.normal((384,), key=mx.random.key(7))
        # the reference in float32 throughout (MLX computes in the scales' dtype)
        s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
        want = np.array(mx.quantized_matmul(x[None], wq, s32, b32, transpose=True, group_size=group,
                                            bits=bits))[0]
        q = QuantMatrix(kernels, wq, s, b, bits, group)
        for simd, threads in simd_and_threads:
            kernels.simd(simd)
            kernels.set_threads(threads)
            got = q.matvec(np.array(x))
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (dtype, simd, threads)


def test_4_bit_rows_of_any_length_and_extreme_inputs_at_every_level(simd_and_threads):
    """The AVX-512 loops take rows of a multiple of 64 values (the rest stay on AVX2; level 3
    writes x as 8-bit digits, vnni.h): inputs across many magnitudes keep float32's precision."""
    rng = np.random.default_rng(5)
    for k in (96, 160, 2048):
        w = mx.array(rng.standard_normal((33, k)).astype(np.float32) * 0.05)
        wq, s, b = mx.quantize(w, group_size=32, bits=4)
        x = (rng.standard_normal(k) * 10.0 ** rng.integers(-6, 4, k)).astype(np.float32)
        values = np.array(mx.dequantize(wq, s, b, group_size=32, bits=4)).astype(np.float64)
        want = values @ x.astype(np.float64)
        scale = np.abs(values) @ np.abs(x.astype(np.float64))  # what float32 rounding is relative to
        q = QuantMatrix(kernels, wq, s, b, 4, 32)
        for simd, threads in simd_and_threads:
            kernels.simd(simd)
            kernels.set_threads(threads)
            got = q.matvec(x)
            assert np.all(np.abs(got - want) <= 1e-6 * scale), (k, simd, threads)


def _adversarial_x(rng, k):
    """x that an integer writing of it, a unit per few values, could get wrong, by name"""
    normal = rng.standard_normal(k).astype(np.float32)
    outliers = normal.copy()
    outliers[np.arange(0, k, 32) + rng.integers(0, 32, k // 32)] *= 1000  # one a 32, 1000x the rest
    zeros = normal.copy()
    zeros[:64] = 0  # whole 32s of zeros, and one of zeros but one value
    zeros[96:128] = 0
    zeros[100] = -3e-5
    half = normal.copy()
    half[k // 2:] *= 1e-30  # 2^100 below the rest: their digits 0
    # every 4th value, times 2^j (mostly its lane's largest) and either sign: mantissas just below,
    # at and above where a power-of-two unit's first digit would reach 128 (2 - 2^-7 - 2^-15 -
    # 2^-23), the largest mantissa, a power of two
    edge = normal.copy()
    near = np.float32(2 - 2**-7 - 2**-15 - 2**-23) + np.float32(2**-23) * np.arange(-2, 3, dtype=np.float32)
    near = np.concatenate([near, np.float32([2 - 2**-23, 1, 2 - 2**-7])])
    edge[::4] = (near[np.arange(k // 4) % 8] * np.float32(2.0) ** rng.integers(-3, 4, k // 4) *
                 rng.choice(np.float32([-1, 1]), k // 4)).astype(np.float32)
    return {"outliers": outliers, "zero 32s": zeros, "edge": edge, "tiny": normal * np.float32(1e-30),
            "subnormal": normal * np.float32(1e-40), "huge": normal * np.float32(1e30), "half tiny": half,
            "positive": np.abs(normal), "negative": -np.abs(normal),
            "magnitudes": (normal * 10.0 ** rng.integers(-6, 4, k)).astype(np.float32)}


@pytest.mark.skipif(SIMD_TOP < 3, reason="the CPU has no AVX-512 VNNI (SIMD level 3)")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_vnni_rows_keep_float32_precision_on_adversarial_x(bits, group):
    """Level 3 (vnni.h) writes x as three signed 8-bit digits a value, with a power-of-two unit per
    8 (4-bit rows) or 4 (8-bit) values, the rows' sums over them exact in integers: every output
    within float32's rounding of the float64 product of x and the dequantized rows (what the float
    loops are held to), for x with outliers 1000x their neighbours, zeros, values near 1e-30,
    subnormals or 1e30, units at their edge, one sign throughout; through qmv, qmv_many and
    qmv_rows, scales at float16, bfloat16 and float32, one and two threads, rows of an odd number
    of 128 values and (groups of 32 or 64) half a 4-bit register's. An infinity or a NaN in x
    makes every output NaN."""
    from mlx_flash.kernels import qmv_many, qmv_rows
    from mlx_flash.layout.quant import QuantSpec

    rng = np.random.default_rng(bits * 1000 + group)
    k = 640 if group == 128 else 576
    try:
        for dtype in ("float16", "bfloat16", "float32"):
            w = (mx.random.normal((67, k), key=mx.random.key(group + bits)) * 0.05).astype(getattr(mx, dtype))
            wq, s, b = mx.quantize(w, group_size=group, bits=bits)
            values = np.array(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group,
                                            bits=bits)).astype(np.float64)
            q = QuantMatrix(kernels, wq, s, b, bits, group)
            # the same rows packed back to back (a cache's layout), read by qmv_rows in another order
            held = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).view(np.uint8).reshape(67, -1)
                    for a in (wq, s, b)]
            buf = np.ascontiguousarray(np.concatenate(held, axis=1))
            soff, boff = held[0].shape[1], held[0].shape[1] + held[1].shape[1]
            sel = rng.permutation(67)
            for name, x in _adversarial_x(rng, k).items():
                want = values @ x.astype(np.float64)
                scale = np.abs(values) @ np.abs(x.astype(np.float64))  # what float32 rounding is relative to
                for threads in (1, 2):
                    kernels.simd(3)
                    kernels.set_threads(threads)
                    for how, got in (("qmv", q.matvec(x)), ("qmv_many", qmv_many([x], [q, q], (0, 0))[1]),
                                     ("qmv_rows", qmv_rows(kernels, x, buf, sel, QuantSpec(bits, group, dtype), soff,
                                                           boff)[np.argsort(sel)])):
                        assert np.all(np.abs(got - want) <= 1e-6 * scale), (dtype, name, how, threads)
            for bad in (np.inf, np.nan):
                x = _adversarial_x(rng, k)["magnitudes"]
                x[k // 3] = bad
                assert np.isnan(q.matvec(x)).all(), (dtype, bad)
    finally:
        kernels.simd(SIMD_TOP)
        kernels.set_threads(default_threads())


def test_many_products_in_one_call_equal_one_call_each(simd_and_threads):
    from mlx_flash.kernels import alike, qmv_many

    for bits in (4, 8):
        mats = []
        for i in range(6):
            wq, s, b = mx.quantize(mx.random.normal((40, 256), key=mx.random.key(i)) * 0.05, group_size=64, bits=bits)
            mats.append(QuantMatrix(kernels, wq, s.astype(mx.float16), b.astype(mx.float16), bits, 64))
        xs = [np.random.default_rng(i).standard_normal(256).astype(np.float32) for i in range(2)]
        x_of = (0, 1, 1, 0, 1, 0)
        assert alike(mats)
        for simd, threads in simd_and_threads:
            kernels.simd(simd)
            kernels.set_threads(threads)
            want = np.stack([m.matvec(xs[i]) for m, i in zip(mats, x_of)])
            assert np.array_equal(qmv_many(xs, mats, x_of), want), (bits, simd, threads)
    other = QuantMatrix(kernels, *mx.quantize(mx.random.normal((40, 128)), group_size=64, bits=4), 4, 64)
    assert not alike(mats + [other])
    with pytest.raises(ValueError, match="qmv_many"):
        qmv_many(xs, mats + [other], x_of + (0,))  # another shape
    with pytest.raises(ValueError, match="qmv_many"):
        qmv_many(xs, mats, (0, 1, 2, 0, 1, 0))  # no x 2
    with pytest.raises(ValueError, match="qmv_many"):
        qmv_many([xs[0][:100]], mats[:1], (0,))  # x too short
    many = [mats[0]] * (kernels.MAX_MANY + 1)
    assert not alike(many)
    with pytest.raises(ValueError, match="qmv_many"):  # more than MAX_MANY (once a double free)
        qmv_many([xs[0]] * len(many), many, range(len(many)))


def test_an_unknown_simd_level_is_a_clear_error():
    code = "from mlx_flash.kernels import kernels_module\nkernels_module()\n"
    env = os.environ | {"PYTHONWARNINGS": "ignore", "MLX_FLASH_KERNEL_SIMD": "avx3"}
    r = subprocess.run([sys.executable, "-c", code], timeout=60, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "MLX_FLASH_KERNEL_SIMD='avx3': one of portable, avx2, avx512-bf16, avx512-vnni" in r.stderr
    env["MLX_FLASH_KERNEL_SIMD"] = "portable"
    code = "from mlx_flash.kernels import kernels_module\nk, _ = kernels_module()\nassert k.simd(-1) == 0\n"
    assert subprocess.run([sys.executable, "-c", code], timeout=60, env=env).returncode == 0


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_dequantize_rows_equal_mlx_dequantize(bits, simd_and_threads):
    w = mx.random.normal((40, 256), key=mx.random.key(bits)).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)
    want = np.array(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=bits))
    q = QuantMatrix(kernels, wq, s, b, bits, 64)
    for _, threads in simd_and_threads:
        kernels.set_threads(threads)
        out = np.full((30, 256), np.nan, np.float32)
        q.dequantize(5, 35, out)
        assert np.array_equal(out, want[5:35])  # bit-exact: the same multiply, then add


def test_bad_arguments_are_a_clear_error():
    wq, s, b = mx.quantize(mx.zeros((8, 64)), group_size=64, bits=4)
    q = QuantMatrix(kernels, wq, s, b, 4, 64)
    with pytest.raises(ValueError, match="qmv: arguments"):
        q.matvec(np.zeros(63, np.float32))
    with pytest.raises(ValueError, match="dequantize: arguments"):
        q.dequantize(0, 8, np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="threads"):
        kernels.set_threads(0)
    with pytest.raises(ValueError, match="scales"):
        QuantMatrix(kernels, wq, s.astype(mx.float16), b, 4, 64)


def _quantized_linear(d_in, d_out, bias, key):
    lin = nn.Linear(d_in, d_out, bias=bias)  # a float16 model's: float16 scales
    lin.update({"weight": (mx.random.normal((d_out, d_in), key=key) * 0.05).astype(mx.float16)})
    q = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4)
    q.update({"scales": q.scales.astype(mx.float32), "biases": q.biases.astype(mx.float32)})  # as the loader holds them
    return q


@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_mlx_for_a_token_and_a_prompt(bias):
    from mlx_flash.models.half import Arena

    q = _quantized_linear(256, 300, bias, mx.random.key(1))
    values = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    arena = Arena(256 * 64)  # several chunks for the prompt path
    native = NativeQuantizedLinear(q, kernels, arena)
    assert native.scales.dtype == mx.float16  # held exactly at half the DRAM
    for shape in [(1, 1, 256), (2, 5, 256)]:
        x = mx.random.normal(shape, key=mx.random.key(2))
        want = x @ values.T + (q.bias if bias else 0)
        got = native(x)
        assert got.shape == want.shape
        assert mx.abs(got - want).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_native_embedding_lookups_are_exact_and_as_linear_matches():
    from mlx_flash.models.half import Arena

    emb = nn.Embedding(500, 128)
    emb.update({"weight": mx.random.normal((500, 128), key=mx.random.key(3)).astype(mx.float16)})
    q = nn.QuantizedEmbedding.from_embedding(emb, group_size=64, bits=8)
    q.update({"scales": q.scales.astype(mx.float32), "biases": q.biases.astype(mx.float32)})
    values = mx.dequantize(q.weight, q.scales, q.biases, group_size=64, bits=8)
    native = NativeQuantizedEmbedding(q, kernels, Arena(128 * 100), mx.float32)
    ids = mx.array([[0, 7, 499]])
    assert mx.array_equal(native(ids), values[ids])
    for x in (mx.random.normal((1, 1, 128)), mx.random.normal((1, 3, 128))):
        want = x @ values.T
        assert mx.abs(native.as_linear(x) - want).max().item() <= 1e-5 * mx.abs(want).max().item()


def test_a_quantized_model_decodes_through_the_kernels_as_dequantized(smollm2):
    """The default model (Q4_1 kept at 4 bits): held quantized by default on the CPU, through the
    native modules; prompt logits equal the dequantized model's, greedy tokens identical."""
    held, tok = mlx_flash.load(smollm2)
    assert held.runtime.resident.quantized and native_modules(held)
    flat, _ = mlx_flash.load(smollm2, resident_dtype="float32")
    assert not native_modules(flat)
    assert held.runtime.resident.held_bytes < flat.runtime.resident.held_bytes / 3
    x = mx.array([tok.encode("The capital of France is")])
    assert mx.abs(held(x) - flat(x)).max().item() < 1e-4
    from mlx_lm.generate import generate

    a = generate(held, tok, "Tell me about the sea.", max_tokens=12, verbose=False)
    b = generate(flat, tok, "Tell me about the sea.", max_tokens=12, verbose=False)
    assert a == b


def test_without_the_kernels_the_cpu_default_dequantizes(monkeypatch):
    assert keep_quantized(FlashConfig(), on_cpu=True)
    monkeypatch.setenv("MLX_FLASH_NO_NATIVE", "1")
    assert not keep_quantized(FlashConfig(), on_cpu=True)
    assert keep_quantized(FlashConfig(memory_budget="50%"), on_cpu=True)
    assert keep_quantized(FlashConfig(), on_cpu=False)


def test_a_forked_child_gets_its_own_threads():
    """Threads do not survive fork(): the child must start its own pool, not wait on the parent's."""
    code = (
        "import os, numpy as np, mlx.core as mx\n"
        "from mlx_flash.kernels import QuantMatrix, kernels_module\n"
        "k, _ = kernels_module(); k.set_threads(2)\n"
        "wq, s, b = mx.quantize(mx.ones((64, 64)), group_size=64, bits=4)\n"
        "q = QuantMatrix(k, wq, s, b, 4, 64); x = np.ones(64, np.float32)\n"
        "a = q.matvec(x)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if np.allclose(q.matvec(x), a) else 3)\n"
        "_, st = os.waitpid(pid, 0); raise SystemExit(os.waitstatus_to_exitcode(st))\n")
    r = subprocess.run([sys.executable, "-c", code], timeout=60, env=os.environ | {"PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0


def test_a_fork_while_another_thread_multiplies_leaves_the_child_a_working_pool():
    """A fork while another thread's product runs (its GIL released, the pool's call lock held):
    the child keeps only the forking thread, so a lock held then stayed held in the child, and
    its first product waited forever. The fork now waits for the product in flight. 30 forks
    beside a thread that multiplies without pause; each child multiplies once and must finish."""
    code = (
        "import os, threading, time, numpy as np, mlx.core as mx\n"
        "from mlx_flash.kernels import QuantMatrix, kernels_module\n"
        "k, _ = kernels_module(); k.set_threads(2)\n"
        "wq, s, b = mx.quantize(mx.random.normal((2048, 2048), key=mx.random.key(1)), group_size=64, bits=4)\n"
        "q = QuantMatrix(k, wq, s, b, 4, 64); x = np.random.default_rng(0).standard_normal(2048).astype(np.float32)\n"
        "want = q.matvec(x); stop = False\n"
        "def spin():\n"
        "    while not stop: q.matvec(x)\n"
        "t = threading.Thread(target=spin); t.start()\n"
        "hung = bad = 0\n"
        "for i in range(30):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0 if np.array_equal(q.matvec(x), want) else 3)\n"
        "    end = time.monotonic() + 10\n"
        "    while True:\n"
        "        done, st = os.waitpid(pid, os.WNOHANG)\n"
        "        if done: bad += os.waitstatus_to_exitcode(st) != 0; break\n"
        "        if time.monotonic() > end: os.kill(pid, 9); os.waitpid(pid, 0); hung += 1; break\n"
        "        time.sleep(0.01)\n"
        "stop = True; t.join()\n"
        "print('hung', hung, 'bad', bad)\n"
        "raise SystemExit(1 if hung or bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], timeout=400, capture_output=True, text=True,
                       env=os.environ | {"PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("spin_us", ["0", "200"])
def test_shared_jobs_wake_workers_that_spin_or_sleep(spin_us):
    """Workers spin for MLX_FLASH_KERNEL_SPIN_US after a job, then sleep: jobs that come at once,
    and after pauses longer than the spin, all run on both threads and give one thread's result."""
    code = (
        "import time, numpy as np, mlx.core as mx\n"
        "from mlx_flash.kernels import QuantMatrix, kernels_module\n"
        "k, _ = kernels_module()\n"
        "wq, s, b = mx.quantize(mx.random.normal((1024, 1024), key=mx.random.key(1)), group_size=64, bits=4)\n"
        "q = QuantMatrix(k, wq, s, b, 4, 64); x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)\n"
        "k.set_threads(1); want = q.matvec(x); k.set_threads(2)\n"
        "for i in range(200):\n"
        "    assert np.array_equal(q.matvec(x), want), i\n"
        "    if i % 20 == 0: time.sleep(0.002)\n")
    env = os.environ | {"PYTHONWARNINGS": "ignore", "MLX_FLASH_KERNEL_SPIN_US": spin_us}
    r = subprocess.run([sys.executable, "-c", code], timeout=60, env=env)
    assert r.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="workers are pinned on Linux, with two CPUs or more")
def test_workers_are_pinned_off_the_callers_cpu():
    """On Linux each worker runs on a CPU of its own other than the caller's, and the one on the
    caller's new CPU moves when the caller has moved (stop 47: a worker woken on the caller's
    CPU halves a product); the same values pinned or not; set_pinning(False), more threads than
    CPUs and MLX_FLASH_KERNEL_PIN=0 leave them free."""
    code = (
        "import os, sys, numpy as np, mlx.core as mx\n"
        "from mlx_flash.kernels import QuantMatrix, kernels_module\n"
        "k, _ = kernels_module(); cpus = sorted(os.sched_getaffinity(0)); n = min(len(cpus), 8)\n"
        "wq, s, b = mx.quantize(mx.random.normal((1024, 1024), key=mx.random.key(1)), group_size=64, bits=4)\n"
        "q = QuantMatrix(k, wq, s, b, 4, 64); x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)\n"
        "def workers():\n"
        "    ts = [int(t) for t in os.listdir('/proc/self/task')\n"
        "          if open(f'/proc/self/task/{t}/comm').read().strip() == 'mlxf-kernels']\n"
        "    return [sorted(os.sched_getaffinity(t)) for t in ts]\n"
        "k.set_threads(1); want = q.matvec(x)\n"
        "k.set_threads(n); assert np.array_equal(q.matvec(x), want)\n"
        "if sys.argv[1] == 'off':\n"
        "    assert k.pinning() is False and workers() == [cpus] * (n - 1), workers(); raise SystemExit(0)\n"
        "assert k.pinning() is True\n"
        "for me in (cpus[0], cpus[-1], cpus[0]):\n"
        "    os.sched_setaffinity(0, {me})  # (this thread only: the caller)\n"
        "    assert np.array_equal(q.matvec(x), want)\n"
        "    w = workers()\n"
        "    assert len(w) == n - 1 and all(len(c) == 1 and c[0] != me and c[0] in cpus for c in w), (me, w)\n"
        "    assert len({c[0] for c in w}) == len(w), w\n"
        "os.sched_setaffinity(0, set(cpus))\n"
        "assert k.set_pinning(False) is False and workers() == [cpus] * (n - 1), workers()\n"
        "assert np.array_equal(q.matvec(x), want) and workers() == [cpus] * (n - 1)\n"
        "k.set_pinning(True); os.sched_setaffinity(0, set(cpus[:2])); k.set_threads(3)\n"
        "assert np.array_equal(q.matvec(x), want)\n"
        "assert workers() == [cpus[:2]] * 2, workers()  # more threads than CPUs: none pinned\n")
    for mode, env in (("on", {}), ("off", {"MLX_FLASH_KERNEL_PIN": "0"})):
        r = subprocess.run([sys.executable, "-c", code, mode], timeout=60, capture_output=True, text=True,
                           env=os.environ | {"PYTHONWARNINGS": "ignore"} | env)
        assert r.returncode == 0, (mode, r.stderr[-2000:])


def test_a_product_is_cut_into_parts_that_each_thread_takes():
    """A shared product over rows is cut into up to 8 parts a thread (set_parts changes it), each
    of a quarter-million weights or more; over columns into one a thread; each part runs once, on
    whichever thread takes it, the workers too (parts_taken)."""
    from mlx_flash.plan.measure import ffn_rows
    from mlx_flash.kernels import qaxpy_cols

    wq, s, b = mx.quantize(mx.random.normal((4096, 1024), key=mx.random.key(1)), group_size=64, bits=4)
    q = QuantMatrix(kernels, wq, s, b, 4, 64)
    x = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    f = ffn_rows(1024, 1024, 4, 1)
    h = np.random.default_rng(1).standard_normal(1024).astype(np.float32)
    small = QuantMatrix(kernels, *mx.quantize(mx.random.normal((512, 512), key=mx.random.key(2)), group_size=64,
                                              bits=4), 4, 64)

    def taken(fn):
        before = kernels.parts_taken()
        fn()
        return sum(kernels.parts_taken()) - sum(before)
    try:
        kernels.set_threads(2)
        assert taken(lambda: q.matvec(x)) == 16  # 4 M weights: 16 parts of 256 K
        assert kernels.set_parts(1) == 1 and taken(lambda: q.matvec(x)) == 2
        assert kernels.set_parts(64) == 64 and taken(lambda: q.matvec(x)) == 16  # parts of 256 K weights at the least
        assert kernels.set_parts(0) == 8
        assert taken(lambda: qaxpy_cols(kernels, h, f.layers[0][1], f.sel, f.trow, f.table, f.spec)) == 2
        assert taken(lambda: small.matvec(x[:512])) == 0  # below a million weights: the caller alone, uncounted
        if len(os.sched_getaffinity(0)) >= 2:  # the workers take parts too (they spin between products)
            before = kernels.parts_taken()
            for _ in range(200):
                q.matvec(x)
            assert sum(kernels.parts_taken()[1:]) > sum(before[1:])
        kernels.set_threads(3)
        q.matvec(x)
        assert len(kernels.parts_taken()) == 3 and sum(kernels.parts_taken()) == 16  # a new pool, counted anew
    finally:
        kernels.set_parts(0)
        kernels.set_threads(default_threads())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a worker slowed by SCHED_IDLE: Linux")
def test_a_slow_worker_takes_fewer_parts():
    """A worker that barely runs (SCHED_IDLE, on the caller's own CPU: it runs only when the caller
    waits) takes few of the products' parts and the caller the rest, where a fixed share each took
    half (stop 48); the values are one thread's."""
    code = (
        "import os, numpy as np, mlx.core as mx\n"
        "from mlx_flash.kernels import QuantMatrix, kernels_module\n"
        "k, _ = kernels_module(); me = min(os.sched_getaffinity(0))\n"
        "wq, s, b = mx.quantize(mx.random.normal((8192, 4096), key=mx.random.key(1)), group_size=64, bits=4)\n"
        "q = QuantMatrix(k, wq, s, b, 4, 64); x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)\n"
        "k.set_threads(1); want = q.matvec(x)\n"
        "k.set_threads(2); k.set_pinning(False); q.matvec(x)  # (the test places the worker itself)\n"
        "tid = next(int(t) for t in os.listdir('/proc/self/task')\n"
        "           if open(f'/proc/self/task/{t}/comm').read().strip() == 'mlxf-kernels')\n"
        "os.sched_setaffinity(0, {me}); os.sched_setaffinity(tid, {me})\n"
        "os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))  # runs when the caller does not\n"
        "before = k.parts_taken()\n"
        "for _ in range(20): assert np.array_equal(q.matvec(x), want)\n"
        "caller, worker = (a - b for a, b in zip(k.parts_taken(), before))\n"
        "assert caller + worker == 20 * 16 and caller > 4 * worker, (caller, worker)\n")
    r = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True,
                       env=os.environ | {"PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-2000:]


def test_gather_products_equal_numpy(simd_and_threads):
    from mlx_flash.kernels import gather_axpy, gather_mv

    rng = np.random.default_rng(0)
    w = rng.standard_normal((50, 200)).astype(np.float32)
    sel = np.array([3, 49, 0, 17, 17, 8], np.int64)
    x = rng.standard_normal(200).astype(np.float32)
    h = rng.standard_normal(sel.size).astype(np.float32)
    for simd, threads in simd_and_threads:
        kernels.simd(simd)
        kernels.set_threads(threads)
        np.testing.assert_allclose(gather_mv(kernels, x, w, sel), w[sel] @ x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gather_axpy(kernels, h, w, sel), h @ w[sel], rtol=1e-5, atol=1e-5)
        assert gather_mv(kernels, x, w, sel[:0]).shape == (0,)
        assert not gather_axpy(kernels, h[:0], w, sel[:0]).any()
    with pytest.raises(ValueError, match="out of range"):
        gather_mv(kernels, x, w, np.array([50], np.int64))
    with pytest.raises(ValueError, match="gather_axpy"):
        gather_axpy(kernels, h, w, sel[:2])


@pytest.mark.parametrize("code", [1, 2])  # float16, bfloat16
def test_16_bit_rows_give_the_float32_rows_sums_to_the_bit(code, simd_and_threads):
    # a held (16-bit) matrix's products: each value converted as it is read, then the very
    # sums of its float32 rows (tails of every length)
    from mlx_flash.kernels import gather_axpy, gather_mv

    rng = np.random.default_rng(1)
    # (700 x 1536: past the values a job must touch to be shared out over the threads)
    for n, k in ((7, 1), (33, 31), (64, 577), (300, 1536), (700, 1536)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        w[0, 0], w[-1, -1] = 6e4, -3e-5  # float16's large values and subnormals
        w16 = w.astype(np.float16) if code == 1 else (w.view(np.uint32) >> 16).astype(np.uint16)
        w32 = w16.astype(np.float32) if code == 1 else (w16.astype(np.uint32) << 16).view(np.float32)
        sel = rng.permutation(n)[: max(1, n - 3)].astype(np.int64)
        x = rng.standard_normal(k).astype(np.float32)
        h = rng.standard_normal(sel.size).astype(np.float32)
        for simd, threads in simd_and_threads:
            kernels.simd(simd)
            kernels.set_threads(threads)
            got, want = gather_mv(kernels, x, w16, sel), gather_mv(kernels, x, w32, sel)
            assert (got == want).all()
            np.testing.assert_allclose(got, w32[sel].astype(np.float64) @ x, rtol=1e-4, atol=1e-3)
            out = rng.standard_normal(k).astype(np.float32)
            got = gather_axpy(kernels, h, w16, sel, out=out.copy())
            assert (got == gather_axpy(kernels, h, w32, sel, out=out.copy())).all()
            np.testing.assert_allclose(got, out + h @ w32[sel].astype(np.float64), rtol=1e-4, atol=1e-2)
    with pytest.raises(ValueError, match="gather_mv"):
        kernels.gather_mv(x, w16, sel, np.empty(sel.size, np.float32), k + 1, False, code)
    with pytest.raises(ValueError, match="gather_axpy"):
        kernels.gather_axpy(h, w16, sel, np.empty(k, np.float32), k, False, 3)  # no such code


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_a_16_bit_held_linear_decodes_through_the_kernel_as_through_the_arena(dtype, monkeypatch):
    from mlx_flash.kernels import batched
    from mlx_flash.models.half import Arena, HalfLinear

    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((96, 80)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal(96).astype(np.float32))
    arena = Arena(1024)
    native, plain = HalfLinear(w, b, arena, kernels), HalfLinear(w, b, arena)
    tiles = []
    real = HalfLinear.matmul
    monkeypatch.setattr(HalfLinear, "matmul", lambda self, v: tiles.append(v.shape) or real(self, v))
    # a decode step, a small pass, a prompt, a batch's decode step (the pass kernels' tiles)
    for shape in ((1, 1, 80), (1, 3, 80), (1, 9, 80), (8, 1, 80)):
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        want = x @ w.astype(mx.float32).T + b
        np.testing.assert_allclose(np.array(native(x)), np.array(want), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.array(plain(x)), np.array(want), rtol=1e-5, atol=1e-4)
    assert tiles == ([(8, 80)] if batched(kernels) else [])  # the batch's step only (the prompt: the arena)


@pytest.mark.parametrize("options", [dict(sparsity="oracle", density=0.5),
                                     dict(sparsity="oracle", density=0.5, overlap=True)])
def test_flash_decode_on_the_active_rows_equals_the_masked_window(smollm2, options):
    """One token in flash mode computes on its active rows only (FFNRows.select): the same
    logits as the masked product over the whole window, token after token."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = mlx_flash.load(smollm2, mode="flash", **options)  # float32 rows: flash's default
    store = model.runtime.store
    assert store.kernels is not None and store.packed is None
    prompt = mx.array([tok.encode("Write a short poem about rivers")])
    outs = []
    for kernels_on in (True, False):
        store.kernels = kernels if kernels_on else None
        cache = make_prompt_cache(model)
        y = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
        logits = []
        for _ in range(6):
            out = model(y[:, None], cache=cache)[:, -1]
            logits.append(out)
            y = mx.argmax(out, axis=-1)
        outs.append(mx.concatenate(logits))
        for c in store.caches:  # the second pass starts from empty caches too
            c.delete(c.cached_ids())
    assert mx.abs(outs[0] - outs[1]).max().item() < 1e-4


def _decode_logits(model, tok, n=4):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = model(mx.array([tok.encode("The quick brown fox jumps over")]), cache=cache)[:, -1]
    outs = [out]
    for _ in range(n):
        out = model(mx.argmax(out, axis=-1)[:, None], cache=cache)[:, -1]
        outs.append(out)
    return mx.concatenate(outs)


@pytest.mark.parametrize("options", [dict(mode="dense"), dict(mode="naive"), dict(mode="hybrid", prefetch=False),
                                     dict(mode="flash", sparsity="oracle", density=0.5, ffn_rows="quantized"),
                                     dict(mode="flash", sparsity="oracle", density=0.5, overlap=True,
                                          ffn_rows="quantized")])
def test_packed_rows_equal_dequantized_rows(smollm2, options):
    """A quantized model's FFN rows held at their bits (the CPU's default for dense / naive / hybrid:
    packed caches, computed by qmv_rows / qaxpy_cols) give the logits of the rows dequantized
    on read, prompt and decode, at 1/7 of the DRAM."""
    packed, tok = mlx_flash.load(smollm2, **options)
    flat, _ = mlx_flash.load(smollm2, **(options | dict(ffn_rows="float32")))
    assert packed.runtime.store.packed is not None and flat.runtime.store.packed is None
    assert packed.runtime.plan.ffn_dram_bytes < flat.runtime.plan.ffn_dram_bytes / 5
    assert mx.abs(_decode_logits(packed, tok) - _decode_logits(flat, tok)).max().item() < 1e-4


def test_ffn_rows_quantized_is_refused_where_it_cannot_run(smollm2, tmp_path):
    from mlx_flash.errors import FlashError

    with pytest.raises(FlashError, match="--ffn-rows quantized needs"):
        mlx_flash.load(smollm2, mode="naive", ffn_rows="quantized", dtype="float16")


def test_qmv_rows_and_qaxpy_cols_check_their_indices():
    from mlx_flash.kernels import qaxpy_cols, qmv_rows
    from mlx_flash.layout.quant import QuantSpec

    spec = QuantSpec(4, 32, "float16")
    buf = np.zeros((4, 64 * 4 // 8 + 2 * 2 * 2), np.uint8)  # 4 rows of 64 values + 2 scales + 2 biases
    x = np.ones(64, np.float32)
    assert qmv_rows(kernels, x, buf, np.array([0, 3]), spec, 32, 36).shape == (2,)
    with pytest.raises(ValueError, match="out of range"):
        qmv_rows(kernels, x, buf, np.array([4]), spec, 32, 36)
    tables = (np.ones((2, 64), np.float16), np.zeros((2, 64), np.float16))
    h = np.ones(2, np.float32)
    assert qaxpy_cols(kernels, h, buf, np.array([0, 1]), np.array([0, 1]), tables, spec).shape == (64,)
    with pytest.raises(ValueError, match="ordered"):
        qaxpy_cols(kernels, h, buf, np.array([0, 1]), np.array([1, 0]), tables, spec)


@pytest.mark.parametrize("bits", [4, 8])
def test_column_sums_continue_a_previous_part_to_the_bit(bits, simd_and_threads):
    """qaxpy_cols / gather_axpy with `out`: the rows of two parts, the first a whole number of
    groups, give what one call over all of them gives, on any threads (hybrid's parity)."""
    from mlx_flash.kernels import gather_axpy, qaxpy_cols
    from mlx_flash.layout.quant import QuantSpec

    rng = np.random.default_rng(bits)
    spec = QuantSpec(bits, 32, "float16")
    n, d = 160, 96
    buf = rng.integers(0, 256, (n, d * bits // 8), dtype=np.uint8)
    tables = tuple(rng.standard_normal((n // 32, d)).astype(np.float16) for _ in range(2))
    h = rng.standard_normal(n).astype(np.float32)
    rows, trow = np.arange(n), np.arange(n) // 32
    w = rng.standard_normal((n, d)).astype(np.float32)
    for simd, threads in simd_and_threads:
        kernels.simd(simd)
        kernels.set_threads(threads)
        whole = qaxpy_cols(kernels, h, buf, rows, trow, tables, spec)
        part = qaxpy_cols(kernels, h[:64], buf, rows[:64], trow[:64], tables, spec)
        got = qaxpy_cols(kernels, h[64:], buf, rows[64:], trow[64:], tables, spec, out=part)
        assert got is part and np.array_equal(got, whole)
        whole = gather_axpy(kernels, h, w, rows)
        got = gather_axpy(kernels, h[50:], w, rows[50:], out=gather_axpy(kernels, h[:50], w, rows[:50]))
        assert np.array_equal(got, whole)


@pytest.mark.parametrize("bits", [4, 8])
def test_column_sums_over_runs_of_any_length_equal_the_portable_loops(bits, simd_and_threads):
    """qaxpy_cols's SIMD loop takes a run's rows (those sharing a table row) four at a time: runs
    of 1 to 9 rows, scattered over the buffer as a cache's are, give the portable loops' sums to
    the bit on every level and thread count."""
    from mlx_flash.kernels import qaxpy_cols
    from mlx_flash.layout.quant import QuantSpec

    rng = np.random.default_rng(7 + bits)
    spec = QuantSpec(bits, 32, "float16")
    n, d = 320, 128
    buf = rng.integers(0, 256, (n, d * bits // 8), dtype=np.uint8)
    tables = tuple(rng.standard_normal((n // 32, d)).astype(np.float16) for _ in range(2))
    runs = [rng.choice(np.arange(t * 32, t * 32 + 32), size=k, replace=False)
            for t, k in enumerate([1, 2, 3, 4, 5, 6, 7, 9, 8, 3])]
    sel = np.concatenate(runs)
    trow = sel // 32
    h = rng.standard_normal(sel.size).astype(np.float32)
    got = []
    for simd, threads in simd_and_threads:
        kernels.simd(simd)
        kernels.set_threads(threads)
        got.append((simd, qaxpy_cols(kernels, h, buf, sel, trow, tables, spec)))
    portable = [y for simd, y in got if simd == 0]
    # (level 3 sums in integers: float32's rounding, not the float loops' bits, see the next test)
    assert portable and all(np.array_equal(y, portable[0]) for simd, y in got if simd < 3)
    want, scale = _column_sums_f64(h, buf, sel, trow, tables, bits)
    assert all(np.all(np.abs(y - want) <= 1e-6 * scale) for simd, y in got if simd == 3)


def _column_sums_f64(h, buf, sel, trow, tables, bits, biases=True):
    """qaxpy_cols's sums in float64, and what float32's rounding of them is relative to: every
    loop sums ts * (sum_i h_i q_i) + tb * (sum_i h_i), so sum_i |h_i| (|ts q_i| + |tb|)"""
    q = np.stack([buf & 15, buf >> 4], -1).reshape(buf.shape[0], -1) if bits == 4 else buf
    ts, tb = (np.asarray(t.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if t.dtype == np.uint16 else t
              for t in tables)
    scaled, bias = ts[trow].astype(np.float64) * q[sel], tb[trow].astype(np.float64) * biases
    return h.astype(np.float64) @ (scaled + bias), np.abs(h.astype(np.float64)) @ (np.abs(scaled) + np.abs(bias))


@pytest.mark.skipif(SIMD_TOP < 3, reason="the CPU has no AVX-512 VNNI (SIMD level 3)")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_vnni_columns_keep_float32_precision_on_adversarial_h(bits, group):
    """Level 3 (vnni_cols.h, where the CPU has VBMI) writes a run's h (the columns sharing a table
    row) as three signed 8-bit digits over one power-of-two unit, 4 columns' values against them
    in each vpdpbusd: every output within float32's rounding of the float64 sums, each h taken
    to float32's rounding of its run's largest (where the float loops round each product to
    itself: an outlier's run holds its neighbours to 2^-23 of it), for h with
    outliers, zeros, values near 1e-30, subnormals or 1e30, units at their edge, one sign
    throughout; runs of 1 to a whole group scattered as a cache's, outputs a whole number of 64
    and not, tables at float16, bfloat16 and float32, one and two threads; a part continued by
    another at a table row gives one call's sums to the bit. An infinity or a NaN in h takes
    the float loops (their values to the bit)."""
    from mlx_flash.kernels import qaxpy_cols
    from mlx_flash.layout.quant import QuantSpec

    rng = np.random.default_rng(bits * 1000 + group)
    groups = 6
    n = groups * group
    lengths = [1, 3, 4, 5, group - 1, group]
    sel = np.concatenate([t * group + rng.choice(group, size=k, replace=False) for t, k in enumerate(lengths)])
    trow = sel // group
    m = sel.size
    try:
        for d, dtype in ((96, "float16"), (256, "bfloat16"), (160, "float32")):
            spec = QuantSpec(bits, group, dtype)
            buf = rng.integers(0, 256, (n, d * bits // 8), dtype=np.uint8)
            table = (rng.standard_normal((groups, d)) * 0.05).astype(np.float32)
            if dtype == "bfloat16":
                tables = tuple((table.view(np.uint32) >> 16).astype(np.uint16) + i for i in range(2))
            else:
                tables = tuple(table.astype(dtype) + np.asarray(0.01 * i, dtype) for i in range(2))
            for name, h in _adversarial_x(rng, 1 << (m - 1).bit_length()).items():
                h = np.ascontiguousarray(h[:m])
                want, scale = _column_sums_f64(h, buf, sel, trow, tables, bits)
                # each h within 2^-23 of its run's largest (its digits' unit), where the float loops
                # round each product to itself: those errors, over the columns' scaled values
                largest = np.zeros(groups)
                np.maximum.at(largest, trow, np.abs(h.astype(np.float64)))
                digits = _column_sums_f64(largest[trow], buf, sel, trow, tables, bits, biases=False)[1]
                for threads in (1, 2):
                    kernels.simd(3)
                    kernels.set_threads(threads)
                    got = qaxpy_cols(kernels, h, buf, sel, trow, tables, spec)
                    # (plus 4 of float32's least subnormal a run: where the outputs are subnormal
                    # themselves, each run's multiplies and adds round to it, as any float32 sums)
                    floor = 4 * len(lengths) * np.float64(2.0 ** -149)
                    assert np.all(np.abs(got - want) <= 1e-6 * scale + 2.0 ** -22 * digits + floor), \
                        (d, dtype, name, threads)
                    cut = sum(lengths[:3])  # (three whole runs, then the rest continuing their sums)
                    part = qaxpy_cols(kernels, h[:cut], buf, sel[:cut], trow[:cut], tables, spec)
                    assert np.array_equal(qaxpy_cols(kernels, h[cut:], buf, sel[cut:], trow[cut:], tables, spec,
                                                     out=part), got), (d, dtype, name, threads)
            for bad in (np.inf, np.nan):
                h = rng.standard_normal(m).astype(np.float32)
                h[m // 2] = bad
                kernels.simd(2)
                want = qaxpy_cols(kernels, h, buf, sel, trow, tables, spec)
                kernels.simd(3)
                assert np.array_equal(qaxpy_cols(kernels, h, buf, sel, trow, tables, spec), want, equal_nan=True)
    finally:
        kernels.simd(SIMD_TOP)
        kernels.set_threads(default_threads())


def test_the_pool_survives_resizing():
    """Workers started after a resize wait for the next job (they once took the stop signal of
    the workers before them and exited, and the next call waited forever)."""
    wq, s, b = mx.quantize(mx.random.normal((512, 256)), group_size=64, bits=4)
    q = QuantMatrix(kernels, wq, s, b, 4, 64)
    x = np.ones(256, np.float32)
    want = q.matvec(x)
    try:
        for n in (2, 1, 3, 2, 2, 4):
            kernels.set_threads(n)
            for _ in range(3):
                np.testing.assert_allclose(q.matvec(x), want, rtol=1e-5)
    finally:
        kernels.set_threads(default_threads())


def test_dequantized_packed_rows_equal_the_reader_s_values(smollm2):
    """dequantize_rows / dequantize_cols (a prompt over packed rows) give the values the reader
    writes when it dequantizes the same bundles on read (--ffn-rows float32), bit for bit."""
    from mlx_flash.kernels import dequantize_cols, dequantize_rows

    packed, _ = mlx_flash.load(smollm2, mode="naive", prefetch=False)
    flat, _ = mlx_flash.load(smollm2, mode="naive", prefetch=False, ffn_rows="float32")
    ps, fs = packed.runtime.store, flat.runtime.store
    x = mx.zeros((1, 1, ps.layout.d_model))
    for s in (ps, fs):
        s.rows(0, x)  # layer 0's bundles into the streaming buffer
    buf, lay = ps.buffers[0], ps.layout
    spec, d = lay.quant, lay.d_model
    sel = np.arange(buf.num_used, dtype=np.int64)
    ids = buf.row_to_id[sel]
    raw = {k: v.view(np.uint8) for k, v in buf.views.items()}
    soff = spec.packed_bytes(d)
    boff = soff + (d // spec.group_size) * 2
    want = {k: fs.buffers[0].views[k][fs.buffers[0].id_to_row[ids]] for k in lay.kinds}
    for k in lay.kinds:
        if k in lay.columns:
            got = dequantize_cols(kernels, raw[k], sel, ids // spec.group_size, ps.tables[0][k], spec)
        else:
            got = dequantize_rows(kernels, raw[k], sel, spec, soff, boff, d)
        assert np.array_equal(got, want[k]), k


def test_the_pool_gets_its_threads_on_first_use():
    """kernels_module() sizes the pool (it once stayed at one thread outside the tests, which
    set it themselves)."""
    code = ("from mlx_flash.kernels import default_threads, kernels_module\n"
            "k, _ = kernels_module()\n"
            "assert k.threads() == default_threads(), (k.threads(), default_threads())\n")
    r = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True,
                       env=os.environ | {"MLX_FLASH_KERNEL_THREADS": "3"})
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_dequantized_rows_and_columns_are_the_same_values_with_simd(bits, scale_dtype, simd_and_threads):
    """The prompt path's dequantization and the decode path's column sums (qaxpy_cols, a part
    continued by another), 32 values a step in registers, give the portable loops' values to the
    bit (the same multiplies, then adds), rows and columns, at every scale dtype."""
    from mlx_flash.kernels import dequantize_cols, dequantize_rows, qaxpy_cols
    from mlx_flash.layout.quant import QuantSpec

    rng = np.random.default_rng(bits)
    spec = QuantSpec(bits, 32, scale_dtype)
    size = 4 if scale_dtype == "float32" else 2
    n, d = 96, 256
    row_bytes = d * bits // 8
    soff, boff = row_bytes, row_bytes + size * d // 32
    rows_buf = rng.integers(0, 256, (n, boff + size * d // 32), dtype=np.uint8)
    scales = rng.standard_normal((n, 2 * d // 32)).astype(np.float32)
    held = scales.astype(np.float16) if size == 2 else scales  # (bfloat16: any 16-bit pattern is one)
    rows_buf[:, soff:] = held.view(np.uint8).reshape(n, -1)
    table = np.float16 if size == 2 else np.float32
    tables = tuple(rng.standard_normal((n // 32, d)).astype(table) for _ in range(2))
    cols_buf = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    sel, trow = rng.permutation(n), None
    trow = sel // 32
    h = rng.standard_normal(n).astype(np.float32)
    ordered = np.arange(n)  # (qaxpy_cols: rows ordered by table row)
    out = []
    for simd, threads in simd_and_threads:
        kernels.simd(simd)
        kernels.set_threads(threads)
        part = qaxpy_cols(kernels, h[:64], cols_buf, ordered[:64], ordered[:64] // 32, tables, spec)
        out.append((dequantize_rows(kernels, rows_buf, sel, spec, soff, boff, d),
                    dequantize_cols(kernels, cols_buf, sel, trow, tables, spec),
                    qaxpy_cols(kernels, h[64:], cols_buf, ordered[64:], ordered[64:] // 32, tables, spec, out=part)))
    as_held = tuple(t.view(np.uint16) for t in tables) if scale_dtype == "bfloat16" else tables
    want, scale = _column_sums_f64(h, cols_buf, ordered, ordered // 32, as_held, bits)
    portable = out[-1]
    for (simd, _), got in zip(simd_and_threads, out):
        # (level 3's column sums are integers': float32's rounding of them, not the float loops' bits)
        same = got if simd < 3 else got[:2]
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(same, portable)), simd
        assert simd < 3 or np.all(np.abs(got[2] - want) <= 1e-6 * scale), simd


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("positions", [5, 16, 23, 70, 256])
def test_a_pass_of_several_positions_equals_its_dequantized_rows_times_x(bits, positions, simd_and_threads):
    """qmm / qmm_rows / qmm_cols (a batch's decode step: each row dequantized once for every
    position) give the dequantized rows' products to float32's rounding, at every level and
    thread count, with uneven row counts (tiles of 8 rows and shares of 32 columns left over),
    positions past a tile of 16, and qmm_cols continuing a previous sum."""
    from mlx_flash.kernels import dequantize_cols, dequantize_rows, qmm_cols, qmm_rows
    from mlx_flash.layout.quant import QuantSpec

    rng = np.random.default_rng(bits * 100 + positions)
    spec = QuantSpec(bits, 32, "float16")
    n, d = 77, 256  # 77 rows: 9 tiles of 8 and 5 over
    row_bytes = d * bits // 8
    soff, boff = row_bytes, row_bytes + 2 * d // 32
    rows_buf = rng.integers(0, 256, (n, boff + 2 * d // 32), dtype=np.uint8)
    rows_buf[:, soff:] = (rng.standard_normal((n, 2 * d // 32)) * 0.1).astype(np.float16).view(np.uint8).reshape(n, -1)
    tables = tuple((rng.standard_normal((n // 32 + 1, 224)) * 0.1).astype(np.float16) for _ in range(2))
    cols_buf = rng.integers(0, 256, (n, 224 * bits // 8), dtype=np.uint8)  # 224 outputs: 7 blocks of 32
    sel = rng.permutation(n)[:70]
    trow = sel // 32
    x = rng.standard_normal((positions, d)).astype(np.float32)
    h = rng.standard_normal((positions, sel.size)).astype(np.float32)
    w = (mx.random.normal((45, d), key=mx.random.key(bits)) * 0.05)
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    q = QuantMatrix(kernels, wq, s, b, bits, 32)
    want_mlx = np.array(mx.dequantize(wq, s, b, group_size=32, bits=bits)).astype(np.float64)

    def close(got, want):
        return np.abs(got - want).max() <= 2e-6 * np.abs(want).max() * np.sqrt(want.shape[-1])

    want_rows = x.astype(np.float64) @ dequantize_rows(kernels, rows_buf, sel, spec, soff, boff, d).T.astype(np.float64)
    cols = dequantize_cols(kernels, cols_buf, sel, trow, tables, spec).astype(np.float64)
    start = rng.standard_normal((positions, 224)).astype(np.float32)
    want_cols = start + h.astype(np.float64) @ cols
    want_q = x[:, :d].astype(np.float64) @ want_mlx.T
    for simd, threads in simd_and_threads:
        kernels.simd(simd)
        kernels.set_threads(threads)
        assert close(qmm_rows(kernels, x, rows_buf, sel, spec, soff, boff), want_rows), (simd, threads)
        assert close(qmm_cols(kernels, h, cols_buf, sel, trow, tables, spec, out=start.copy()), want_cols), (simd, threads)
        assert close(q.matmul(x), want_q), (simd, threads)
    with pytest.raises(ValueError, match="qmm_rows: arguments"):
        kernels.qmm_rows(np.ascontiguousarray(x[:, :100]), rows_buf, rows_buf.strides[0], soff, boff, sel.astype(np.int64),
                         np.empty((positions, sel.size), np.float32), d, bits, 32, 1)
    with pytest.raises(ValueError, match="out of range"):
        qmm_cols(kernels, np.ascontiguousarray(h[:, :2]), cols_buf, np.array([0, n]), np.array([0, 0]), tables, spec)
    empty = qmm_cols(kernels, h[:, :0], cols_buf, sel[:0], trow[:0], tables, spec)
    assert empty.shape == (positions, 224) and not empty.any()
    if SIMD_TOP >= 2:  # AVX2's tiles run AVX-512's operations lane for lane: the same bits
        other = []  # bfloat16 and float32 tables, sums not a whole number of runs
        for scale, k in (("bfloat16", 96), ("float32", 160)):
            t = tuple(rng.standard_normal((n // 32 + 1, k)).astype(np.float32) for _ in range(2))
            if scale == "bfloat16":
                t = tuple(np.ascontiguousarray((a.view(np.uint32) >> 16).astype(np.uint16)) for a in t)
            other.append((QuantSpec(bits, 32, scale), k, t, np.ascontiguousarray(cols_buf[:, : k * bits // 8])))
        got = []
        for level in (2, 1):
            kernels.simd(level)
            got.append((qmm_rows(kernels, x, rows_buf, sel, spec, soff, boff),
                        qmm_cols(kernels, h, cols_buf, sel, trow, tables, spec, out=start.copy()), q.matmul(x)))
            for s_spec, k, t, buf in other:
                got[-1] += (qmm_cols(kernels, h, buf, sel, trow, t, s_spec),
                            qmm_rows(kernels, np.ascontiguousarray(x[:, :k]), rows_buf, sel, spec, soff, boff))
        kernels.simd(SIMD_TOP)
        assert all(np.array_equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("code", [0, 1, 2])  # float32, float16, bfloat16 rows
@pytest.mark.parametrize("positions", [5, 16, 23, 70])
def test_a_16_bit_pass_equals_its_rows_times_x(code, positions, simd_and_threads):
    """gather_mm / gather_mm_cols (a batch's decode step over rows held at 16 bits or float32:
    each row converted once, into the tile, for every position) give the float32 rows' products
    to float32's rounding at every level and thread count: uneven row counts (tiles of 8 rows, of
    64 columns), row lengths that are not whole registers (tails of 1..15 outputs), positions
    past a tile of 16, a sum continued from a previous part; each position within float32's
    rounding of its one-position product (gather_mv / gather_axpy); AVX2 the same bits as
    AVX-512 (but for widths that are not whole registers: the portable tail); bad arguments a
    clear error."""
    from mlx_flash.kernels import gather_axpy, gather_mm, gather_mm_cols, gather_mv

    rng = np.random.default_rng(code * 100 + positions)

    def close(got, want):
        return np.abs(got - want).max() <= 2e-6 * np.abs(want).max() * np.sqrt(want.shape[-1])

    cases = []
    # (tails of 5 and 9 values: whole registers of 8 and 16 at neither level; 700 x 1536 shared over threads)
    for n, k in ((77, 256), (150, 40), (13, 37), (9, 1001), (700, 1536)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        w16 = w if code == 0 else w.astype(np.float16) if code == 1 else (w.view(np.uint32) >> 16).astype(np.uint16)
        w32 = w16.astype(np.float32) if code == 1 else (w16.astype(np.uint32) << 16).view(np.float32) if code == 2 else w
        sel = rng.permutation(n)[: max(1, n - 7)].astype(np.int64)
        x = rng.standard_normal((positions, k)).astype(np.float32)
        h = rng.standard_normal((positions, sel.size)).astype(np.float32)
        start = rng.standard_normal((positions, k)).astype(np.float32)
        cases.append((w16, sel, x, h, start, x.astype(np.float64) @ w32[sel].T.astype(np.float64),
                      start + h.astype(np.float64) @ w32[sel].astype(np.float64)))
    got = {}
    for simd, threads in simd_and_threads:
        kernels.simd(simd)
        kernels.set_threads(threads)
        for i, (w16, sel, x, h, start, want_rows, want_cols) in enumerate(cases):
            rows = gather_mm(kernels, x, w16, sel)
            cols = gather_mm_cols(kernels, h, w16, sel, out=start.copy())
            assert close(rows, want_rows) and close(cols, want_cols), (simd, threads, w16.shape)
            if simd == 1:  # (whatever the threads: a row's or an output's sum is one share's)
                assert np.array_equal(rows, got.setdefault((i, "rows"), rows))
            got.setdefault((simd, i), (rows, cols))
            b = positions - 1
            one = gather_mv(kernels, x[b], w16, sel)
            assert np.abs(rows[b] - one).max() <= 2e-6 * np.abs(one).max() * np.sqrt(x.shape[1])
            one = gather_axpy(kernels, h[b], w16, sel, out=start[b].copy())
            assert np.abs(cols[b] - one).max() <= 2e-6 * np.abs(one).max() * np.sqrt(sel.size)
    if SIMD_TOP >= 2:  # AVX2's tiles run AVX-512's operations lane for lane (whole registers of 8)
        for i in range(len(cases)):
            if cases[i][0].shape[1] % 8 == 0:
                assert all(np.array_equal(a, b) for a, b in zip(got[2, i], got[1, i])), i
    w16, sel, x, h = cases[0][:4]
    with pytest.raises(ValueError, match="gather_mm: arguments"):
        kernels.gather_mm(x, w16, sel, np.empty((positions, sel.size + 1), np.float32), w16.shape[1], False, code)
    with pytest.raises(ValueError, match="gather_mm_cols: arguments"):
        kernels.gather_mm_cols(h, w16, sel[:0], np.empty((positions, w16.shape[1]), np.float32), w16.shape[1],
                               False, code)
    with pytest.raises(ValueError, match="out of range"):
        gather_mm(kernels, x, w16, np.array([0, w16.shape[0]], np.int64))
    empty = gather_mm_cols(kernels, h[:, :0], w16, sel[:0])
    assert empty.shape == (positions, w16.shape[1]) and not empty.any()


def test_a_row_s_product_in_a_pass_does_not_depend_on_the_threads_or_the_split():
    """qmm_rows / qmm: a row's sums are the same bits whichever thread, or part of the rows the
    pool cut (set_parts), holds it (a last tile of fewer rows runs the same tile, zero-padded), so
    hybrid's parts give dense's values; and sizes that would overflow the checks are refused, not
    followed."""
    from mlx_flash.kernels import qmm_rows
    from mlx_flash.layout.quant import QuantSpec

    rng = np.random.default_rng(5)
    spec = QuantSpec(4, 32, "float16")
    n, d = 1203, 256  # 4.9 M multiply-adds at 16 positions: shared out, up to 18 parts
    soff, boff = d // 2, d // 2 + 2 * d // 32
    buf = rng.integers(0, 256, (n, boff + 2 * d // 32), dtype=np.uint8)
    buf[:, soff:] = (rng.standard_normal((n, 2 * d // 32)) * 0.1).astype(np.float16).view(np.uint8).reshape(n, -1)
    x = rng.standard_normal((16, d)).astype(np.float32)
    rows = np.arange(n)
    try:
        for level in range(SIMD_TOP + 1):
            kernels.simd(level)
            kernels.set_threads(1)
            whole = qmm_rows(kernels, x, buf, rows, spec, soff, boff)
            for threads in (2, 3, 5):
                kernels.set_threads(threads)
                for parts in (1, 3, 64):
                    kernels.set_parts(parts)
                    got = qmm_rows(kernels, x, buf, rows, spec, soff, boff)
                    assert np.array_equal(got, whole), (level, threads, parts)
            split = np.concatenate([qmm_rows(kernels, x, buf, rows[:601], spec, soff, boff),
                                    qmm_rows(kernels, x, buf, rows[601:], spec, soff, boff)], axis=1)
            assert np.array_equal(split, whole), level
    finally:
        kernels.simd(SIMD_TOP)
        kernels.set_threads(default_threads())
        kernels.set_parts(0)
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="parts a thread"):
            kernels.set_parts(bad)
    y = np.empty((1, 4), np.float32)
    for k in (2**62, 2**62 + 32):
        with pytest.raises(ValueError, match="qmm: arguments"):
            kernels.qmm(np.zeros(32, np.float32), np.zeros(64, np.uint8), np.zeros(128, np.uint8),
                        np.zeros(128, np.uint8), y, 4, k, 4, 32, 1)


@pytest.mark.parametrize("without", ["vnni", "avx512", "x86"])
def test_the_kernels_compile_where_the_cpu_lacks_avx512_or_is_not_x86(tmp_path, without):
    """_matvec.c with its AVX-512 VNNI part switched off (a compiler without it), with its AVX-512
    part switched off (an older compiler, a CPU level below it: VNNI goes with it) and with every
    x86 part off (Apple silicon, other CPUs) still compiles: a build that fails loses every native
    kernel silently (the extension is optional)."""
    import shutil
    import sysconfig
    from pathlib import Path

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(mlx_flash.__file__).parent / "kernels"
    for name in ("_matvec.c", "quant.h", "avx512.h", "vnni.h", "vnni_cols.h", "gemm16.h"):
        text = (src / name).read_text()
        switch = {"vnni.h": "#if defined(BF16_PATH) && defined(VNNI_COMPILER)",
                  "avx512.h": "#if defined(__x86_64__) && defined(BF16_COMPILER)",
                  "_matvec.c": "#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))"}.get(name)
        off = {"vnni": ("vnni.h",), "avx512": ("avx512.h",), "x86": ("avx512.h", "_matvec.c")}[without]
        if switch and name in off:
            assert text.count(switch) == 1, f"{name}: the line that switches its SIMD part on has changed"
            text = text.replace(switch, "#if 0")
        (tmp_path / name).write_text(text)
    # (compiled, not only parsed: GCC says a static function left unused only when it compiles)
    out = subprocess.run([cc, "-c", "-O0", "-o", os.devnull, "-Wall", "-Werror", "-ffp-contract=off",
                          f"-I{sysconfig.get_paths()['include']}", str(tmp_path / "_matvec.c")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

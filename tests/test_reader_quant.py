"""FlashReader: quantized segments, dequantized on copy (io.Quantized).

Real bundle files on a real disk (O_DIRECT), both pools, built from mx.quantize's
own outputs the way the FFN stores them: a neuron's gate and up rows (packed
values, then scales, then biases, inline) and its down column (packed values;
scales and biases in a table [n_ff / group_size, d_model] in memory).

Against MLX (0.32, CPU): with float32 scales the rows equal mx.dequantize bit
for bit. With float16 / bfloat16 scales MLX's CPU dequantize computes in the
scale dtype, rounding s * q and then (s * q) + b to it (checked below: its
output is exactly that), whereas the reader computes in float32 (exactly
layout.quant.dequantize). The two then differ by MLX's two roundings: up to
half an ulp (of the scale dtype) of s * q plus half an ulp of the result, which
where s * q and b cancel is many ulps of the (small) result; the test asserts
equality with layout.quant.dequantize and that bound against MLX.
"""

import numpy as np
import pytest

from mlx_flash.io import FlashReader, Quantized, native_available
from mlx_flash.layout import quant as Q
from test_reader import backend, disk_dir  # noqa: F401  (the fixtures: both pools, a real disk)

mx = pytest.importorskip("mlx.core")

SCALE_DTYPES = ("float32", "float16", "bfloat16")
D, N_FF = 256, 384  # row length (d_model) and bundles (neurons) per file


def _round_up(n, a):
    return (n + a - 1) // a * a


def _stored(a):
    """An MLX scales/biases array -> NumPy as stored in a file (bfloat16 as uint16)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def _f32(raw):
    """Stored scales (bfloat16 as uint16) -> float32, exactly."""
    if raw.dtype == np.uint16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _ulp(x, sd):
    """The spacing of the scale dtype at |x| (float32 array)."""
    x = np.abs(x).astype(np.float32)
    if sd == "float16":
        with np.errstate(over="ignore"):
            return np.spacing(x.astype(np.float16)).astype(np.float32)
    if sd == "bfloat16":
        return np.spacing(x) * np.float32(1 << 16)
    return np.spacing(x)


def _round_to(x, sd):
    """float32 -> the scale dtype (round to nearest even) -> float32."""
    if sd == "float16":
        return x.astype(np.float16).astype(np.float32)
    if sd == "bfloat16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)
    return x


def _quantize(w, bits, gs, sd):
    """float32 W [out, in] -> dict: packed (uint8 [out, in*bits/8]), scales/biases as stored,
    the MLX dequantization (float32), the float32 reference (layout.quant), and what MLX
    computes in the scale dtype."""
    wq, s, b = mx.quantize(mx.array(w).astype(getattr(mx, sd)), group_size=gs, bits=bits)
    mlx = mx.dequantize(wq, s, b, group_size=gs, bits=bits).astype(mx.float32)
    mx.eval(wq, s, b, mlx)
    packed = np.array(wq).view(np.uint8)
    s_raw, b_raw = _stored(s), _stored(b)
    n = w.shape[1]
    sq = np.repeat(_f32(s_raw), gs, -1) * Q.unpack(packed, bits, n).astype(np.float32)
    return dict(wq=np.array(wq), packed=packed, s=s_raw, b=b_raw, mlx=np.array(mlx),
                ref=Q.dequantize(packed, _f32(s_raw), _f32(b_raw), bits, gs, n),
                in_dtype=_round_to(_round_to(sq, sd) + np.repeat(_f32(b_raw), gs, -1), sd),
                bound=0.5 * _ulp(sq, sd) + 0.5 * _ulp(np.array(mlx), sd))


_layers = {}


def _layer(disk_dir, bits, gs, sd):
    """A layer file of N_FF bundles [gate row | up row | down column | padding], made once."""
    key = (bits, gs, sd)
    if key in _layers:
        return _layers[key]
    rng = np.random.default_rng(bits * 1000 + gs + len(sd))
    w = {"gate": rng.standard_normal((N_FF, D)) * 0.05, "up": rng.standard_normal((N_FF, D)) * 0.05,
         "down": rng.standard_normal((D, N_FF)) * 0.05}  # down [d_model, n_ff]: bundle i holds column i
    qd = {k: _quantize(v.astype(np.float32), bits, gs, sd) for k, v in w.items()}
    parts = [np.concatenate([qd[k]["packed"], qd[k]["s"].view(np.uint8), qd[k]["b"].view(np.uint8)], axis=1)
             for k in ("gate", "up")]
    parts.append(Q.columns(qd["down"]["wq"], bits, N_FF))  # [N_FF, D * bits / 8]
    row_bytes = parts[0].shape[1]
    assert row_bytes == Q.QuantSpec(bits, gs, sd).row_bytes(D)
    used = sum(p.shape[1] for p in parts)
    stride = _round_up(used, 512)
    buf = np.full((N_FF, stride), 0xAB, dtype=np.uint8)  # padding: not zeros
    buf[:, :used] = np.concatenate(parts, axis=1)
    path = disk_dir / f"qlayer_{bits}_{gs}_{sd}.bin"
    buf.tofile(path)
    # the down column's table, in the reader's orientation: [n_ff / group_size, d_model]
    table = tuple(np.ascontiguousarray(qd["down"][t].T) for t in ("s", "b"))
    want = {}
    for k in ("gate", "up", "down"):
        e = qd[k]
        if k == "down":  # columns as rows
            e = {f: (v.T if isinstance(v, np.ndarray) and v.shape == (D, N_FF) else v) for f, v in e.items()}
        want[k] = e
    lay = dict(path=path, stride=stride, row_bytes=row_bytes, used=used, table=table, want=want)
    _layers[key] = lay
    return lay


def _check_rows(got, want, sd, dst_dtype, what):
    """got: the reader's rows; want: _quantize's dict restricted to those rows."""
    ref, mlx = want["ref"], want["mlx"]
    if dst_dtype == np.float32:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{what}: != layout.quant"
    else:
        with np.errstate(over="ignore"):
            assert np.array_equal(got, ref.astype(np.float16)), f"{what}: != layout.quant as float16"
    if sd == "float32":  # MLX's CPU dequantize agrees bit for bit
        if dst_dtype == np.float32:
            assert np.array_equal(got.view(np.uint32), mlx.view(np.uint32)), f"{what}: != mx.dequantize"
        else:
            assert np.array_equal(got, mlx.astype(np.float16)), f"{what}: != mx.dequantize as float16"
        return
    # MLX computes in the scale dtype: exactly the double rounding, within its bound of ours
    assert np.array_equal(mlx, want["in_dtype"]), f"{what}: MLX's dequantize changed its arithmetic"
    slack = np.spacing(np.abs(got).astype(np.float32)) if dst_dtype == np.float32 else \
        np.spacing(np.abs(got).astype(np.float16)).astype(np.float32)
    err = np.abs(got.astype(np.float32) - mlx)
    assert (err <= want["bound"] + slack).all(), f"{what}: farther from mx.dequantize than its rounding"


@pytest.mark.parametrize("sd", SCALE_DTYPES)
@pytest.mark.parametrize("gs", Q.GROUP_SIZES)
@pytest.mark.parametrize("bits", Q.BITS)
def test_ffn_bundles_dequantize_as_mlx(disk_dir, backend, bits, gs, sd):
    lay = _layer(disk_dir, bits, gs, sd)
    rng = np.random.default_rng(bits + gs)
    ids = rng.choice(N_FF, 150, replace=False)  # unsorted, with gaps: reads coalesce
    ids[:3] = [N_FF - 1, 0, 1]
    cap = 200
    dst_rows = rng.choice(cap, len(ids), replace=False)
    with FlashReader(threads=4, backend=backend) as r:
        f = r.open(lay["path"], expected_size=N_FF * lay["stride"])
        for dst_dtype in (np.float32, np.float16):
            dst = {k: np.full((cap, D + 8), 7, dtype=dst_dtype) for k in ("gate", "up", "down")}
            rb = lay["row_bytes"]
            segs = [(0, D, Quantized(bits, gs, sd), dst["gate"]),
                    (rb, D, Quantized(bits, gs, sd), dst["up"]),
                    (2 * rb, D, Quantized(bits, gs, sd, lay["table"]), dst["down"])]
            r.stats.reset()
            r.read_bundles(f, ids, lay["stride"], segs, dst_rows)
            assert r.stats.bytes_requested == len(ids) * lay["used"]
            assert r.stats.reads_requested == len(ids) and r.stats.reads_issued < len(ids)
            for k, v in dst.items():
                want = {f_: (x[ids] if isinstance(x, np.ndarray) and x.shape == (N_FF, D) else x)
                        for f_, x in lay["want"][k].items()}
                _check_rows(v[dst_rows, :D], want, sd, dst_dtype, f"{k} {np.dtype(dst_dtype)}")
                untouched = np.setdiff1d(np.arange(cap), dst_rows)
                assert (v[untouched] == 7).all() and (v[dst_rows, D:] == 7).all()


@pytest.mark.parametrize("bits,n", [(2, 300), (3, 200), (4, 302), (5, 200), (6, 300), (8, 301)])
def test_columns_with_base_padded_table_and_float_neighbours(disk_dir, backend, bits, n):
    """Column form: any n with n*bits a whole number of bytes, a table wider than n, the
    table row from the id as passed (not base + id), a float16 segment beside it."""
    gs, sd = 32, "float16"
    rng = np.random.default_rng(bits)
    n_b = 200  # bundles in the part; T = 7 table rows (ids up to 199 -> row 6)
    q = rng.integers(0, 1 << bits, (n_b, n)).astype(np.uint8)
    packed = Q.pack(q, bits)
    halves = rng.standard_normal((n_b, 40)).astype(np.float16)
    width = n + 17
    scales = (rng.standard_normal((7, width)) * 0.01).astype(np.float16)
    biases = rng.standard_normal((7, width)).astype(np.float16)
    pb = packed.shape[1]
    stride = _round_up(pb + 80, 512)
    base = 3 * 4096  # the part starts after a header of another part
    buf = np.full((n_b, stride), 0x5C, dtype=np.uint8)
    buf[:, :80] = halves.view(np.uint8)
    buf[:, 80 : 80 + pb] = packed
    path = disk_dir / f"qcol_{bits}_{n}.bin"
    path.write_bytes(np.full(base, 0xEE, dtype=np.uint8).tobytes() + buf.tobytes())
    ids = np.array([199, 5, 31, 32, 33, 64, 150, 0, 100, 63])
    out = np.full((len(ids), n), -1, dtype=np.float32)
    half_out = np.zeros((len(ids), 40), dtype=np.float32)
    segs = [(0, 40, "float16", half_out), (80, n, Quantized(bits, gs, sd, (scales, biases)), out)]
    with FlashReader(threads=3, backend=backend) as r:
        f = r.open(path)
        r.read_bundles(f, ids, stride, segs, np.arange(len(ids)), base=base)
    t = ids // gs
    want = scales[t, :n].astype(np.float32) * q[ids].astype(np.float32)
    want += biases[t, :n].astype(np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(half_out, halves[ids].astype(np.float32))


@pytest.mark.skipif(not native_available(), reason="native extension not built")
@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "portable"])
def test_native_dequantize_kernel(simd):
    """The C kernel alone (both its builds), every width, group and scale dtype, both forms."""
    from mlx_flash.io import _native

    default = _native.simd(-1)
    if simd and not default:
        pytest.skip("no SIMD path on this CPU")
    codes = {"float32": 0, "float16": 1, "bfloat16": 2}
    rng = np.random.default_rng(11)
    _native.simd(int(simd))
    try:
        for bits in Q.BITS:
            for gs in Q.GROUP_SIZES:
                for sd in SCALE_DTYPES:
                    n = 1024
                    q = rng.integers(0, 1 << bits, n).astype(np.uint8)
                    packed = Q.pack(q, bits)
                    sb = rng.standard_normal((2, n)).astype(np.float32) * np.float32(0.02)
                    raw = (sb.view(np.uint32) >> 16).astype(np.uint16) if sd == "bfloat16" else sb.astype(sd)
                    g = n // gs
                    src = np.concatenate([packed, raw[0, :g].view(np.uint8), raw[1, :g].view(np.uint8)])
                    want = Q.dequantize(packed, _f32(raw[0, :g]), _f32(raw[1, :g]), bits, gs, n)
                    for dst_dtype, dc in ((np.float32, 0), (np.float16, 1)):
                        out = np.empty(n, dst_dtype)
                        _native.dequantize(src, n, bits, gs, codes[sd], None, None, out, dc)
                        assert np.array_equal(out, want.astype(dst_dtype)), (bits, gs, sd, "row")
                    m = n - (4 if bits in (2, 6) else 8 if bits != 4 else 2)  # not a multiple of 256
                    want = _f32(raw[0, :m]) * Q.unpack(packed, bits, m).astype(np.float32)
                    want += _f32(raw[1, :m])
                    for dst_dtype, dc in ((np.float32, 0), (np.float16, 1)):
                        out = np.empty(m, dst_dtype)
                        _native.dequantize(packed, m, bits, gs, codes[sd], raw[0], raw[1], out, dc)
                        assert np.array_equal(out, want.astype(dst_dtype)), (bits, gs, sd, "column")
    finally:
        _native.simd(int(default))


def test_bad_quantized_segments_name_the_problem(disk_dir):
    lay = _layer(disk_dir, 4, 64, "float16")
    stride, rb, (s, b) = lay["stride"], lay["row_bytes"], lay["table"]
    dst = np.zeros((8, D), dtype=np.float32)
    ids, rows = np.array([1, 2, 70]), np.arange(3)

    def seg(n=D, off=0, **kw):
        q = dict(bits=4, group_size=64, scale_dtype="float16")
        q.update(kw)
        return [(off, n, Quantized(**q), dst)]

    cases = [
        (seg(bits=7), "7-bit"),
        (seg(group_size=16), "group size 16"),
        (seg(scale_dtype="int8"), "scale_dtype 'int8'"),
        (seg(n=100), "multiple of the group size"),
        (seg(n=3, bits=3, table=(s, b)), "whole number of bytes"),
        (seg(off=stride - rb + 2), "overruns the bundle stride"),
        (seg(off=-1), "does not fit"),
        (seg(n=D + 64), "does not fit"),  # wider than dst
        (seg(table=(s, b, b)), r"\(scales, biases\) tuple"),
        (seg(table=(s[0], b[0])), "2-D"),
        (seg(table=(s.astype(np.float32), b.astype(np.float32))), "needs float16"),
        (seg(table=(s, b), scale_dtype="bfloat16"), "needs uint16"),
        (seg(table=(np.asfortranarray(s), b)), "C-contiguous"),
        (seg(table=(s[:, :100].copy(), b[:, :100].copy())), "narrower"),
        (seg(table=(s, b[:1].copy())), "differ in shape"),
        (seg(table=(s[:1].copy(), b[:1].copy())), r"neuron id 70 needs table row 1, the table has 1 rows"),
        ([(0, D, Quantized(4, 64, "float16"), dst.astype(np.float64))], "dst must be"),
    ]
    with FlashReader(threads=2) as r:
        f = r.open(lay["path"])
        for segs, msg in cases:
            with pytest.raises(ValueError, match=msg):
                r.read_bundles(f, ids, stride, segs, rows)
        assert (dst == 0).all() and r.stats.batches == 0

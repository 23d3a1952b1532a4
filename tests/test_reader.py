"""FlashReader: what the engine can rely on.

Real files on a real disk (O_DIRECT), both pools (native and pure Python),
faults injected for real where possible: a truncated file, a rewritten file,
a file descriptor that cannot read; EIO through the reader's fault hook.
"""

import errno
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from mlx_flash.io import FlashReader, ReadError, logical_block_size, native_available
from mlx_flash.io.plan import plan_runs
from mlx_flash.layout.format import BundleLayout

BACKENDS = ["native", "python"]


def _supports_direct(d):
    probe = Path(d) / ".odirect-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """A temporary folder on a disk that takes O_DIRECT (not tmpfs)."""
    d = tmp_path_factory.mktemp("reader")
    if sys.platform.startswith("linux") and not _supports_direct(d):
        alt = Path(tempfile.mkdtemp(prefix="mlx_flash-test-", dir=Path.home()))
        if _supports_direct(alt):
            yield alt
            import shutil

            shutil.rmtree(alt, ignore_errors=True)
            return
    yield d


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "native" and not native_available():
        pytest.skip("native extension not built")
    return request.param


@pytest.fixture(scope="module")
def data_file(disk_dir):
    """8 MiB of random bytes."""
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    path = disk_dir / "data.bin"
    data.tofile(path)
    return path, data.tobytes()


def test_native_extension_is_built():
    # CI must exercise the native pool; set MLX_FLASH_ALLOW_NO_NATIVE=1 where no compiler exists
    if os.environ.get("MLX_FLASH_ALLOW_NO_NATIVE"):
        pytest.skip("allowed to run without the native extension")
    assert native_available(), "mlx_flash/io/_native.c was not built (pip install -e .)"


# ---- opening and alignment


def test_uncached_open_and_block_size(data_file):
    path, _ = data_file
    with FlashReader(threads=2) as r:
        f = r.open(path)
        assert f.size == 8 << 20
        if sys.platform.startswith("linux") and _supports_direct(path.parent):
            assert f.direct
            assert f.align == logical_block_size(f.fd)
            assert f.align >= 512 and f.align & (f.align - 1) == 0
            flags = int(open(f"/proc/self/fdinfo/{f.fd}").read().split("flags:")[1].split()[0], 8)
            assert flags & os.O_DIRECT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux")
def test_why_staging_odirect_refuses_unaligned_buffers(data_file):
    """The fact behind the staging buffers: O_DIRECT into an unaligned buffer fails."""
    path, data = data_file
    if not _supports_direct(path.parent):
        pytest.skip("no O_DIRECT here")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = bytearray(8192 + 1)
        with pytest.raises(OSError) as e:
            os.preadv(fd, [memoryview(buf)[1:4097]], 0)
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError):
            os.preadv(fd, [memoryview(bytearray(4096))], 100)  # unaligned offset (buffer aside)
    finally:
        os.close(fd)


def test_unaligned_ranges_read_exactly(data_file, backend):
    path, data = data_file
    rng = np.random.default_rng(1)
    offs = rng.integers(0, len(data) - 70000, 300)
    lens = rng.integers(1, 70000, 300)
    offs[:3] = [0, len(data) - 1, 12345]  # first byte, last byte, odd
    lens[:3] = [1, 1, 0]
    with FlashReader(threads=8, backend=backend) as r:
        f = r.open(path)
        out = r.read(f, offs, lens)
        for o, a, n in zip(out, offs, lens):
            assert bytes(o) == data[a : a + n]
        # the staging buffer is page-aligned, reads are block-aligned
        assert r._stage.ctypes.data % 4096 == 0
        assert r.stats.bytes_read % f.align == 0


def test_plan_is_aligned_and_coalesces_by_gap():
    need = np.full(3, 16384, dtype=np.int64)
    starts = np.array([0, 16384 * 2, 16384 * 5], dtype=np.int64)  # gaps 16 KiB, 32 KiB
    off, ln, nd, st, rs, src = plan_runs(starts, need, 512, 16384, 1 << 20)
    assert off.tolist() == [0, 5 * 16384] and rs.tolist() == [0, 2, 3]
    assert ln.tolist() == [3 * 16384, 16384] and st.tolist() == [0, 3 * 16384]
    assert src.tolist() == [0, 2 * 16384, 0]  # offsets in the run's buffer
    off, *_ = plan_runs(starts, need, 512, 16383, 1 << 20)  # below the gap: no merge
    assert len(off) == 3
    off, *_ = plan_runs(starts, need, 512, -1, 1 << 20)  # disabled
    assert len(off) == 3
    off, *_ = plan_runs(starts, need, 512, 1 << 20, 65536)  # max_read splits a run
    assert len(off) == 2
    # unaligned items: reads are widened to the block, items found inside
    starts = np.array([700, 1500, 9000], dtype=np.int64)
    need = np.array([100, 3000, 10], dtype=np.int64)
    off, ln, nd, st, rs, src = plan_runs(starts, need, 512, 0, 1 << 20)
    assert (off % 512 == 0).all() and (ln % 512 == 0).all() and (st % 512 == 0).all()
    assert (off[np.searchsorted(rs, np.arange(3), side="right") - 1] <= starts).all()


@pytest.mark.parametrize("gap", [0, 4096, 16384, 1 << 20])
def test_coalesced_reads_return_the_bytes_of_plain_reads(data_file, backend, gap):
    path, data = data_file
    rng = np.random.default_rng(gap)
    # bundles of 3 KiB at a 3.5 KiB stride: neighbours, near neighbours, repeats
    stride, n = 3584, 2000
    ids = rng.choice((len(data) - 4096) // stride, n, replace=True)
    offs = ids * stride + rng.integers(0, 512, n)
    lens = rng.integers(0, 3072, n)
    with FlashReader(threads=8, backend=backend, coalesce_gap=-1) as plain, \
            FlashReader(threads=8, backend=backend, coalesce_gap=gap, max_read=64 << 10) as co:
        a = plain.read(plain.open(path), offs, lens)
        b = co.read(co.open(path), offs, lens)
        assert [bytes(x) for x in a] == [bytes(x) for x in b]
        assert [bytes(x) for x in b] == [data[o : o + k] for o, k in zip(offs, lens)]
        assert co.stats.reads_issued < plain.stats.reads_issued == n
        assert co.stats.reads_requested == n
        assert co.stats.bytes_requested == plain.stats.bytes_requested == int(lens.sum())


# ---- bundles and dtype conversion


def _special_values(n, rng):
    v = rng.standard_normal(n).astype(np.float32) * 3
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e6, -1e6,
                        6e-8, 3e-8, 1e-40, -1e-45, 2.0**-14, 2.0**-24, 1 / 3], dtype=np.float32)
    v[: len(special)] = special
    return v


def _write_layer(path, layout, rng):
    rows = {k: _special_values(layout.n_neurons * layout.d_model, rng).reshape(
        layout.n_neurons, layout.d_model) for k in layout.kinds}
    with np.errstate(over="ignore"):  # 1e6 does not fit float16: inf, as intended
        layout.pack(rows).tofile(path)
    return rows


def _expected(raw_rows, src_dtype, dst_dtype):
    """numpy's own conversion of what the layout stored."""
    from mlx_flash.layout.safetensors_io import from_storage, to_storage

    with np.errstate(over="ignore"):
        stored = from_storage(to_storage(raw_rows, src_dtype), src_dtype)  # float32
        return stored.astype(dst_dtype)


def _f16(x):
    """float32 values as stored in float16 and read back as float32."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float32)


def _same(a, b):
    return np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


@pytest.mark.parametrize("src_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dst_dtype", [np.float32, np.float16])
def test_read_bundles_converts_dtypes(disk_dir, backend, src_dtype, dst_dtype):
    rng = np.random.default_rng(3)
    layout = BundleLayout(kinds=("gate", "up", "down"), d_model=100, n_neurons=300,
                          dtype=src_dtype)  # stride 1024 or 1536: not a power of two
    path = disk_dir / f"layer_{src_dtype}.bin"
    rows = _write_layer(path, layout, rng)
    ids = rng.choice(layout.n_neurons, 120, replace=False)
    ids[:4] = [0, 1, 2, layout.n_neurons - 1]
    cap = 200
    dst = {k: np.full((cap, 128), 7, dtype=dst_dtype) for k in layout.kinds}
    dst_rows = rng.choice(cap, len(ids), replace=False)
    segs = [(j * layout.row_bytes, layout.d_model, src_dtype, dst[k])
            for j, k in enumerate(layout.kinds)]
    with FlashReader(threads=4, backend=backend) as r:
        f = r.open(path, expected_size=layout.file_size)
        r.read_bundles(f, ids, layout.stride, segs, dst_rows)
        assert r.stats.reads_requested == len(ids) and r.stats.batches == 1
    for k in layout.kinds:
        want = _expected(rows[k][ids], src_dtype, dst_dtype)
        assert _same(dst[k][dst_rows, : layout.d_model], want), k
        untouched = np.setdiff1d(np.arange(cap), dst_rows)
        assert (dst[k][untouched] == 7).all() and (dst[k][dst_rows, layout.d_model:] == 7).all()


def test_read_bundles_into_an_mlx_array(disk_dir):
    """The engine's cache: NumPy views of evaluated MLX arrays, not aligned for O_DIRECT."""
    import mlx.core as mx

    rng = np.random.default_rng(4)
    layout = BundleLayout(kinds=("up", "down"), d_model=256, n_neurons=64, dtype="float16")
    path = disk_dir / "mlx_layer.bin"
    rows = _write_layer(path, layout, rng)
    up, down = mx.zeros((16, 256)), mx.zeros((16, 256))
    mx.eval(up, down)
    views = [np.array(up, copy=False), np.array(down, copy=False)]
    ids = np.array([5, 6, 40], dtype=np.int64)
    with FlashReader(threads=4) as r:
        f = r.open(path)
        r.read_bundles(f, ids, layout.stride,
                       [(0, 256, "float16", views[0]), (512, 256, "float16", views[1])],
                       np.array([0, 1, 2]))
    assert _same(np.array(up[:3]), _f16(rows["up"][ids]))


@pytest.mark.skipif(not native_available(), reason="native extension not built")
@pytest.mark.parametrize("simd", [True, False], ids=["f16c", "portable"])
def test_native_conversion_is_exact_for_every_half(simd):
    from mlx_flash.io import _native

    default = _native.simd(-1)
    if simd and not default:
        pytest.skip("no F16C on this CPU")
    _native.simd(int(simd))
    try:
        _check_native_conversion(_native)
    finally:
        _native.simd(int(default))


def _check_native_conversion(_native):
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(1 << 16, dtype=np.float32)
    _native.convert(bits, 1, out, 0, len(bits))  # float16 -> float32
    want = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(out.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(out[np.isnan(want)]).all()
    _native.convert(bits, 2, out, 0, len(bits))  # bfloat16 -> float32
    assert np.array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)
    # float32 -> float16: round to nearest even, overflow, subnormals, every half's neighbours
    f = want[np.isfinite(want)]
    ties = (f[:-1].astype(np.float64) + np.diff(f.astype(np.float64)) / 2).astype(np.float32)
    x = np.concatenate([f, ties, np.nextafter(f, np.inf), np.nextafter(f, -np.inf),
                        np.random.default_rng(5).standard_normal(100000).astype(np.float32) * 1e3,
                        np.array([1e10, -1e10, 65519.99, 65520.0, 1e-10], np.float32)])
    h = np.empty(len(x), dtype=np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        _native.convert(x, 0, h, 1, len(x))
        want = x.astype(np.float16)
    ok = ~np.isnan(want)
    assert np.array_equal(h.view(np.uint16)[ok], want.view(np.uint16)[ok])
    nan = np.array([np.nan, -np.nan], np.float32)
    hn = np.empty(2, np.float16)
    _native.convert(nan, 0, hn, 1, 2)
    assert np.isnan(hn).all()


# ---- errors


def _bundle_file(disk_dir, name, n=64, d=2048):
    layout = BundleLayout(kinds=("up", "down"), d_model=d, n_neurons=n, dtype="float16")
    path = disk_dir / name
    rows = _write_layer(path, layout, np.random.default_rng(6))
    return path, layout, rows


def _segs(layout, cap=64):
    dst = [np.full((cap, layout.d_model), -1.0, dtype=np.float32) for _ in range(2)]
    segs = [(0, layout.d_model, "float16", dst[0]),
            (layout.row_bytes, layout.d_model, "float16", dst[1])]
    return dst, segs


def test_open_errors_name_the_file(disk_dir):
    path, layout, _ = _bundle_file(disk_dir, "open.bin")
    with FlashReader(threads=2) as r:
        with pytest.raises(ReadError, match="missing") as e:
            r.open(disk_dir / "nope.bin")
        assert "nope.bin" in str(e.value)
        with pytest.raises(ReadError, match=r"size .* != expected") as e:
            r.open(path, expected_size=layout.file_size + 512)
        assert str(path) in str(e.value) and e.value.file == str(path)


def test_file_changed_since_conversion(disk_dir):
    """Size and checksum against the manifest's: a rewritten byte is caught."""
    from mlx_flash.layout.format import sha256_file

    path, layout, _ = _bundle_file(disk_dir, "changed.bin")
    digest = sha256_file(path)
    with FlashReader(threads=4) as r:
        r.close_file(r.open(path, expected_size=layout.file_size, expected_sha256=digest))
        with open(path, "r+b") as fh:  # rewrite one byte in place
            fh.seek(layout.stride * 7 + 3)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(ReadError, match="sha256") as e:
            r.open(path, expected_size=layout.file_size, expected_sha256=digest)
        assert str(path) in str(e.value)


def test_truncated_file_short_read(disk_dir, backend):
    path, layout, rows = _bundle_file(disk_dir, f"trunc_{backend}.bin")
    dst, segs = _segs(layout)
    with FlashReader(threads=4, backend=backend) as r:
        f = r.open(path, expected_size=layout.file_size)
        os.truncate(path, layout.stride * 40 + 1024)  # bundle 40 now ends early
        ids = np.array([3, 40, 41, 50])
        with pytest.raises(ReadError) as e:
            r.read_bundles(f, ids, layout.stride, segs, np.array([0, 1, 2, 3]))
        msg = str(e.value)
        assert str(path) in msg and ("short read" in msg or "beyond" in msg)
        assert e.value.offset is not None and e.value.offset >= layout.stride * 40
        # never half-written: rows of the failed reads keep their old contents
        for d in dst:
            assert (d[1:4] == -1.0).all()
        # an intact bundle still reads
        r.read_bundles(f, np.array([3]), layout.stride, segs, np.array([5]))
        assert _same(dst[0][5], _f16(rows["up"][3]))


def test_eio_leaves_rows_untouched(disk_dir, backend):
    path, layout, rows = _bundle_file(disk_dir, f"eio_{backend}.bin")
    dst, segs = _segs(layout)
    ids = np.arange(0, 60, 3)
    with FlashReader(threads=4, backend=backend, coalesce_gap=-1) as r:
        f = r.open(path)
        bad = int(ids[7]) * layout.stride + 100
        r._fault = (bad, errno.EIO)  # the read covering this byte fails with EIO
        with pytest.raises(ReadError, match="EIO") as e:
            r.read_bundles(f, ids, layout.stride, segs, np.arange(len(ids)))
        assert e.value.offset == int(ids[7]) * layout.stride and str(path) in str(e.value)
        for d in dst:
            assert (d[7] == -1.0).all()  # the failed read's row: untouched
            done = ~(d == -1.0).all(axis=1)
            # rows that were written are whole and right
            for k in np.flatnonzero(done):
                want = rows["up" if d is dst[0] else "down"][ids[k]]
                assert _same(d[k], _f16(want))
        r._fault = (-1, 0)
        r.read_bundles(f, ids, layout.stride, segs, np.arange(len(ids)))
        assert _same(dst[1][7], _f16(rows["down"][ids[7]]))


def test_a_descriptor_that_cannot_read(disk_dir, backend):
    """A read that fails for real: the handle's descriptor is replaced by a write-only one."""
    path, layout, _ = _bundle_file(disk_dir, f"badfd_{backend}.bin")
    dst, segs = _segs(layout)
    with FlashReader(threads=4, backend=backend) as r:
        f = r.open(path)
        wfd = os.open(disk_dir / f"w_{backend}.bin", os.O_WRONLY | os.O_CREAT)
        os.dup2(wfd, f.fd)
        os.close(wfd)
        with pytest.raises(ReadError, match="EBADF") as e:
            r.read_bundles(f, np.array([1, 2]), layout.stride, segs, np.array([0, 1]))
        assert str(path) in str(e.value)
        assert (dst[0][:2] == -1.0).all()
        with pytest.raises(ReadError, match="EBADF"):
            r.read(f, [0], [10])


def test_requests_beyond_the_file_and_bad_arguments(disk_dir):
    path, layout, _ = _bundle_file(disk_dir, "args.bin")
    dst, segs = _segs(layout)
    with FlashReader(threads=2) as r:
        f = r.open(path)
        with pytest.raises(ReadError, match="beyond the end"):
            r.read_bundles(f, np.array([layout.n_neurons]), layout.stride, segs, np.array([0]))
        with pytest.raises(ReadError, match="beyond the end"):
            r.read(f, [layout.file_size - 10], [11])
        with pytest.raises(ValueError, match="dst_rows"):
            r.read_bundles(f, np.array([1]), layout.stride, segs, np.array([64]))
        with pytest.raises(ValueError, match="overruns"):
            r.read_bundles(f, np.array([1]), layout.stride,
                           [(layout.stride - 2, 2, "float16", dst[0])], np.array([0]))
        with pytest.raises(ValueError, match="C-contiguous"):
            r.read_bundles(f, np.array([1]), layout.stride,
                           [(0, 8, "float16", dst[0][:, ::2])], np.array([0]))
        r.read_bundles(f, np.array([], dtype=np.int64), layout.stride, segs, np.array([]))
        assert r.read(f, [], []) == []
        r.close_file(f)
        with pytest.raises(ReadError, match="closed"):
            r.read(f, [0], [1])


# ---- stats, fallback, concurrency


def test_stats(disk_dir):
    path, layout, _ = _bundle_file(disk_dir, "stats.bin")
    dst, segs = _segs(layout)
    with FlashReader(threads=4, coalesce_gap=layout.stride) as r:
        f = r.open(path)
        r.read_bundles(f, np.array([1, 2, 4, 30]), layout.stride, segs, np.arange(4))
        s = r.stats
        assert (s.reads_requested, s.reads_issued, s.batches) == (4, 2, 1)
        assert s.bytes_requested == 4 * layout.bundle_bytes
        assert s.bytes_read == 5 * layout.stride  # 1..4 with 3 read and discarded, then 30
        assert s.last_batch_s > 0 and s.total_batch_s == s.last_batch_s
        r.read(f, [0, 100], [10, 10])
        assert s.batches == 2 and s.reads_issued == 3 and s.bytes_requested == 4 * layout.bundle_bytes + 20
        s.reset()
        assert s.as_dict() == {k: 0 for k in s.as_dict()}


def test_bundles_bridge_the_readers_gap(disk_dir):
    # bundles bridge the reader's gap whatever their size: a read's own cost is the
    # same for small (4-bit, DIP) bundles, which merged only when one bundle apart
    # read ~25x as many times (the comment at DEFAULT_COALESCE_GAP)
    path, layout, rows = _bundle_file(disk_dir, "bridge.bin")
    dst, segs = _segs(layout)
    assert layout.stride == layout.bundle_bytes  # bundles touch: the gap of [0, k] is k - 1 bundles
    with FlashReader(threads=2, coalesce_gap=3 * layout.stride) as r:
        f = r.open(path)
        r.read_bundles(f, np.array([0, 4]), layout.stride, segs, np.arange(2))
        assert r.stats.reads_issued == 1  # three bundles bridged
        assert r.stats.bytes_read == 5 * layout.stride
        for k, d in zip(layout.kinds, dst):  # the bridge read and discarded
            np.testing.assert_array_equal(d[:2], _expected(rows[k][[0, 4]], "float16", np.float32))
        r.stats.reset()
        r.read_bundles(f, np.array([0, 5]), layout.stride, segs, np.arange(2))
        assert r.stats.reads_issued == 2  # four bundles: skipped
        r.stats.reset()
        r.read_bundles(f, np.array([0, 5]), layout.stride, segs, np.arange(2), gap=-1)
        assert r.stats.reads_issued == 2  # a batch's own gap is taken as given
        r.stats.reset()
        r.read_bundles(f, np.array([0, 1]), layout.stride, segs, np.arange(2), gap=-1)
        assert r.stats.reads_issued == 2


def _refuse_odirect_at_open(monkeypatch):
    """A file system that refuses O_DIRECT (tmpfs before Linux 6.6, some network
    file systems): open(O_DIRECT) fails with EINVAL."""
    import mlx_flash.io.files as files_mod

    real_open = os.open

    def fake_open(path, flags, *a, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(files_mod.os, "open", fake_open)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux")
def test_page_cache_fallback_is_logged_once(caplog, monkeypatch, disk_dir, data_file):
    import mlx_flash.io.files as files_mod

    path, data = data_file
    _refuse_odirect_at_open(monkeypatch)
    files_mod._logged.discard(("odirect", str(path.parent)))
    with caplog.at_level(logging.WARNING, logger="mlx_flash.io"):
        with FlashReader(threads=2) as r:
            f1, f2 = r.open(path), r.open(path)
            assert not f1.direct and not f2.direct and f1.align == 1
            assert bytes(r.read(f1, [3], [5])[0]) == data[3:8]
    msgs = [m for m in caplog.messages if "refuses O_DIRECT" in m]
    assert len(msgs) == 1 and str(path) in msgs[0]


def test_uncached_reads_refused_at_read_time(caplog, disk_dir, backend):
    """open(O_DIRECT) succeeded but reads fail with EINVAL: reopen buffered, retry, log."""
    import mlx_flash.io.files as files_mod

    path, layout, rows = _bundle_file(disk_dir, f"einval_{backend}.bin")
    dst, segs = _segs(layout)
    files_mod._logged.discard(("odirect-read", str(path.parent)))
    with caplog.at_level(logging.WARNING, logger="mlx_flash.io"):
        with FlashReader(threads=2, backend=backend) as r:
            f = r.open(path)
            if not f.direct:
                pytest.skip("no uncached reads here")
            r._fault = (0, errno.EINVAL)
            r.read_bundles(f, np.array([0, 9]), layout.stride, segs, np.array([0, 1]))
            assert not f.direct
            assert _same(dst[1][1], _f16(rows["down"][9]))
    assert any("fail (EINVAL)" in m for m in caplog.messages)


def test_python_fallback_when_native_is_missing(data_file):
    """Without the extension the Python pool runs, and says so once."""
    path, data = data_file
    code = textwrap.dedent(f"""
        import numpy as np
        from mlx_flash.io import FlashReader
        for _ in range(2):
            r = FlashReader(threads=3)
            assert r.backend == "python", r.backend
            f = r.open({str(path)!r})
            assert bytes(r.read(f, [5], [7])[0]) == {data[5:12]!r}
            r.close()
        print("ok")
    """)
    env = dict(os.environ, MLX_FLASH_NO_NATIVE="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"
    assert p.stderr.count("using the pure-Python pool") == 1, p.stderr


def test_batches_from_two_threads(data_file, backend):
    path, data = data_file
    errors = []
    with FlashReader(threads=4, backend=backend) as r:
        f = r.open(path)

        def loop(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(20):
                    offs = rng.integers(0, len(data) - 5000, 50)
                    out = r.read(f, offs, [4000] * 50)
                    assert all(bytes(o) == data[a : a + 4000] for o, a in zip(out, offs))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=loop, args=(s,)) for s in (1, 2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert not errors, errors

"""Every read checked: a flipped byte in a bundle is found on the token that reads it, in every
mode, and by mlx_flash.verify; --no-verify skips the checks; version 1 folders say they are
unchecked."""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.errors import FlashError
from mlx_flash.io import checksum, native_available
from mlx_flash.layout.format import read_manifest
from helpers import flip_bit, make_llama_folder
from test_parity import TOKENS


def _bitwise_crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def zlib_free_crc(data):
    """CRC32C by an independent table (NumPy-free, byte at a time): the long buffers' reference
    (the bit-by-bit one is slow in Python)."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


def test_the_crc32c_instruction_is_the_default_where_the_cpu_has_it():
    """Chosen at import: once the path was the table (6x slower) whenever the CPU had the
    instruction, because the feature test's non-zero answer was taken for 'off' (not 1)."""
    if not native_available():
        pytest.skip("no native reader")
    code = ("from mlx_flash.io import _native\n"
            "default = _native.crc32c_hardware(-1)\n"
            "print(default, _native.crc32c_hardware(1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    assert out[0] == out[1] and out[0] in ("0", "1"), out  # the default is the best path there is


def test_crc32c_paths_agree(monkeypatch):
    data = np.random.default_rng(0).integers(0, 256, 3001, dtype=np.uint8).tobytes()
    want = _bitwise_crc32c(data)
    assert _bitwise_crc32c(b"123456789") == 0xE3069283 == zlib_free_crc(b"123456789")  # the standard check value
    rows = np.frombuffer(data[:3000], dtype=np.uint8).reshape(3, 1000)
    parts = [(0, 1000), (7, 333)]
    expected = np.array([[_bitwise_crc32c(r[o:o + n].tobytes()) for o, n in parts] for r in rows])
    if native_available():
        from mlx_flash.io import _native

        # long enough for the three-chain blocks (3 x 8 KiB, then 3 x 256 bytes), from an unaligned start
        big = np.random.default_rng(1).integers(0, 256, 3 * 8192 * 2 + 3 * 256 + 77, dtype=np.uint8).tobytes()
        for hw in (1, 0):
            _native.crc32c_hardware(hw)
            try:
                assert checksum.crc32c(big[1:]) == zlib_free_crc(big[1:])
                assert checksum.crc32c(big[5000:], checksum.crc32c(big[:5000])) == zlib_free_crc(big)
                assert checksum.crc32c(data) == want
                assert checksum.crc32c(data[1000:], checksum.crc32c(data[:1000])) == want
                assert np.array_equal(checksum.parts_crc(rows, parts), expected)
            finally:
                _native.crc32c_hardware(1)
    monkeypatch.setattr(checksum, "_native", lambda: None)  # the NumPy fallback
    assert checksum.crc32c(data) == want
    assert np.array_equal(checksum.parts_crc(rows, parts), expected)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crc")
    src, _, _ = make_llama_folder(tmp / "hf", "llama", intermediate_size=128)
    return {"float": convert(src, tmp / "f16", progress=False, dip=True),
            "4-bit": convert(src, tmp / "q4", progress=False, dip=True,
                             quant=QuantOptions(quantize=True, bits=4, group_size=32))}


def _damaged(folder, tmp_path, file="ffn/layer_001.bin", bundle=37):
    import shutil

    out = tmp_path / (folder.name + "-damaged")
    shutil.copytree(folder, out)
    m = read_manifest(out)
    lay = m.layout if file.startswith("ffn") else m.dip["input" if "/in_" in file else "down"]["layout"]
    flip_bit(out / file, bundle * lay.stride + lay.bundle_bytes // 2)
    return out


MODES = [dict(mode="naive"), dict(mode="hybrid"), dict(mode="flash", sparsity="oracle", density=0.5),
         dict(mode="flash", sparsity="dip-ca", density=0.5)]


@pytest.mark.parametrize("kind", ["float", "4-bit"])
@pytest.mark.parametrize("options", MODES, ids=lambda o: "-".join(map(str, o.values())))
def test_a_flipped_byte_is_found_on_the_token_that_reads_it(folders, tmp_path, kind, options):
    folder = folders[kind]
    file = "ffn/layer_001.bin"
    if options.get("sparsity") == "dip-ca":
        file = "dip/in_001.bin"
    elif options.get("sparsity") == "oracle":
        file = "ffn/layer_001.bin"
    # bundle 100: in the half of the neurons hybrid streams (it reads the other half at load)
    damaged = _damaged(folder, tmp_path, file, bundle=100 if "ffn" in file else 5)
    if options.get("sparsity") == "oracle":
        # the oracle reads whole layer files at load: their sha256 finds it there
        with pytest.raises(FlashError, match="layer_001.bin: sha256 differs"):
            mlx_flash.load(damaged, **options)
        return
    model, _ = mlx_flash.load(damaged, **options)
    x = mx.array([TOKENS])
    with pytest.raises(FlashError) as e:
        mx.eval(model(x))
    msg = str(e.value)
    assert "layer 1" in msg and file in msg and "does not match its checksum" in msg, msg
    assert "offset" in msg and "neuron" in msg
    model.runtime.close()
    # --no-verify: the damaged row is used as it is (that is what the checks are for)
    model, _ = mlx_flash.load(damaged, verify=False, **options)
    mx.eval(model(x))
    model.runtime.close()


def test_the_dense_mode_checks_whole_files(folders, tmp_path):
    damaged = _damaged(folders["4-bit"], tmp_path)
    with pytest.raises(FlashError, match="layer_001.bin: sha256 differs"):
        mlx_flash.load(damaged)


def test_verify_finds_the_damage(folders, tmp_path):
    cmd = [sys.executable, "-m", "mlx_flash", "verify", "--quiet"]
    ok = subprocess.run(cmd + [str(folders["4-bit"])], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    damaged = _damaged(folders["4-bit"], tmp_path, "dip/down_001.bin", bundle=9)
    bad = subprocess.run(cmd + [str(damaged)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "dip/down_001.bin: bundle 9 (down" in bad.stdout, bad.stdout


def test_version_1_folders_load_unchecked_and_say_so(folders, tmp_path, caplog):
    import shutil

    out = tmp_path / "v1"
    shutil.copytree(folders["float"], out)
    m = json.loads((out / "manifest.json").read_text())
    for e in m["ffn_files"]:
        e.pop("crc32c")
    m["version"] = 1
    (out / "manifest.json").write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="mlx_flash.io"):
        model, _ = mlx_flash.load(out, mode="naive")
    assert "no bundle checksums" in caplog.text
    mx.eval(model(mx.array([TOKENS])))

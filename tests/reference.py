"""Independent references (transformers on PyTorch), run in their own virtual environment.

torch is kept out of the product's venv on purpose: transformers imports it
whenever it is installed, and mlx_lm imports transformers, so a torch in the
product venv would add ~250 MB of RSS and a second of start-up to every
mlx_flash process. `make test` builds `.venv-ref` (torch CPU + transformers);
one process there (started at the first request, ~4 s of imports, then kept for
the session) loads each folder asked for and writes back its logits as NumPy.
"""

import atexit
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
REF_PYTHON = Path(os.environ.get("MLX_FLASH_REF_PYTHON", REPO / ".venv-ref" / "bin" / "python"))

# One request a line on stdin ({folder, tokens, out, kwargs}); one answer a line on stdout:
# "ok", or the error's traceback as a JSON string. Warnings and logs go to stderr.
SERVER = r"""
import sys, json, traceback, numpy as np, torch
from transformers import AutoModelForCausalLM
out_stream = sys.stdout
sys.stdout = sys.stderr
for line in sys.stdin:
    try:
        r = json.loads(line)
        m = AutoModelForCausalLM.from_pretrained(r["folder"], dtype=torch.float32, attn_implementation="eager",
                                                 **r["kwargs"]).eval()
        with torch.no_grad():
            np.save(r["out"], m(torch.tensor([r["tokens"]])).logits[0].numpy())
        answer = "ok"
    except Exception:
        answer = json.dumps(traceback.format_exc())
    out_stream.write(answer + "\n")
    out_stream.flush()
"""

_server = None


def require_reference():
    if not REF_PYTHON.exists():
        pytest.skip(f"reference venv missing ({REF_PYTHON}); `make test` builds it")


def _reference_process():
    global _server
    require_reference()
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([str(REF_PYTHON), "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        atexit.register(_server.kill)
    return _server


def reference_logits(folder, tokens, **from_pretrained_kwargs):
    """transformers' logits [len(tokens), vocab] for a HF folder, float32 on the CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        server = _reference_process()
        server.stdin.write(json.dumps({"folder": str(folder), "tokens": [int(t) for t in tokens], "out": str(out),
                                       "kwargs": from_pretrained_kwargs}) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        if not answer:
            raise RuntimeError("the reference process exited")
        if answer.strip() != "ok":
            raise RuntimeError(f"reference failed:\n{json.loads(answer)[-3000:]}")
        return np.load(out)

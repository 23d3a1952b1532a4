"""Independent references (transformers on PyTorch), run in their own virtual environment.

torch is kept out of the product's venv on purpose: transformers imports it
whenever it is installed, and mlx_lm imports transformers, so a torch in the
product venv would add ~250 MB of RSS and a second of start-up to every
mlx_flash process. `make test` builds `.venv-ref` (torch CPU + transformers);
these helpers run a small script there and read back NumPy arrays.
"""

import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
REF_PYTHON = Path(os.environ.get("MLX_FLASH_REF_PYTHON", REPO / ".venv-ref" / "bin" / "python"))

LOGITS = r"""
import sys, json, numpy as np, torch
from transformers import AutoModelForCausalLM
folder, tokens, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
kw = json.loads(sys.argv[4])
m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **kw).eval()
with torch.no_grad():
    np.save(out, m(torch.tensor([tokens])).logits[0].numpy())
"""


def require_reference():
    if not REF_PYTHON.exists():
        pytest.skip(f"reference venv missing ({REF_PYTHON}); `make test` builds it")


def run_reference(script, *args):
    require_reference()
    r = subprocess.run([str(REF_PYTHON), "-c", script, *map(str, args)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"reference failed:\n{r.stderr[-3000:]}")
    return r.stdout


def reference_logits(folder, tokens, **from_pretrained_kwargs):
    """transformers' logits [len(tokens), vocab] for a HF folder, float32 on the CPU."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        run_reference(LOGITS, folder, json.dumps(list(tokens)), out, json.dumps(from_pretrained_kwargs))
        return np.load(out)

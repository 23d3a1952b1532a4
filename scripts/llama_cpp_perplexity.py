"""llama.cpp's perplexity on the same tokens as `mlx_flash.eval`, for the peers table's
quality column (issue 11: the 4-bit peers "with perplexity beside it").

    .venv/bin/python scripts/llama_cpp_perplexity.py --model models/smollm2-135m-instruct \
        [--gguf models/download/SmolLM2-135M-Instruct.Q4_1.gguf] [--task wikitext] \
        [--limit 2048] [--context 512] [--json OUT.json]

The token stream, the prefix token and the windows are mlx_flash.eval's own
(eval/harness.py: tokenized here with the model folder's tokenizer), so the two
perplexities score the very same targets; only the runtime computing the logits
differs. llama.cpp runs in its own interpreter (`make peers-setup`, .venv-peers):
each window is a fresh evaluation (`reset` + `eval` with every position's logits),
as mlx_flash.eval's one-pass windows. llama.cpp multiplies Q4_x weights with
activations quantized to 8 bits (its CPU dot products), so its perplexity is not
bit-equal to an exact float32 runtime's on the same weights; the gap is that.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama

cfg = json.load(open(sys.argv[1]))
llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["context"] + 1, logits_all=True, n_threads=cfg["threads"],
            n_batch=cfg["context"], verbose=False)
seq, out = cfg["seq"], []
t0 = time.perf_counter()
for s, e in cfg["windows"]:
    inp, tgt = seq[s:e], seq[s + 1:e + 1]
    llm.reset()
    llm.eval(inp)
    logits = np.asarray(llm.scores[: len(inp)], dtype=np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))
    out += (lse - logits[np.arange(len(tgt)), tgt]).tolist()
json.dump({"nll": out, "seconds": time.perf_counter() - t0}, open(cfg["out"], "w"))
"""


def main():
    import mlx_flash  # noqa: F401  (first: it sets up MLX's BLAS before mlx_lm imports MLX)
    from mlx_flash.bench.peers.files import llama_cpp_python, source_gguf
    from mlx_flash.eval.harness import perplexity_metrics, prefix_token, tokenize_stream, windows
    from mlx_flash.eval.tasks import load_text
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct", help="the mlx_flash folder (its tokenizer)")
    ap.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs (default: the model's source)")
    ap.add_argument("--task", default="wikitext")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--limit", type=int, default=2048, help="tokens scored (default 2048)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    py, version = llama_cpp_python(a.llama_python)
    if py is None:
        sys.exit(f"llama_cpp_perplexity: no interpreter imports llama_cpp ({version}); run `make peers-setup`")
    gguf = a.gguf or source_gguf(Path(a.model), None)
    if gguf is None:
        sys.exit(f"llama_cpp_perplexity: {a.model} names no source GGUF; pass --gguf")
    tok = load_tokenizer(Path(a.model))
    prefix = prefix_token(tok)
    head = [prefix] if prefix is not None else []
    text, _ = load_text(a.task, a.data_dir)
    seq = head + tokenize_stream(tok, text, a.limit + 1 - len(head))
    n = min(a.limit, len(seq) - 1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"gguf": str(gguf), "context": a.context, "threads": os.cpu_count(), "seq": seq[: n + 1],
               "windows": windows(n, a.context), "out": str(Path(tmp) / "out.json")}
        (Path(tmp) / "cfg.json").write_text(json.dumps(cfg))
        t0 = time.perf_counter()
        subprocess.run([py, "-c", CHILD, str(Path(tmp) / "cfg.json")], check=True)
        res = json.loads(Path(cfg["out"]).read_text())
    nll = np.array(res["nll"])
    scored = tok.decode(seq[1: n + 1])
    m = perplexity_metrics(nll, len(scored.encode("utf-8")), len(scored.split()))
    out = {"runtime": f"llama.cpp (llama-cpp-python {version})", "gguf": str(gguf), "task": a.task,
           "context": a.context, "tokens": n, "metrics": m, "seconds": res["seconds"],
           "wall_seconds": time.perf_counter() - t0}
    print(f"llama.cpp {Path(gguf).name}: {a.task} perplexity {m['perplexity']:.3f} ± {m['perplexity_stderr']:.3f} "
          f"({n} tokens, context {a.context}, {res['seconds']:.1f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Per-expert bit widths on real weights (EdgeMoE §3.2): what
`mlx_flash.convert --expert-bits auto --max-ppl-loss T` chooses and what it costs on text the
search never saw.

No mixture of experts runs on this machine, so the model is SmolLM2-135M-Instruct rewritten as
one with the same function (bench/dense_as_moe.py: each FFN cut into 8 experts of 192 neurons,
every token routed to all 8): its experts are real weights whose quantization costs real
perplexity; what it cannot show is routing. Rows, each a conversion of the same float folder:
float experts; every expert at 8 / 4 bits; the search's choice at each tolerance; and the same
number of 4-bit experts as each choice but picked at random (does the importance matter?).
Each: WikiText-2 test perplexity (the first --limit tokens, windows of 512) and the experts' bytes on
flash (every token routes to every expert here: what a token reads without an expert buffer).

Run: .venv/bin/python benchmarks/moe-expert-bits/moe_expert_bits.py   (about 15 minutes on 2 cores)
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

GGUF = "models/download/SmolLM2-135M-Instruct.Q4_1.gguf"


def sh(cmd, log):
    r = subprocess.run(cmd, capture_output=True, text=True)
    Path(log).write_text(r.stdout + r.stderr)
    if r.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout + r.stderr


def main():
    import numpy as np

    from mlx_flash.bench.dense_as_moe import write_dense_as_moe
    from mlx_flash.layout.experts import expert_files
    from mlx_flash.layout.format import read_manifest

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/mlx_flash_expert_bits")
    p.add_argument("--tolerances", default="0.05,0.10,0.20")
    p.add_argument("--limit", type=int, default=8192, help="WikiText-2 test tokens scored")
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--out", default="benchmarks/moe-expert-bits")
    p.add_argument("--fresh", action="store_true", help="measure every row again (default: reuse the rows of "
                                                        "an earlier run found in --work)")
    a = p.parse_args()
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    hf = work / "hf"
    if not (hf / "config.json").exists():
        write_dense_as_moe(GGUF, hf)
    cfg = json.loads((hf / "config.json").read_text())
    n_layers, n_experts = cfg["num_hidden_layers"], cfg["num_local_experts"]

    def bits_file(name, bits):
        f = work / f"{name}.json"
        f.write_text(json.dumps({"bits": bits}))
        return f

    rows = [("float experts", [])]
    for b in (8, 4):
        rows.append((f"every expert at {b}-bit", ["--expert-bits", str(bits_file(f"all{b}", [[b] * n_experts] *
                                                                                   n_layers))]))
    tolerances = [float(t) for t in a.tolerances.split(",")]
    for t in tolerances:
        rows.append((f"--expert-bits auto --max-ppl-loss {t}", ["--expert-bits", "auto", "--max-ppl-loss", str(t),
                                                                "--calibration-tokens", str(a.calibration_tokens)]))
    report = []
    queue = list(rows)
    while queue:
        name, extra = queue.pop(0)
        if extra is not None:
            folder = work / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        else:  # as many experts at the low width as a search chose, picked at random
            low, high, k = name
            rng = np.random.default_rng(k)
            picks = set(rng.choice(n_layers * n_experts, size=k, replace=False).tolist())
            bits = [[low if layer * n_experts + e in picks else high for e in range(n_experts)]
                    for layer in range(n_layers)]
            name = f"{k} experts at {low}-bit picked at random, the rest at {high}-bit"
            folder = work / f"random-{k}"
            extra = ["--expert-bits", str(bits_file(f"random-{k}", bits))]
        saved = folder.with_suffix(".row.json")  # a row measured by an earlier run (the work folder is kept)
        if saved.exists() and not a.fresh:
            row = json.loads(saved.read_text())
            report.append(dict(row, folder=folder))
            if "auto" in extra and row["k"]:
                queue.insert(0, ((row["low"], row["high"], row["k"]), None))
            continue
        t0 = time.perf_counter()
        text = sh([py, "-m", "mlx_flash", "convert", "--model", str(hf), "--out", str(folder), "--dtype", "float32",
                   "--force", "--quiet", *extra], folder.with_suffix(".convert.log"))
        convert_s = time.perf_counter() - t0
        m = read_manifest(folder)
        size = sum(f["size"] for f in expert_files(m.experts))
        res = work / f"{folder.name}.eval.json"
        sh([py, "-m", "mlx_flash", "eval", "--model", str(folder), "--task", "wikitext", "--limit", str(a.limit),
            "--json", str(res), "--no-progress"], folder.with_suffix(".eval.log"))
        ppl = json.loads(res.read_text())["metrics"]["perplexity"]
        row = {"row": name, "folder": folder, "wikitext_ppl": ppl, "expert_bytes": size, "convert_s": round(convert_s, 1),
               "summary": next((line for line in text.splitlines() if line.startswith("expert bits:")), None)}
        if "auto" in extra:  # then the same count at random: does the importance matter?
            choice = json.loads((folder / "expert_bits.json").read_text())
            row.update(low=choice["low"], high=choice["high"], k=choice["k"])
            if choice["k"]:
                queue.insert(0, ((choice["low"], choice["high"], choice["k"]), None))
        report.append(row)
        saved.write_text(json.dumps(dict(row, folder=str(folder))))
        print(f"[expert-bits] {name}: perplexity {ppl:.3f}, experts {size / 1e6:.1f} MB", file=sys.stderr)
    base = report[0]["wikitext_ppl"]
    ref8 = report[1]["expert_bytes"]
    md = ["# Per-expert bit widths on SmolLM2-135M rewritten as 8 experts a layer (all routed)", "",
          "`.venv/bin/python benchmarks/moe-expert-bits/moe_expert_bits.py` — float32 compute, experts quantized group 64 "
          f"(float32 scales); WikiText-2 test, first {a.limit} tokens, windows of 512; the search on "
          f"{a.calibration_tokens} tokens of C4 validation.", "",
          "| experts | WikiText-2 ppl | vs float | experts on flash (= what a token reads with no buffer) | "
          "vs all 8-bit | convert (incl. search) |", "|---|---|---|---|---|---|"]
    for r in report:
        md.append(f"| {r['row']} | {r['wikitext_ppl']:.3f} | {r['wikitext_ppl'] / base:.3f}x | "
                  f"{r['expert_bytes'] / 1e6:.1f} MB | {r['expert_bytes'] / ref8:.3f} | {r['convert_s']} s |")
    md += ["", "The search's lines:", ""] + [f"- {r['row']}: {r['summary']}" for r in report if r["summary"]]
    (out / "expert-bits-smollm2.md").write_text("\n".join(md) + "\n")
    (out / "expert-bits-smollm2.json").write_text(json.dumps(
        [dict(r, folder=str(r["folder"])) for r in report], indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""How much of a --memory-limit the process actually uses: runs `mlx_flash.generate --memory-limit
LIMIT --stats` (one process each, no cgroup), and sets its peak RSS beside the plan's parts.

  unused  = limit - peak RSS
  beyond  = peak RSS - (weights held + runtime + KV + activations): what the MLX cache and the
            margin had to cover

usage: .venv/bin/python results/memory-slack-stop43/slack.py MODEL LIMIT[,LIMIT..] MODE[,MODE..] [PROMPT_REPEATS,..]
  a prompt is 'The history of the domestic cat begins in the Near East. ' x PROMPT_REPEATS
  (default 1,60: ~15 and ~700 tokens with the chat template)"""
import re
import subprocess
import sys

model, limits, modes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
repeats = [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "1,60").split(",")]
num = r"([\d.]+)"
print("| limit | mode | prompt tokens | mode run | weights held MB | runtime | KV | activations | MLX cache | margin "
      "| peak RSS MB | unused MB | beyond the counted parts MB | decode tok/s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for limit in limits:
    for mode in modes:
        for r in repeats:
            prompt = "The history of the domestic cat begins in the Near East. " * r
            cmd = [sys.executable, "-m", "mlx_flash.cli.generate", "--model", model, "--memory-limit", limit,
                   "--mode", mode, "--prompt", prompt, "--max-tokens", "16", "--stats"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            text = out.stdout + out.stderr
            m = re.search(rf"Memory limit {num} MB: weights {num}, runtime {num}, KV {num} \(\d+ tokens\), "
                          rf"activations {num}, MLX cache {num}, margin {num} MB; peak RSS {num} MB", text)
            held = re.search(rf"all weights in DRAM {num} MB", text)
            run = re.search(r"^Mode (\w+)", text, re.M)
            toks = re.search(rf"Prompt: (\d+) tokens", text)
            dec = re.search(rf"Generation: \d+ tokens, {num} tokens-per-sec", text)
            if not (m and held):
                print(f"| {limit} | {mode} | – | failed: {text.strip().splitlines()[-1][:120] if text.strip() else out.returncode} |")
                continue
            lim, w, rt, kv, act, cache, margin, peak = (float(x) for x in m.groups())
            h = float(held.group(1))
            print(f"| {lim:.0f} | {mode} | {toks.group(1)} | {run.group(1)} | {h:.1f} | {rt:.0f} | {kv:.0f} | {act:.0f} | "
                  f"{cache:.0f} | {margin:.0f} | {peak:.0f} | {lim - peak:.0f} | {peak - h - rt - kv - act:.0f} | "
                  f"{dec.group(1)} |", flush=True)

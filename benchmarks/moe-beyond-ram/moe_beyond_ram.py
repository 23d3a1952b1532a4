"""A mixture of experts larger than this machine's RAM, end to end:

1. write a random 4-bit mlx-lm folder of the shape (default Mixtral-8x7B, ~26 GB: what a user
   downloads; convert/random_model.write_mlx_lm_folder),
2. `mlx_flash convert` it inside a memory cgroup of --convert-limit (default 2 GB),
3. `mlx_flash generate` from the flash folder under --memory-budget (default 25 % of the model)
   inside a memory cgroup of --generate-limit, with --stats,
4. write the figures (wall time, cgroup peak, OOM kills, disk per folder, tok/s, the expert
   buffer's hit rate) to benchmarks/moe-beyond-ram/beyond-ram-<shape>.md and .json, and delete both folders
   unless --keep (together they take twice the model on disk).

Needs root (memory cgroups). Run: .venv/bin/python benchmarks/moe-beyond-ram/moe_beyond_ram.py
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9


def gb(n):
    return f"{n / GB:.2f} GB" if n else "?"


def du(folder):
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# runs a command and prints its peak RSS (the cgroup's peak also counts the page cache)
MAXRSS = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
          "print('max RSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, 'bytes'); sys.exit(rc)")


def run(runner, cmd, limit, log):
    with open(log, "w") as out:
        r = runner.run([sys.executable, "-c", MAXRSS, *cmd], limit_bytes=limit, timeout=7200, stdout=out,
                       stderr=subprocess.STDOUT)
    text = Path(log).read_text()
    m = re.search(r"max RSS (\d+) bytes", text)
    return r, text, int(m.group(1)) if m else None


def main():
    from mlx_flash.bench import peers
    from mlx_flash.convert.random_model import write_mlx_lm_folder
    from mlx_flash.home import default_home
    from mlx_flash.sizes import parse_size

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="mixtral-8x7b")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--convert-limit", default="2GB", help="the memory cgroup the conversion runs in")
    p.add_argument("--budget", default="25%", help="generate's --memory-budget (weights)")
    p.add_argument("--generate-limit", default="10GB", help="the memory cgroup generate runs in")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--home", default=None, help="where the two folders go (default $MLX_FLASH_HOME/bench)")
    p.add_argument("--keep", action="store_true", help="keep both folders")
    p.add_argument("--out", default="benchmarks/moe-beyond-ram")
    a = p.parse_args()

    home = Path(a.home) if a.home else Path(default_home()) / "bench"
    src, dst = home / f"{a.shape}-mlx-lm-q{a.bits}", home / f"{a.shape}-mlx-lm-q{a.bits}-flash"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"shape": a.shape, "bits": a.bits}
    free = shutil.disk_usage(home.parent if home.parent.exists() else "/").free
    print(f"[beyond-ram] {free / GB:.1f} GB free on disk", file=sys.stderr)

    t0 = time.perf_counter()
    if not (src / "config.json").exists():
        write_mlx_lm_folder(a.shape, src, bits=a.bits)
    report["write_s"] = round(time.perf_counter() - t0, 1)
    report["source_bytes"] = du(src)
    print(f"[beyond-ram] source {src}: {report['source_bytes'] / GB:.2f} GB", file=sys.stderr)

    version, why = peers.cgroup_support()
    if version is None:
        sys.exit(f"memory cgroups not usable here: {why}")
    convert_limit, gen_limit = parse_size(a.convert_limit), parse_size(a.generate_limit)
    py = sys.executable
    with peers.MemoryCgroupRunner(name="mlx_flash_beyond_ram") as runner:
        shutil.rmtree(dst, ignore_errors=True)
        peers.drop_caches()
        r, text, rss = run(runner, [py, "-m", "mlx_flash", "convert", "--model", str(src), "--out", str(dst)],
                      convert_limit, out / f"beyond-ram-{a.shape}-convert.log")
        report["convert"] = {"limit_bytes": convert_limit, "rc": r.returncode, "oom_killed": r.oom_killed,
                             "peak_bytes": r.peak_bytes, "max_rss_bytes": rss, "wall_s": round(r.wall_s, 1),
                             "cgroup": r.cgroup}
        if r.returncode != 0:
            print(text[-3000:], file=sys.stderr)
            sys.exit(f"convert failed: {r}")
        report["flash_bytes"] = du(dst)
        print(f"[beyond-ram] convert: {report['convert']}", file=sys.stderr)

        peers.drop_caches()
        cmd = [py, "-m", "mlx_flash", "generate", "--model", str(dst), "--memory-budget", a.budget,
               "--prompt", "The sea at night", "--max-tokens", str(a.tokens), "--stats", "--seed", "0",
               "--temp", "0.7"]
        r, text, rss = run(runner, cmd, gen_limit, out / f"beyond-ram-{a.shape}-generate.log")
        report["generate"] = {"limit_bytes": gen_limit, "budget": a.budget, "rc": r.returncode,
                              "oom_killed": r.oom_killed, "peak_bytes": r.peak_bytes, "max_rss_bytes": rss,
                              "wall_s": round(r.wall_s, 1), "command": " ".join(cmd[1:])}
        for key, pattern in (("prompt_tok_s", r"Prompt: .*?([\d.]+) tokens-per-sec"),
                             ("decode_tok_s", r"Generation: .*?([\d.]+) tokens-per-sec"),
                             ("slots", r"Experts: (\d+) slots"), ("hit_rate", r"hit rate ([\d.]+)"),
                             ("peak_rss_gb", r"Peak memory: ([\d.]+) GB")):
            m = re.search(pattern, text)
            report["generate"][key] = float(m.group(1)) if m else None
        if r.returncode != 0:
            print(text[-3000:], file=sys.stderr)
        print(f"[beyond-ram] generate: {report['generate']}", file=sys.stderr)

    failed = report["generate"]["rc"] != 0
    if failed:
        print(f"[beyond-ram] generate failed: both folders kept ({src}, {dst})", file=sys.stderr)
    if not a.keep and not failed:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
        report["deleted"] = [str(src), str(dst)]
    (out / f"beyond-ram-{a.shape}.json").write_text(json.dumps(report, indent=1))
    c, g = report["convert"], report["generate"]
    md = [f"# {a.shape} at {a.bits}-bit, random weights: larger than RAM, converted and generated",
          "", f"`.venv/bin/python benchmarks/moe-beyond-ram/moe_beyond_ram.py --shape {a.shape}` (this machine: see the closing note)",
          "", "| step | memory cgroup | peak of the cgroup (page cache incl.) | max RSS | OOM kills | wall | result |",
          "|---|---|---|---|---|---|---|",
          f"| write the mlx-lm folder | none | | | | {report['write_s']} s | {report['source_bytes'] / GB:.2f} GB on disk |",
          f"| convert | {c['limit_bytes'] / GB:.1f} GB | {(c['peak_bytes'] or 0) / GB:.2f} GB | {gb(c['max_rss_bytes'])} | "
          f"{'yes' if c['oom_killed'] else 'none'} | {c['wall_s']} s | {report['flash_bytes'] / GB:.2f} GB on disk |",
          f"| generate, --memory-budget {g['budget']} | {g['limit_bytes'] / GB:.1f} GB | "
          f"{(g['peak_bytes'] or 0) / GB:.2f} GB | {gb(g['max_rss_bytes'])} | {'yes' if g['oom_killed'] else 'none'} | {g['wall_s']} s | "
          f"rc {g['rc']}, decode {g['decode_tok_s']} tok/s, prompt {g['prompt_tok_s']} tok/s, "
          f"{g['slots']:.0f} expert slots, hit rate {g['hit_rate']} |" if g["slots"] else
          f"| generate | {g['limit_bytes'] / GB:.1f} GB | | | | {g['wall_s']} s | rc {g['rc']} (see the log) |",
          "", "Folders kept." if a.keep or failed else "Folders deleted after the run."]
    (out / f"beyond-ram-{a.shape}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""SmolLM2 4-bit, `--mode hybrid --memory-limit 354MB`, through the CLI in a memory cgroup of
354 MB and of 2 GB in turn (the page cache dropped before each): the decode's p50 and the
cost model's measured / predicted, as --stats prints them. A check of peers' one 1.23 row.

  .venv/bin/python results/cost-stop50/cgroup_generate.py [rounds]
"""

import re
import subprocess
import sys

import mlx_flash  # noqa: F401
from mlx_flash.bench.peers.cgroup import MemoryCgroupRunner

CMD = [sys.executable, "-m", "mlx_flash", "generate", "--model", "models/smollm2-135m-instruct", "--mode", "hybrid",
       "--memory-limit", "354MB", "--prompt", "Write a story about a robot.", "--max-tokens", "64", "--stats"]

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
with MemoryCgroupRunner() as runner:
    for _ in range(rounds):
        for limit_mb in (354, 2000):
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
            with open("/tmp/cgroup_generate.out", "w") as out:
                r = runner.run(CMD, limit_bytes=limit_mb * 10**6, timeout=600, stdout=out, stderr=subprocess.STDOUT)
            text = open("/tmp/cgroup_generate.out").read()
            p50 = re.search(r"p50 ([\d.]+)", text)
            ratio = re.search(r"measured median [\d.]+: ([\d.]+)x", text)
            print(f"cgroup {limit_mb} MB: p50 {p50.group(1) if p50 else '?'} ms, measured / predicted "
                  f"{ratio.group(1) if ratio else '?'}, OOM {r.oom_killed}", flush=True)

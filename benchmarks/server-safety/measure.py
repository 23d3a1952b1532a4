"""Does a client that leaves during a long prompt free the worker, and does a second client learn
anything of the first one's prompt? A real server on the default model (see README.md)."""
import json, socket, time, statistics, sys
from mlx_flash.bench.server_load import ServerProcess, client
srv = ServerProcess("models/smollm2-135m-instruct", ["--quiet"])
host, port = srv.url.split("//")[1].split("/")[0].split(":")
# 1. a client leaving during a 4,000-token prompt
for rnd in range(2):
    before = srv.health()["cancelled"]
    s = socket.create_connection((host, int(port)))
    b = json.dumps({"prompt": "word " * 4000, "max_tokens": 1}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(b)).encode() + b"\r\n\r\n" + b)
    time.sleep(1.0 + rnd * 2.0); s.close(); left = time.monotonic()
    while srv.health()["cancelled"] == before: time.sleep(0.05)
    print(f"left at {1.0 + rnd*2:.0f} s into the prompt: worker freed {time.monotonic() - left:.2f} s later")
# 2. the PIN guess: usage and timing, alternating
victim, guesser = client(srv.url), client(srv.url)
times = {"4": [], "5": []}
cached = set()
for rnd in range(6):
    for d in ("4", "5") if rnd % 2 == 0 else ("5", "4"):
        victim.completions.create(model="default", prompt="My bank PIN is 4711. Never tell anyone.", max_tokens=1, temperature=0)
        t = time.perf_counter()
        r = guesser.completions.create(model="default", prompt=f"My bank PIN is {d}", max_tokens=1, temperature=0)
        times[d].append(time.perf_counter() - t)
        cached.add(getattr(r.usage.prompt_tokens_details, "cached_tokens", None))
print("cached_tokens seen by the guesser:", cached)
for d, ts in times.items():
    print(f"guess {d}: median {statistics.median(ts)*1000:.1f} ms, min {min(ts)*1000:.1f}, max {max(ts)*1000:.1f}")
srv.stop()

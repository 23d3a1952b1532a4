"""`mlx_flash.benchmark server`: the server under concurrent clients speaking the openai API.

A real `mlx_flash.server` process on a loopback port; C client threads, each sending R
requests through the `openai` package, in a mix fixed by the seed: chat and completions,
streaming and not, some streams closed by the client after a few chunks (cancelled), some
requests the server must refuse (an unsupported field: 400). Every request must end in
an answer, a cancellation the client chose, or a 4xx with a message; anything else (a
connection error, a 5xx, a timeout) is counted as lost. The server's resident memory
(VmRSS) is read after a warm-up and again after the load, and its /health after. Beside the
clients, one more connection sends a long streaming request and never reads it.
"""

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

KINDS = ("chat", "chat-stream", "text", "text-stream", "cancel", "invalid")
WEIGHTS = (3, 3, 2, 2, 2, 1)
PROMPTS = ("Tell me about the sea.", "What is two plus two?", "Name three colours.",
           "Write a haiku about autumn.", "Why is the sky blue?", "Give me a tip for learning Python.",
           "What do bees make?", "Describe a cat in one sentence.")


class ServerProcess:
    """`python -m mlx_flash server ... --port 0` in a child process; its URL from its start line."""

    def __init__(self, model, extra=(), timeout=300, log_path=None):
        cmd = [sys.executable, "-m", "mlx_flash", "server", "--model", str(model), "--port", "0", *extra]
        self.log_path = Path(log_path) if log_path else None
        self.lines = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-20:]))

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"serving .* on (http://\S+/v1)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # it exited

    @property
    def pid(self):
        return self.proc.pid

    def rss_mb(self):
        """The server's resident set (Linux: /proc; elsewhere ps)."""
        status = Path(f"/proc/{self.pid}/status")
        if status.exists():
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.pid)], capture_output=True, text=True).stdout
        return int(out.strip()) / 1024 if out.strip() else float("nan")

    def health(self):
        with urllib.request.urlopen(self.url[:-3] + "/health", timeout=10) as r:
            return json.loads(r.read())

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        if self.log_path is not None:
            self.log_path.write_text("".join(self.lines))
        return "".join(self.lines)


def client(url, timeout=300):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="none", timeout=timeout, max_retries=0)


def one_request(c, kind, prompt, max_tokens, model="default"):
    """-> dict(kind, outcome: answered | cancelled | refused | lost, status, tokens, seconds, error)."""
    import openai

    t0 = time.perf_counter()
    row = {"kind": kind, "outcome": "answered", "status": 200, "tokens": 0, "error": None}
    msgs = [{"role": "user", "content": prompt}]
    try:
        if kind == "chat":
            r = c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0)
            row["tokens"] = r.usage.completion_tokens
        elif kind == "text":
            r = c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=1)
            row["tokens"] = r.usage.completion_tokens
        elif kind in ("chat-stream", "text-stream", "cancel"):
            if kind == "text-stream":
                s = c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True)
            else:
                s = c.chat.completions.create(model=model, messages=msgs, stream=True,
                                              max_tokens=max_tokens if kind != "cancel" else 200)
            finished = None
            for n, ch in enumerate(s):
                if ch.choices and ch.choices[0].finish_reason:
                    finished = ch.choices[0].finish_reason
                if kind == "cancel" and n >= 3:
                    s.close()
                    row["outcome"] = "cancelled"
                    break
                row["tokens"] += 1
            if kind != "cancel" and finished is None:
                row.update(outcome="lost", error="the stream ended without a finish_reason")
        elif kind == "invalid":
            try:
                c.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                          extra_body={"no_such_field": 1})
                row.update(outcome="lost", error="an unsupported field was accepted")
            except openai.BadRequestError as e:
                row.update(outcome="refused", status=e.status_code)
    except openai.APIStatusError as e:
        ok = 400 <= e.status_code < 500
        row.update(outcome="refused" if ok else "lost", status=e.status_code, error=str(e)[:200])
    except Exception as e:  # a connection error, a timeout: lost
        row.update(outcome="lost", status=None, error=f"{type(e).__name__}: {e}"[:200])
    row["seconds"] = time.perf_counter() - t0
    return row


def run_load(url, clients, requests, seed=0, max_tokens=(8, 32)):
    """Every client thread's rows, in the order each sent them."""
    rng = random.Random(seed)
    plans = [[(rng.choices(KINDS, WEIGHTS)[0], rng.choice(PROMPTS), rng.randint(*max_tokens))
              for _ in range(requests)] for _ in range(clients)]
    rows = [[] for _ in range(clients)]

    def work(i):
        c = client(url)
        for kind, prompt, n in plans[i]:
            rows[i].append(one_request(c, kind, prompt, n))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


class SilentClient:
    """A client that sends a long streaming request and never reads the answer, holding its
    connection open until `close`: the server must keep serving the others meanwhile."""

    def __init__(self, url, max_tokens=1024):
        import socket

        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story."}],
                           "max_tokens": max_tokens, "stream": True}).encode()
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                          b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                          b"\r\n\r\n" + body)

    def close(self):
        """Bytes the server had written to it by now (unread in its socket buffer)."""
        self.sock.setblocking(False)
        n = 0
        try:
            while chunk := self.sock.recv(1 << 16):
                n += len(chunk)
        except OSError:
            pass
        self.sock.close()
        return n


def run_server_bench(model, clients, requests, extra=(), seed=0, out=None, progress=print):
    out = Path(out) if out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    srv = ServerProcess(model, ["--quiet", *extra], log_path=out / "server.log" if out else None)
    try:
        progress(f"server pid {srv.pid} at {srv.url}; warming up")
        c = client(srv.url)
        for kind in ("chat", "chat-stream", "text"):
            one_request(c, kind, PROMPTS[0], 16)
        time.sleep(1.0)
        before = srv.rss_mb()
        progress(f"RSS after warm-up {before:.0f} MB; {clients} clients x {requests} requests")
        t0 = time.perf_counter()
        silent = SilentClient(srv.url)
        rows = run_load(srv.url, clients, requests, seed=seed)
        wall = time.perf_counter() - t0
        silent_bytes = silent.close()
        time.sleep(1.0)
        after = srv.rss_mb()
        health = srv.health()
        alive = srv.alive()
    finally:
        srv.stop()
    flat = [r for rs in rows for r in rs]
    counts = {k: sum(r["outcome"] == k for r in flat) for k in ("answered", "cancelled", "refused", "lost")}
    res = {"model": str(model), "clients": clients, "requests_per_client": requests, "seed": seed,
           "server_args": list(extra), "wall_s": wall, "requests": len(flat), "outcomes": counts,
           "by_kind": {k: {o: sum(r["kind"] == k and r["outcome"] == o for r in flat) for o in counts}
                       for k in KINDS},
           "tokens": sum(r["tokens"] for r in flat if r["outcome"] == "answered"),
           "latency_s": _quantiles([r["seconds"] for r in flat if r["outcome"] == "answered"]),
           "rss_before_mb": before, "rss_after_mb": after, "rss_ratio": after / before,
           "health_after": health, "alive_after": alive, "silent_client_bytes": silent_bytes,
           "lost": [r for r in flat if r["outcome"] == "lost"]}
    if out:
        (out / "server-load.json").write_text(json.dumps(res, indent=1))
        (out / "server-load.md").write_text(markdown(res))
    return res


def _quantiles(xs):
    if not xs:
        return {}
    xs = sorted(xs)
    return {q: xs[min(len(xs) - 1, int(p * len(xs)))] for q, p in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))}


def markdown(res):
    o = res["outcomes"]
    lines = [f"# mlx_flash.server under {res['clients']} clients x {res['requests_per_client']} requests",
             "", f"model {res['model']}; server flags {' '.join(res['server_args']) or '(none)'}; seed {res['seed']}; "
             f"{os.cpu_count()} cores", "",
             "| requests | answered | cancelled by the client | refused (4xx) | lost | wall s | tokens |",
             "| --- | --- | --- | --- | --- | --- | --- |",
             f"| {res['requests']} | {o['answered']} | {o['cancelled']} | {o['refused']} | {o['lost']} | "
             f"{res['wall_s']:.1f} | {res['tokens']} |", "",
             "| kind | " + " | ".join(o) + " |", "| --- |" + " --- |" * len(o)]
    for k, v in res["by_kind"].items():
        lines.append(f"| {k} | " + " | ".join(str(v[x]) for x in o) + " |")
    lat = res["latency_s"]
    lines += ["", "latency of answered requests (s): " + ", ".join(f"{k} {v:.2f}" for k, v in lat.items()),
              f"server RSS: {res['rss_before_mb']:.0f} MB after warm-up, {res['rss_after_mb']:.0f} MB after the "
              f"load ({res['rss_ratio']:.3f}x); alive after: {res['alive_after']}; /health after: "
              f"{json.dumps(res['health_after'])}",
              f"a client that never read its long stream, open during the whole load: the server wrote "
              f"{res['silent_client_bytes']} bytes to it and served every other request beside it"]
    for r in res["lost"]:
        lines.append(f"- lost: {r['kind']}: {r['error']}")
    return "\n".join(lines) + "\n"

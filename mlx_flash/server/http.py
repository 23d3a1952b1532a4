"""The HTTP side: routes, JSON bodies and server-sent events (the standard library's server).

Handler threads parse and check a request, hand it to the engine's queue, and write what
the engine's worker sends back: one JSON body, or `data: {chunk}` events ending with
`data: [DONE]` (chunked transfer, so a connection stays open for the next request).
A client that goes away mid-stream cancels its request at the next token.
"""

import ipaddress
import json
import queue
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .engine import Done, Failed, Start
from .requests import CHAT, TEXT, RequestError, parse_request

ROUTES = {"/v1/chat/completions": CHAT, "/chat/completions": CHAT, "/v1/completions": TEXT, "/completions": TEXT}


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, engine, model_id, log, aliases=()):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.engine, self.model_id, self.log, self.aliases = engine, model_id, log, set(aliases)
        self.created = int(time.time())

    def model_names(self):
        """What a request's "model" may say: the id /v1/models lists, the --model given, "default"."""
        return {self.model_id, "default"} | self.aliases


def _logprobs_chat(tokens):
    def entry(tid, text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(t, s, lp), top_logprobs=[entry(*x) for x in top]) for t, s, lp, top in tokens]}


def _logprobs_text(tokens, offset):
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for _, s, lp, top in tokens:
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({ts: tl for _, ts, tl in top})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def _usage(done, cached):
    u = {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
         "total_tokens": done.prompt_tokens + done.completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


class ClientGone(Exception):
    """The client closed its connection while its request waited or ran."""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "mlx_flash"
    timeout = 300  # a socket read or write that blocks this long ends the connection

    def log_message(self, fmt, *args):  # the server logs its own lines
        pass

    def handle(self):
        """Serve the connection's requests; a client that resets it (after closing a stream
        it had not read to the end, say) ends it quietly, as a close would."""
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError):
            self.close_connection = True

    # -- plumbing ---------------------------------------------------------------------------
    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _gone(self):
        """True when the client has closed its side (a pending next request is not that)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _next(self, job):
        """The job's next event; ClientGone if the client left while waiting for it (checked
        every 0.25 s, between events too: a long answer's)."""
        while True:
            now = time.monotonic()
            if now - getattr(self, "_checked", 0.0) > 0.25:
                self._checked = now
                if self._gone():
                    raise ClientGone()
            try:
                ev = job.events.get(timeout=0.25)
            except queue.Empty:
                continue
            if isinstance(ev, (Done, Failed)):
                job.finished = True
            return ev

    def _error(self, e):
        self.server.log(f"{self.command} {self.path} {e.status}: {e}")
        self._json(e.status, e.body())

    def _chunk(self, data):
        if self.request_version == "HTTP/1.0":  # no chunked transfer: the body ends when the connection does
            if data:
                self.wfile.write(data)
        else:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, body):
        self._chunk(b"data: " + (body if isinstance(body, bytes) else json.dumps(body).encode()) + b"\n\n")

    def _raw_body(self):
        """The body's bytes; a RequestError (the connection then closes: what is left of the
        body is not read) when it has no length, a bad one, or one over --max-body-bytes."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length is None:
            self.close_connection = True
            raise RequestError("send the body with a Content-Length", status=411)
        try:
            n = int(length)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise RequestError(f"bad Content-Length {length!r}")
        limit = self.server.engine.limits.max_body_bytes
        if n > limit:
            self.close_connection = True
            raise RequestError(f"the body is {n} bytes; this server takes at most {limit} (--max-body-bytes)",
                               status=413)
        return self.rfile.read(n)

    def _body(self):
        raw = self._raw_body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (JSONDecodeError is a ValueError)
            raise RequestError(f"the body is not JSON: {str(e)[:200]}") from None

    # -- routes -----------------------------------------------------------------------------
    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/health":
            e = self.server.engine
            self._json(200, {"status": "ok", "waiting": e.waiting, "served": e.served, "cancelled": e.cancelled})
        elif path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{"id": self.server.model_id, "object": "model",
                                                         "created": self.server.created, "owned_by": "mlx_flash"}]})
        else:
            self._error(RequestError(f"no route GET {path} (GET /v1/models, /health; POST /v1/chat/completions, "
                                     "/v1/completions)", status=404))

    def do_POST(self):
        path = self.path.split("?")[0]
        kind = ROUTES.get(path)
        try:
            if kind is None:
                self._raw_body()  # read (and drop) it: the connection stays usable
                raise RequestError(f"no route POST {path} (POST /v1/chat/completions, /v1/completions)", status=404)
            req = parse_request(self._body(), kind, self.server.engine.limits)
            if req.model is not None and req.model not in self.server.model_names():
                raise RequestError(f"model {req.model!r}: this server serves {self.server.model_id!r} "
                                   "(GET /v1/models)", status=404, param="model", code="model_not_found")
            job = self.server.engine.submit(req)
        except RequestError as e:
            return self._error(e)
        try:
            first = self._next(job)
            if isinstance(first, Failed):
                return self._error(first.error)
            assert isinstance(first, Start), first
            if req.stream:
                self._stream(req, job, first)
            else:
                self._whole(req, job, first)
        except (ClientGone, OSError):  # (BrokenPipeError, ConnectionResetError, a socket timeout: OSErrors)
            job.cancel.set()
            self.close_connection = True
            if not job.finished:
                self._drain(job)
            self.server.log(f"POST {path}: the client went away; request cancelled")

    @staticmethod
    def _drain(job):
        while not isinstance(job.events.get(), (Done, Failed)):
            pass

    def _head(self, req):
        rid = ("chatcmpl-" if req.kind == CHAT else "cmpl-") + uuid.uuid4().hex[:24]
        return {"id": rid, "created": int(time.time()), "model": self.server.model_id}

    def _whole(self, req, job, start):
        text, tokens = [], []
        while True:
            ev = self._next(job)
            if isinstance(ev, Failed):  # (after the prompt: e.g. an internal error)
                return self._error(ev.error)
            if isinstance(ev, Done):
                break
            text.append(ev.text)
            tokens += ev.tokens
        text = "".join(text)
        head = self._head(req)
        if req.kind == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": _logprobs_chat(tokens) if req.logprobs else None, "finish_reason": ev.finish_reason}
            body = dict(head, object="chat.completion", choices=[choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": _logprobs_text(tokens, 0) if req.logprobs else None,
                      "finish_reason": ev.finish_reason}
            body = dict(head, object="text_completion", choices=[choice])
        body["usage"] = _usage(ev, start.cached_tokens)
        self._json(200, body)
        self._log_done(req, ev, start)

    def _stream(self, req, job, start):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if self.request_version == "HTTP/1.0":
            self.close_connection = True
            self.send_header("Connection", "close")
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        head = self._head(req)
        chat = req.kind == CHAT
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_or_text, logprobs=None, finish=None):
            c = {"index": 0, "delta" if chat else "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish}
            body = dict(head, object=obj, choices=[c])
            if req.include_usage:
                body["usage"] = None
            return body

        if chat:
            self._event(chunk({"role": "assistant", "content": ""}))
        offset = 0
        while True:
            ev = self._next(job)
            if isinstance(ev, Failed):
                self._event({"error": ev.error.body()["error"]})
                break
            if isinstance(ev, Done):
                self._event(chunk({} if chat else "", finish=ev.finish_reason))
                if req.include_usage:
                    self._event(dict(head, object=obj, choices=[], usage=_usage(ev, start.cached_tokens)))
                self._log_done(req, ev, start)
                break
            if chat:
                lp = _logprobs_chat(ev.tokens) if req.logprobs else None
                self._event(chunk({"content": ev.text}, lp))
            else:
                lp = _logprobs_text(ev.tokens, offset) if req.logprobs else None
                self._event(chunk(ev.text, lp))
            offset += len(ev.text)
        self._event(b"[DONE]")
        self._chunk(b"")  # the chunked body's end

    def _log_done(self, req, done, start):
        tps = done.completion_tokens / done.seconds if done.seconds > 0 else 0.0
        self.server.log(f"POST {self.path} 200 {'stream ' if req.stream else ''}prompt {done.prompt_tokens} "
                        f"(cached {start.cached_tokens}) + {done.completion_tokens} tokens, {done.finish_reason}, "
                        f"{done.seconds:.2f} s ({tps:.1f} tok/s)")


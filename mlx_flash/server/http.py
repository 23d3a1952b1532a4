"""The HTTP side: routes, JSON bodies and server-sent events (the standard library's server).

One file past 500 lines: the routes, the checks of a request and the access rules share one
handler class.

Handler threads parse and check a request, hand it to the engine's queue, and write what
the engine's worker sends back: one JSON body, or `data: {chunk}` events ending with
`data: [DONE]` (chunked transfer, so a connection stays open for the next request).
A client that goes away mid-stream cancels its request at the next token (or at the next
prompt chunk while its prompt is read).

Safe by default, as llama.cpp's and Ollama's servers are (Access): a request whose Host is
not a loopback name is refused unless --allow-remote (DNS rebinding), one whose Origin is
another site's unless --allowed-origins lists it (a web page's cross-site requests), a POST
body that is not application/json (the "simple" requests a page may send without asking),
and, with --api-key, one without the key (every route but /health). Every refusal, on every
method and route, is a JSON error; allowed origins get CORS headers and their preflight 204.
Connections are bounded: at most --max-connections at once, idle ones closed after
--keep-alive seconds.
"""

import hmac
import ipaddress
import itertools
import json
import queue
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .engine import Done, Failed, Start
from .requests import CHAT, TEXT, RequestError, parse_request

ROUTES = {"/v1/chat/completions": CHAT, "/chat/completions": CHAT, "/v1/completions": TEXT, "/completions": TEXT}
METHODS = "GET, POST, OPTIONS"


def is_loopback(host):
    """`localhost` or a loopback address (127.0.0.0/8, ::1), as a bind address or a Host name."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_key(origin):
    """An Origin as a browser sends it, compared case-free and without its default port
    ("HTTPS://App.example:443" -> "https://app.example"); None where it is not one (a path,
    userinfo, control characters or spaces: nothing a browser sends, never echoed back)."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in origin):
        return None
    try:
        u = urlsplit(origin)
        port = u.port
    except ValueError:
        return None
    if u.scheme.lower() not in DEFAULT_PORTS or not u.hostname or u.path.strip("/") or u.query or u.fragment \
            or "@" in u.netloc:
        return None
    scheme, host = u.scheme.lower(), u.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" + ("" if port in (None, DEFAULT_PORTS[scheme]) else f":{port}")


TOKEN_CHARS = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _host_name(value):
    """The name in a Host header ("127.0.0.1:8080", "[::1]:80", "localhost") without its port."""
    value = value.strip()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass
class Access:
    """Who may use the server: the --allow-remote, --allowed-origins and --api-key flags."""

    allow_remote: bool = False  # any Host header (the operator listens beyond loopback on purpose)
    allowed_origins: tuple = ()  # Origins besides this server's own loopback one; "*": any
    api_keys: tuple = ()  # any of them, as "Authorization: Bearer KEY"; empty: no key asked
    share_prompt_cache: bool = False  # every client reuses the one kept cache (else: per client)
    keep_alive: float = 15.0  # seconds an idle connection is kept
    max_connections: int = 32


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, engine, model_id, log, aliases=(), access=None):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.engine, self.model_id, self.log, self.aliases = engine, model_id, log, set(aliases)
        self.access = access or Access()
        self.created = int(time.time())
        self.connections = 0
        self._count = threading.Lock()
        self._serial = itertools.count(1)  # a number per connection, never reused

    def process_request(self, request, client_address):
        """One thread per connection, at most --max-connections: past it, a 503 and the close."""
        with self._count:
            full = self.connections >= self.access.max_connections
            if not full:
                self.connections += 1
        if full:
            self.log(f"connection from {client_address[0]} refused: {self.access.max_connections} are open "
                     "(--max-connections)")
            body = json.dumps(RequestError(
                f"the server has {self.access.max_connections} connections open (--max-connections); retry later",
                status=503, code="too_many_connections").body()).encode()
            try:
                request.settimeout(2)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.connections -= 1

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
    default_request_version = "HTTP/1.1"  # a refused request line is answered with a status line and headers

    def setup(self):
        self.timeout = self.server.access.keep_alive  # a read or write that blocks this long ends the connection
        self.serial = next(self.server._serial)
        super().setup()

    def log_message(self, fmt, *args):  # the server logs its own lines
        pass

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (a bad request line, an unknown method, headers
        too long) as JSON errors, like every other answer; an unknown method is a 405."""
        if code == 501:
            code, message = 405, f"method {self.command} is not allowed (this server takes {METHODS})"
        message = message or self.responses.get(code, ("error",))[0]
        self.close_connection = True
        try:
            self._json(code, RequestError(message, status=code).body(), allow=code == 405)
        except OSError:
            pass

    # -- who may ask ------------------------------------------------------------------------
    def _origin_allowed(self, origin):
        """The page's Origin: this server's own (a loopback origin on this port), or one the
        operator listed."""
        key = origin_key(origin)
        if key is None:
            return False
        allowed = self.server.access.allowed_origins
        if "*" in allowed or key in allowed:
            return True
        u = urlsplit(key)
        return is_loopback(u.hostname) and u.port == self.server.server_address[1]

    def _guard(self, needs_key=True):
        """RequestError 403 / 401 / 415 when the request may not be served. A refused POST's body
        is read and dropped first (within --max-body-bytes), so that the client reads the answer
        rather than a reset connection; the connection then closes."""
        try:
            self._check_access(needs_key)
        except RequestError:
            if self.command == "POST":
                try:
                    self._raw_body()
                except (RequestError, OSError):
                    pass
                self.close_connection = True
            raise

    def _check_access(self, needs_key):
        access = self.server.access
        host = self.headers.get("Host")
        if host is not None and not access.allow_remote and not is_loopback(_host_name(host)):
            raise RequestError(f"Host {host[:80]!r} is not this machine: the server answers only requests sent to "
                               "a loopback name (localhost, 127.0.0.1, [::1]); start it with --allow-remote to serve "
                               "other names", status=403, code="host_not_allowed")
        origin = self.headers.get("Origin")
        if origin is not None and not self._origin_allowed(origin):
            raise RequestError(f"Origin {origin[:80]!r} is not allowed: a web page of another site may not use "
                               "this server; start it with --allowed-origins to allow one", status=403,
                               code="origin_not_allowed")
        if needs_key and access.api_keys and self._key_index() is None:
            raise RequestError("the API key is not valid" if self._bearer() else
                               "this server needs an API key: send \"Authorization: Bearer KEY\" (--api-key)",
                               status=401, code="invalid_api_key")
        if self.command == "POST":
            ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                raise RequestError(f"the body must be sent as Content-Type: application/json, not {ctype[:60]!r}",
                                   status=415, code="unsupported_media_type")

    def _bearer(self):
        """The key the request sends ("Authorization: Bearer KEY"), or ""."""
        given = self.headers.get("Authorization", "")
        return given[7:].strip() if given[:7].lower() == "bearer " else ""

    def _key_index(self):
        """Which --api-key the request sends (compared in constant time), or None."""
        key = self._bearer().encode()
        matches = [i for i, k in enumerate(self.server.access.api_keys) if hmac.compare_digest(key, k.encode())]
        return matches[0] if matches else None

    def _owner(self):
        """Whose kept prompt cache a request may reuse: everyone's with --share-prompt-cache;
        else the API key's holder (one identity per key), or this connection."""
        if self.server.access.share_prompt_cache:
            return "shared"
        i = self._key_index()
        return f"key {i}" if i is not None else f"connection {self.serial}"

    def handle(self):
        """Serve the connection's requests; a client that resets it (after closing a stream
        it had not read to the end, say) ends it quietly, as a close would."""
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError):
            self.close_connection = True

    # -- plumbing ---------------------------------------------------------------------------
    def _cors(self):
        """CORS headers for an allowed Origin (none for a request without one)."""
        headers = getattr(self, "headers", None)  # (none yet when the request line itself is refused)
        origin = headers.get("Origin") if headers is not None else None
        if origin is not None and self._origin_allowed(origin):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _json(self, status, body, allow=False):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if allow:
            self.send_header("Allow", METHODS)
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self._cors()
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
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
                if not self.server.engine.alive():
                    return Failed(RequestError("the server's worker has stopped", status=503))
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
    def do_OPTIONS(self):
        """CORS preflight: 204 with what an allowed Origin may send; refused as any request is."""
        try:
            self._guard(needs_key=False)  # (a preflight never carries the key)
        except RequestError as e:
            return self._error(e)
        self.send_response(204)
        self.send_header("Allow", METHODS)
        if self.headers.get("Origin") is not None:
            self._cors()
            self.send_header("Access-Control-Allow-Methods", METHODS)
            asked = [h.strip() for h in self.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
            asked = [h for h in asked if set(h) <= TOKEN_CHARS]  # (SDKs add their own: X-Stainless-*, OpenAI-*)
            self.send_header("Access-Control-Allow-Headers", ", ".join(dict.fromkeys(
                ["Authorization", "Content-Type"] + asked)))
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        path = self.path.split("?")[0]
        try:
            self._guard(needs_key=path != "/health")
        except RequestError as e:
            return self._error(e)
        if path == "/health":
            e = self.server.engine
            health = {"status": "ok" if e.damaged is None else "damaged", "waiting": e.waiting,
                      "served": e.served, "cancelled": e.cancelled, "connections": self.server.connections}
            if e.damaged is not None:
                health["error"] = e.damaged
            self._json(200 if e.damaged is None else 503, health)
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
            self._guard()
            if kind is None:
                self._raw_body()  # read (and drop) it: the connection stays usable
                raise RequestError(f"no route POST {path} (POST /v1/chat/completions, /v1/completions)", status=404)
            req = parse_request(self._body(), kind, self.server.engine.limits)
            if req.model is not None and req.model not in self.server.model_names():
                raise RequestError(f"model {req.model!r}: this server serves {self.server.model_id!r} "
                                   "(GET /v1/models)", status=404, param="model", code="model_not_found")
            req.owner = self._owner()
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
            if not job.finished and job.started:
                self._drain(job)  # (a job not started yet is dropped by the worker when it comes to it)
            self.server.log(f"POST {path}: the client went away; request cancelled")

    def _drain(self, job):
        while self.server.engine.alive():
            try:
                if isinstance(job.events.get(timeout=1.0), (Done, Failed)):
                    return
            except queue.Empty:
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
        self._cors()
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


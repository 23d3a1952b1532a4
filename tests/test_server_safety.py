"""mlx_flash.server, safe by default: what a web page, a hostile client or a damaged file can do
to it. Real server processes on the default model, spoken to with raw HTTP and the openai client."""

import http.client
import json
import shutil
import socket
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from mlx_flash.server.requests import TEXT, Limits, RequestError, parse_request
from helpers import flip_bit

LONG = "word " * 4000  # about 4,000 tokens: its prompt takes many chunks


@contextmanager
def serving(model, extra):
    """A real server process with these flags; stopped after, its log free of tracebacks."""
    pytest.importorskip("openai")
    from mlx_flash.bench.server_load import ServerProcess

    srv = ServerProcess(model, extra)
    try:
        yield srv
    finally:
        log = srv.stop()
        assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def server(smollm2):
    with serving(smollm2, ["--max-tokens-limit", "256"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed(smollm2):
    with serving(smollm2, ["--api-key", "k-one", "--api-key", "k-two", "--allowed-origins",
                           "https://app.example"]) as srv:
        yield srv


def address(srv):
    host, port = srv.url.split("//")[1].split("/")[0].split(":")
    return host, int(port)


def ask(srv, method, path, body=None, headers=None, timeout=120):
    """(status, headers, parsed JSON body or None) over a fresh connection."""
    c = http.client.HTTPConnection(*address(srv), timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    hdrs = dict({"Content-Type": "application/json"} if data is not None else {}, **(headers or {}))
    c.request(method, path, body=data, headers=hdrs)
    r = c.getresponse()
    raw = r.read()
    c.close()
    return r.status, r.headers, (json.loads(raw) if raw else None)


def oa(srv, key="none"):
    from openai import OpenAI

    return OpenAI(base_url=srv.url, api_key=key, timeout=120, max_retries=0)


BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


# -- cross-site use -----------------------------------------------------------------------------
def test_cross_site_requests_are_refused(server):
    # a page of another site: a "simple" request (text/plain) with its Origin
    status, _, body = ask(server, "POST", "/v1/completions", json.dumps(BODY).encode(),
                          {"Content-Type": "text/plain", "Origin": "https://evil.example"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    status, _, body = ask(server, "POST", "/v1/completions", json.dumps(BODY).encode(), {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in body["error"]["message"]
    status, _, body = ask(server, "POST", "/v1/completions", BODY, {"Origin": "https://evil.example"})
    assert status == 403
    # DNS rebinding: the page's name now points at 127.0.0.1, its requests carry that name
    status, _, body = ask(server, "POST", "/v1/completions", BODY, {"Host": "attacker.example"})
    assert status == 403 and body["error"]["code"] == "host_not_allowed" and "--allow-remote" in body["error"]["message"]
    assert ask(server, "GET", "/v1/models", headers={"Host": "attacker.example:8080"})[0] == 403
    status, _, body = ask(server, "OPTIONS", "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    # the server's own loopback origin, and plain local clients, are served
    host, port = address(server)
    status, _, body = ask(server, "POST", "/v1/completions", BODY, {"Origin": f"http://localhost:{port}"})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert ask(server, "POST", "/v1/completions", BODY, {"Host": f"localhost:{port}"})[0] == 200


def test_every_method_and_refusal_is_json(server):
    for method in ("PUT", "DELETE", "PATCH"):
        status, headers, body = ask(server, method, "/v1/completions", BODY)
        assert status == 405 and "not allowed" in body["error"]["message"] and "POST" in headers["Allow"]
    status, headers, body = ask(server, "HEAD", "/health")
    assert status == 405 and headers["Content-Type"] == "application/json" and body is None
    status, _, body = ask(server, "OPTIONS", "/v1/completions")
    assert status == 204
    # a broken request line: the standard library's own refusal, as JSON
    s = socket.create_connection(address(server), timeout=30)
    s.sendall(b"GET /x HTTP/1.1 extra\r\n\r\n")
    head = b""
    while chunk := s.recv(4096):
        head += chunk
    s.close()
    assert head.startswith(b"HTTP/1.1 400") and b'"error"' in head and b"<html" not in head.lower()


def test_api_key_and_allowed_origin(keyed):
    import openai

    with pytest.raises(openai.AuthenticationError, match="not valid"):
        oa(keyed, "wrong").completions.create(model="default", prompt="Hi", max_tokens=1)
    status, headers, body = ask(keyed, "POST", "/v1/completions", BODY)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
    assert ask(keyed, "GET", "/v1/models")[0] == 401
    assert ask(keyed, "GET", "/health")[0] == 200  # (for a supervisor: no key)
    assert oa(keyed, "k-two").completions.create(model="default", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    # an allowed origin: its preflight, then its request with CORS headers
    status, headers, _ = ask(keyed, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert {"Authorization", "x-stainless-os"} <= set(headers["Access-Control-Allow-Headers"].split(", "))
    # the origin as another browser may spell it: case and default port do not matter
    assert ask(keyed, "POST", "/v1/completions", BODY, {"Origin": "HTTPS://App.Example:443",
                                                        "Authorization": "Bearer k-one"})[0] == 200
    status, headers, body = ask(keyed, "POST", "/v1/completions", BODY,
                                {"Origin": "https://app.example", "Authorization": "Bearer k-one"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    for origin in ("https://other.example", "https://app.example.evil.example", "null",
                   "https://app.example/path"):
        assert ask(keyed, "POST", "/v1/completions", BODY, {"Origin": origin,
                                                            "Authorization": "Bearer k-one"})[0] == 403, origin
    # a refused request's big body is read, so the client gets the answer, not a reset connection
    status, _, body = ask(keyed, "POST", "/v1/completions", {"prompt": "x" * 200000, "max_tokens": 1})
    assert status == 401


# -- one request cannot break the others --------------------------------------------------------
def test_a_poisoning_request_leaves_sampling_working(server):
    c = oa(server)
    status, _, body = ask(server, "POST", "/v1/completions", dict(BODY, temperature=1.0, top_k=100000))
    assert status == 400 and body["error"]["param"] == "top_k" and "vocabulary" in body["error"]["message"]
    for i in range(10):  # sampled, no seed: the OpenAI SDK's default
        r = c.completions.create(model="default", prompt=f"Count to {i}:", max_tokens=3, temperature=0.8)
        assert r.usage.completion_tokens >= 1


def test_a_failed_sampler_is_followed_by_a_fresh_random_state():
    """The worker's repair: mlx_lm's compiled sampler, raising, leaves MLX's random state without
    a value (every later sample fails); the engine's failure path seeds it afresh."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlx_flash.server.engine import Engine

    logits = mx.random.normal((1, 100))
    with pytest.raises(Exception):
        mx.eval(make_sampler(temp=1.0, top_k=1000)(logits))
    with pytest.raises(Exception):
        mx.eval(make_sampler(temp=1.0)(logits))  # the broken state, as the server saw it
    Engine._fresh_state(SimpleNamespace(kept=SimpleNamespace(reset=lambda: None)))
    assert make_sampler(temp=1.0)(logits).item() < 100


def test_lone_surrogates_are_refused():
    for body in ({"prompt": "PIN \ud800"}, {"prompt": "x", "stop": ["\udfff"]}):
        with pytest.raises(RequestError, match="not valid Unicode"):
            parse_request(body, TEXT, Limits())


def test_lone_surrogate_over_http(server):
    raw = b'{"prompt": "hello \\ud800 there", "max_tokens": 2}'
    status, _, body = ask(server, "POST", "/v1/completions", raw)
    assert status == 400 and "not valid Unicode" in body["error"]["message"]


# -- one client's prompt is not another's ---------------------------------------------------------
def test_a_second_client_learns_nothing_of_the_first_prompt(server):
    secret = "My bank PIN is 4711. Never tell anyone."
    victim, guesser = oa(server), oa(server)  # two clients: two connections
    for guess in ("My bank PIN is 4", "My bank PIN is 5"):
        victim.completions.create(model="default", prompt=secret, max_tokens=1, temperature=0)
        r = guesser.completions.create(model="default", prompt=guess, max_tokens=1, temperature=0)
        details = r.usage.prompt_tokens_details
        assert details is None or not details.cached_tokens, (guess, r.usage)
    # the guesser's own next turn reuses its own cache
    guesser.completions.create(model="default", prompt="My bank PIN is 5", max_tokens=1, temperature=0)
    r = guesser.completions.create(model="default", prompt="My bank PIN is 5 or 6", max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_clients_are_told_apart_by_their_key(keyed):
    a1, a2, b = oa(keyed, "k-one"), oa(keyed, "k-one"), oa(keyed, "k-two")
    a1.completions.create(model="default", prompt="The secret word is walrus.", max_tokens=1, temperature=0)
    r = b.completions.create(model="default", prompt="The secret word is w", max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details is None
    a1.completions.create(model="default", prompt="The secret word is walrus.", max_tokens=1, temperature=0)
    r = a2.completions.create(model="default", prompt="The secret word is walrus!", max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the same key: the same client, another connection


# -- bounded work ----------------------------------------------------------------------------------
def test_a_client_leaving_during_its_prompt_frees_the_worker(server):
    before = server.health()["cancelled"]
    s = socket.create_connection(address(server), timeout=60)
    b = json.dumps({"prompt": LONG, "max_tokens": 1}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b)
    time.sleep(1.0)
    s.close()
    left = time.monotonic()
    while server.health()["cancelled"] == before and time.monotonic() - left < 60:
        time.sleep(0.1)
    freed = time.monotonic() - left
    assert server.health()["cancelled"] == before + 1
    # the whole prompt takes over a minute here; the worker stops after the chunk in flight
    assert freed < 20, freed
    r = oa(server).completions.create(model="default", prompt="Hi", max_tokens=1)
    assert r.usage.completion_tokens == 1


@pytest.fixture(scope="module")
def strict(smollm2):
    with serving(smollm2, ["--request-timeout", "1", "--max-connections", "3", "--keep-alive", "1"]) as srv:
        yield srv


def test_request_timeout(strict):
    status, _, body = ask(strict, "POST", "/v1/completions", {"prompt": LONG, "max_tokens": 1})
    assert status == 503 and body["error"]["code"] == "request_timeout"
    t = time.monotonic()
    no_end = {str(i): -100 for i in range(3)}  # (SmolLM2's end tokens: the answer runs until cut)
    r = oa(strict).completions.create(model="default", prompt="Once upon a time", max_tokens=2048, temperature=0,
                                      logit_bias=no_end)
    assert time.monotonic() - t < 10
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens < 2048


def test_connections_are_bounded_and_idle_ones_closed(strict):
    time.sleep(1.5)  # (the earlier tests' connections: closed after --keep-alive)
    socks = [socket.create_connection(address(strict), timeout=30) for _ in range(3)]
    time.sleep(0.3)
    extra = socket.create_connection(address(strict), timeout=30)
    head = b""
    while chunk := extra.recv(4096):
        head += chunk
    extra.close()
    assert head.startswith(b"HTTP/1.1 503") and b"--max-connections" in head
    for s in socks:  # idle past --keep-alive: the server closes them
        assert s.recv(1) == b""
        s.close()
    time.sleep(0.3)
    assert strict.health()["status"] == "ok"


def test_default_max_tokens_fits_a_small_context(smollm2):
    with serving(smollm2, ["--memory-limit", "2GB", "--ctx-size", "64", "--share-prompt-cache"]) as srv:
        assert "a request without max_tokens gets what its prompt leaves" in "".join(srv.lines)
        r = oa(srv).chat.completions.create(model="default", temperature=0, messages=[
            {"role": "user", "content": "Write a long story about the sea."}])
        assert r.usage.prompt_tokens + r.usage.completion_tokens <= 64 and r.usage.completion_tokens > 1
        assert r.choices[0].finish_reason == "length"
        # --share-prompt-cache: another client's prefix is reused (the operator's choice)
        r = oa(srv).chat.completions.create(model="default", max_tokens=1, messages=[
            {"role": "user", "content": "Write a long story about the sea!"}])
        assert r.usage.prompt_tokens_details.cached_tokens > 0


# -- a damaged model file while serving -----------------------------------------------------------
def test_a_damaged_file_is_the_servers_error(smollm2, tmp_path):
    from mlx_flash.layout.format import read_manifest

    out = tmp_path / "damaged"
    shutil.copytree(smollm2, out)
    lay = read_manifest(out).layout
    flip_bit(out / "ffn" / "layer_001.bin", 100 * lay.stride + lay.bundle_bytes // 2)
    with serving(out, ["--mode", "naive"]) as srv:
        status, _, body = ask(srv, "POST", "/v1/completions", BODY)
        assert status == 500 and body["error"]["type"] == "server_error" and body["error"]["code"] == "model_damaged"
        assert "layer_001.bin" in body["error"]["message"] and "checksum" in body["error"]["message"]
        status, _, health = ask(srv, "GET", "/health")
        assert status == 503 and health["status"] == "damaged" and "layer_001.bin" in health["error"]

"""mlx_flash.server: request checks and stop strings (no model), then a real server process on
the default model, spoken to with the openai package and with raw HTTP."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from mlx_flash.prompt_cache import common_prefix
from mlx_flash.server.engine import StopText
from mlx_flash.server.requests import CHAT, TEXT, Limits, RequestError, parse_request

LIMITS = Limits(max_tokens=256, default_max_tokens=32)


def chat(**kw):
    return dict({"messages": [{"role": "user", "content": "hi"}]}, **kw)


# -- requests ---------------------------------------------------------------------------------
def test_parse_chat_fields():
    r = parse_request(chat(max_tokens=7, temperature=0, top_p=0.5, stop="x", seed=3, logprobs=True,
                           top_logprobs=2, stream=True, stream_options={"include_usage": True}), CHAT, LIMITS)
    assert (r.max_tokens, r.temperature, r.top_p, r.stop, r.seed, r.top_logprobs, r.include_usage) == \
        (7, 0.0, 0.5, ["x"], 3, 2, True)
    assert parse_request(chat(), CHAT, LIMITS).max_tokens == 32  # the server's default
    assert parse_request(chat(max_completion_tokens=9), CHAT, LIMITS).max_tokens == 9
    parts = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parse_request(parts, CHAT, LIMITS).messages == [{"role": "system", "content": "ab"}]
    t = parse_request({"prompt": ["one"], "logprobs": 3}, TEXT, LIMITS)
    assert (t.prompt, t.logprobs, t.top_logprobs) == ("one", True, 3)
    assert parse_request({"prompt": [1, 2, 3]}, TEXT, LIMITS).prompt == [1, 2, 3]


@pytest.mark.parametrize("body,kind,needle", [
    (chat(no_such=1), CHAT, "unsupported field(s): no_such"),
    (chat(max_tokens=0), CHAT, "'max_tokens' must be at least 1"),
    (chat(max_tokens=257), CHAT, "at most 256"),
    (chat(max_tokens=2.5), CHAT, "'max_tokens' must be an integer"),
    (chat(temperature="hot"), CHAT, "'temperature' must be a number"),
    (chat(top_p=0), CHAT, "'top_p' must be above 0"),
    (chat(n=2), CHAT, "one choice per request"),
    (chat(presence_penalty=0.5), CHAT, "use repetition_penalty"),
    (chat(stop=["a", "b", "c", "d", "e"]), CHAT, "at most 4"),
    (chat(top_logprobs=2), CHAT, "needs \"logprobs\": true"),
    (chat(stream_options={"include_usage": True}), CHAT, "only for streaming"),
    (chat(response_format={"type": "json_object"}), CHAT, "only {\"type\": \"text\"}"),
    ({"messages": []}, CHAT, "non-empty list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, CHAT, "role 'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, CHAT, "only text parts"),
    ({"prompt": ""}, TEXT, "non-empty string"),
    ({"prompt": ["a", "b"]}, TEXT, "one prompt per request"),
    ({"prompt": "x", "logprobs": 11}, TEXT, "at most 10"),
    ({"prompt": "x", "echo": True}, TEXT, "'echo' is not supported"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, TEXT, "not a token id"),
    ([1, 2], TEXT, "JSON object"),
    (chat(n=True), CHAT, "one choice per request"),
    (chat(max_tokens=5, max_completion_tokens=5), CHAT, "give one"),
    (chat(max_tokens=10 ** 400), CHAT, "at most 256"),
    (chat(temperature=10 ** 400), CHAT, "'temperature' must be at least 0 and at most 2"),
    ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, CHAT, "unsupported field(s) name"),
])
def test_parse_refuses(body, kind, needle):
    with pytest.raises(RequestError) as e:
        parse_request(body, kind, LIMITS)
    assert needle in str(e.value) and e.value.status == 400
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_stop_text_holds_back_a_stop_prefix():
    s = StopText(["END", "\n\n"])
    assert s.add("Hello E") == ("Hello ", False)  # "E" may begin END
    assert s.add("N") == ("", False)
    assert s.add("Dx") == ("", True)  # the stop string and what follows are never sent
    s = StopText(["END"])
    assert s.add("EN") == ("", False) and s.add("ough") == ("ENough", False) and s.rest() == ""
    s = StopText([])
    assert s.add("a\n\n") == ("a\n\n", False)
    s = StopText(["ab"])
    assert s.add("xa") == ("x", False) and s.rest() == "a"  # (the end of the text: sent at the end)
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


def test_remote_bind_needs_a_flag():
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "server", "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--allow-remote" in r.stderr and "Traceback" not in r.stderr


# -- a real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm2):
    pytest.importorskip("openai")
    from mlx_flash.bench.server_load import ServerProcess

    srv = ServerProcess(smollm2, ["--max-prompt-tokens", "200", "--max-tokens-limit", "256",
                                  "--max-body-bytes", "20000"])
    yield srv
    log = srv.stop()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def local(smollm2):
    import mlx_flash

    return mlx_flash.load(str(smollm2))


def oa(server):
    from mlx_flash.bench.server_load import client

    return client(server.url, timeout=120)


def local_greedy(local, messages, n):
    import mlx_flash

    model, tok = local
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return mlx_flash.generate(model, tok, ids, max_tokens=n, temp=0.0)


def test_chat_equals_generate_streaming_or_not(server, local):
    c, msgs = oa(server), [{"role": "user", "content": "Write a long story about a dragon."}]
    whole = c.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    assert text == local_greedy(local, msgs, 16)
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_conversation_reuses_its_prefix(server, local):
    c = oa(server)
    msgs = [{"role": "user", "content": "My name is Ada. Remember it."}]
    first = c.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "What is my name?"}]
    second = c.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert second.choices[0].message.content == local_greedy(local, msgs, 12)  # the kept cache changes nothing


def test_completions_logprobs_and_stop(server, local):
    c = oa(server)
    r = c.completions.create(model="default", prompt="The capital of France is", max_tokens=6, temperature=0,
                             logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0 and abs(max(top.values()) - chosen) < 1e-4  # greedy: the best
    msgs = [{"role": "user", "content": "Write a long story about a dragon."}]
    full = local_greedy(local, msgs, 24)
    stop = full.split()[4]  # a word in the middle of the greedy answer
    r = c.chat.completions.create(model="default", max_tokens=24, temperature=0, stop=[stop, "zzzz"], messages=msgs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def raw(server, path, body=None, headers=None, method=None):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = dict({"Content-Type": "application/json"} if data is not None else {}, **(headers or {}))
    req = urllib.request.Request(server.url[:-3] + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_refusals_are_4xx_json(server):
    import openai

    c = oa(server)
    with pytest.raises(openai.NotFoundError, match="this server serves"):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 200 \\(--max-prompt-tokens\\)"):
        c.completions.create(model="default", prompt="word " * 400, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="unsupported field"):
        c.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  extra_body={"tools_choice": "auto"})
    status, body = raw(server, "/v1/chat/completions", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = raw(server, "/v1/completions", {"prompt": "x" * 30000})
    assert status == 413 and "--max-body-bytes" in body["error"]["message"]
    status, body = raw(server, "/v1/nothing", {})
    assert status == 404 and "no route" in body["error"]["message"]
    assert raw(server, "/health")[1]["status"] == "ok"
    models = raw(server, "/v1/models")[1]
    assert models["data"][0]["id"] == "smollm2-135m-instruct"


def test_http_framing_and_abandoned_requests(server):
    import http.client
    import socket

    host, port = server.url.split("//")[1].split("/")[0].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/nowhere", body=json.dumps({"x": 1}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 404 and "no route" in json.loads(r.read())["error"]["message"]
    c.request("GET", "/health")  # the same connection: the unknown route's body was read
    assert c.getresponse().status == 200
    c.close()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: -1\r\n\r\n")
    head = b""
    while chunk := s.recv(4096):  # (the server closes the connection after it)
        head += chunk
    head = head.decode()
    assert head.startswith("HTTP/1.1 400") and "Connection: close" in head and "bad Content-Length" in head
    s.close()
    status, body = raw(server, "/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}})
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]
    # a client that sends a long request and goes away before the answer: the server stops it
    before = server.health()["cancelled"]
    s = socket.create_connection((host, int(port)), timeout=60)
    b = json.dumps({"prompt": "Once upon a time", "max_tokens": 250, "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b)
    time.sleep(1.0)
    s.close()
    deadline = time.time() + 30
    while server.health()["cancelled"] == before and time.time() < deadline:
        time.sleep(0.2)
    assert server.health()["cancelled"] == before + 1


def test_concurrent_clients_with_cancellations(server):
    from mlx_flash.bench.server_load import run_load

    before = server.health()
    rows = [r for rs in run_load(server.url, clients=3, requests=3, seed=0, max_tokens=(4, 8)) for r in rs]
    assert not [r for r in rows if r["outcome"] == "lost"], rows
    kinds = {r["kind"] for r in rows}
    assert {"cancel", "invalid"} <= kinds, kinds  # (the seed's mix has both)
    assert all(r["outcome"] == "refused" and r["status"] == 400 for r in rows if r["kind"] == "invalid")
    expected = sum(r["kind"] != "invalid" for r in rows)
    deadline = time.time() + 60  # an abandoned stream ends when the server next writes to it
    while (after := server.health())["served"] - before["served"] < expected and time.time() < deadline:
        time.sleep(0.2)
    assert after["served"] - before["served"] == expected
    assert after["cancelled"] > before["cancelled"]  # the server stopped the abandoned streams
    assert server.alive()


def test_continuation_text_equals_one_decode(local):
    """A completion's text, token by token past several anchors, is the one decode of its tokens."""
    from mlx_flash.server.engine import ContinuationText

    _, tok = local
    ids = tok.encode("The capital of France is Paris. " * 20 + "déjà vu — 東京 🙂 end\n" * 8)
    c = ContinuationText(tok)
    assert len(ids) > 4 * c.ANCHOR_EVERY
    assert "".join(c.add(t) for t in ids) + c.rest() == tok.decode(ids, clean_up_tokenization_spaces=False)

"""Request bodies of the OpenAI API -> CompletionRequest, checked field by field.

Every field we take is checked for its type and range; a field we do not implement is a
400 that names it (never silently ignored), except the few that change nothing here at
their neutral value (n = 1, penalties 0, response_format text, user).
"""

import math
from dataclasses import dataclass, field

CHAT, TEXT = "chat", "text"
ROLES = ("system", "user", "assistant")
MAX_STOPS = 4
MAX_TOP_LOGPROBS = 10

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
          "stream_options", "repetition_penalty", "logit_bias", "n", "presence_penalty",
          "frequency_penalty", "user"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format"}
TEXT_FIELDS = COMMON | {"prompt", "logprobs", "echo"}


class RequestError(Exception):
    """A request we refuse: the HTTP status, a message for the client, the field it concerns."""

    def __init__(self, message, status=400, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self):
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What one request may ask: the server's --max-* flags."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_tokens: int = 2048  # the most a request may ask for
    default_max_tokens: int = 512  # when it asks for none
    queue_size: int = 32  # requests waiting beyond the one being served
    request_timeout: float | None = 600.0  # seconds a request may hold the worker (None: no limit)


@dataclass
class CompletionRequest:
    kind: str  # CHAT or TEXT
    model: str | None
    messages: list | None = None  # CHAT: [{"role", "content": str}]
    prompt: str | list | None = None  # TEXT: a string or token ids
    max_tokens: int = 512
    max_tokens_given: bool = True  # False: the server's default, clamped to what the context leaves
    owner: str = "shared"  # whose kept prompt cache it may reuse (the HTTP side sets it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float | None = None
    logit_bias: dict | None = None


def _number(body, name, lo, hi, default, integer=False, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and isinstance(v, float) and not v.is_integer()):
        raise RequestError(f"'{name}' must be {kind}, got {str(v)[:40]}", param=name)
    if (isinstance(v, float) and not math.isfinite(v)) or v < lo or v > hi or (lo_open and v == lo):
        lo_s = f"{'above' if lo_open else 'at least'} {lo}"
        raise RequestError(f"'{name}' must be {lo_s} and at most {hi}, got {str(v)[:40]}", param=name)
    return int(v) if integer else float(v)


def _bool(body, name, default=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be true or false, got {v!r}", param=name)
    return v


def _unicode(text, where, param):
    """text, refused when it holds a lone surrogate (JSON's "\\ud800" decodes to one): no
    tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{where} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                           f"{e.start}", param=param) from None
    return text


def _content(m, i):
    c = m.get("content")
    if isinstance(c, str):
        return _unicode(c, f"messages[{i}].content", "messages")
    if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts are supported "
                                   "([{\"type\": \"text\", \"text\": \"...\"}])", param="messages")
            parts.append(p["text"])
        return _unicode("".join(parts), f"messages[{i}].content", "messages")
    if c is None and m.get("role") == "assistant":
        return ""
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _messages(body):
    ms = body.get("messages")
    if not isinstance(ms, list) or not ms:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"}", param="messages")
    out = []
    for i, m in enumerate(ms):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role {role!r}: this server takes {', '.join(ROLES)} "
                               "(no tools)", param="messages")
        extra = set(m) - {"role", "content"}  # (a participant's "name": the templates have no place for it)
        if extra:
            raise RequestError(f"messages[{i}]: unsupported field(s) {', '.join(sorted(extra))}",
                               param="messages")
        out.append({"role": role, "content": _content(m, i)})
    return out


def _prompt(body):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list
    if isinstance(p, str) and p:
        return _unicode(p, "'prompt'", "prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise RequestError("one prompt per request: this server does not batch several prompts in one "
                           "completion (send one request each)", param="prompt")
    raise RequestError("'prompt' must be a non-empty string or a list of token ids", param="prompt")


def _stop(body):
    s = body.get("stop")
    if s is None:
        return []
    s = [s] if isinstance(s, str) else s
    if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s) or len(s) > MAX_STOPS:
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them",
                           param="stop")
    return [_unicode(x, "'stop'", "stop") for x in s]


def _neutral(body, name, neutral, hint):
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or v != neutral):
        raise RequestError(f"'{name}' {v!r} is not supported by this server{hint}", param=name)


def _logit_bias(body):
    b = body.get("logit_bias")
    if b is None:
        return None
    if not isinstance(b, dict):
        raise RequestError("'logit_bias' must be an object of token id -> bias", param="logit_bias")
    out = {}
    for k, v in b.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise RequestError(f"'logit_bias' key {k!r} is not a token id", param="logit_bias") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(f"'logit_bias'[{k}] must be a number in [-100, 100]", param="logit_bias")
        out[tok] = float(v)
    return out


def parse_request(body, kind, limits):
    """A CompletionRequest from a decoded JSON body of /v1/chat/completions (CHAT) or
    /v1/completions (TEXT); RequestError for anything we would not serve as asked."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = set(body) - (CHAT_FIELDS if kind == CHAT else TEXT_FIELDS)
    if unknown:
        raise RequestError(f"unsupported field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    _neutral(body, "n", 1, ": one choice per request")
    _neutral(body, "presence_penalty", 0, "; use repetition_penalty")
    _neutral(body, "frequency_penalty", 0, "; use repetition_penalty")
    if body.get("user") is not None and not isinstance(body.get("user"), str):
        raise RequestError("'user' must be a string", param="user")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise RequestError("'response_format': only {\"type\": \"text\"} is supported", param="response_format")
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise RequestError("'max_tokens' and 'max_completion_tokens': give one", param="max_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req = CompletionRequest(
        kind=kind, model=model,
        max_tokens=_number(body, name, 1, limits.max_tokens, limits.default_max_tokens, integer=True),
        max_tokens_given=body.get(name) is not None,
        temperature=_number(body, "temperature", 0, 2, 1.0),
        top_p=_number(body, "top_p", 0, 1, 1.0, lo_open=True),
        top_k=_number(body, "top_k", 0, 1 << 20, 0, integer=True),
        min_p=_number(body, "min_p", 0, 1, 0.0),
        seed=_number(body, "seed", -(1 << 63), (1 << 64) - 1, None, integer=True),
        stop=_stop(body), stream=_bool(body, "stream"),
        repetition_penalty=_number(body, "repetition_penalty", 0, 10, None, lo_open=True),
        logit_bias=_logit_bias(body))
    so = body.get("stream_options")
    if so is not None:
        if not req.stream:
            raise RequestError("'stream_options' is only for streaming requests (\"stream\": true)",
                               param="stream_options")
        if not isinstance(so, dict) or set(so) - {"include_usage"}:
            raise RequestError("'stream_options' takes only {\"include_usage\": true|false}", param="stream_options")
        req.include_usage = _bool(so, "include_usage")
    if kind == CHAT:
        req.messages = _messages(body)
        req.logprobs = _bool(body, "logprobs")
        req.top_logprobs = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True)
        if req.top_logprobs and not req.logprobs:
            raise RequestError("'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
    else:
        req.prompt = _prompt(body)
        n = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
        req.logprobs, req.top_logprobs = n is not None, n or 0
        if _bool(body, "echo"):
            raise RequestError("'echo' is not supported by this server", param="echo")
    return req

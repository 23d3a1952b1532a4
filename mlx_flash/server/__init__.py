"""An OpenAI-compatible HTTP server over a model loaded from flash (`mlx_flash.server`).

    requests.py  a request body -> a typed CompletionRequest, or a RequestError (4xx)
    engine.py    one worker thread owns the model: requests queue and are served in order,
                 the last conversation's KV cache is kept for the next request that shares
                 its prefix; stop strings, logprobs, cancellation
    http.py      the routes (/v1/chat/completions, /v1/completions, /v1/models, /health),
                 JSON and server-sent events, limits on the body, the bind address

The per-token runtime (the window, the caches) serves one sequence at a time, so the
engine runs one request at a time; concurrent clients wait in its queue.
"""

from .engine import Engine, Job
from .http import Server
from .requests import CompletionRequest, Limits, RequestError, parse_request

__all__ = ["CompletionRequest", "Engine", "Job", "Limits", "RequestError", "Server", "parse_request"]

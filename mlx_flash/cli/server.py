"""mlx_flash.server: an OpenAI-compatible HTTP server over a model loaded from flash.

    mlx_flash.server --model models/smollm2-135m-instruct --memory-limit 1GB
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Routes: POST /v1/chat/completions and /v1/completions (streaming or not), GET /v1/models,
GET /health. Requests are served one at a time, in order; the others wait in a queue.
"""

import argparse
import sys
import time

from . import default_model, run
from .generate import add_draft_args, add_model_args, load_with_draft


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_draft_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="0: any free port (the line at start says which)")
    p.add_argument("--allow-remote", action="store_true",
                   help="serve beyond this machine: a --host other than loopback, and requests whose Host header "
                        "is not a loopback name (pair it with --api-key)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="ask every request but GET /health for \"Authorization: Bearer KEY\" (401 otherwise); "
                        "repeat for several clients, each then with a prompt cache of its own; default "
                        "$MLX_FLASH_API_KEY (comma-separated), else none")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated web origins (https://app.example) whose pages may call the server, "
                        "with CORS headers; '*': any; default none besides the server's own loopback origin")
    p.add_argument("--share-prompt-cache", action="store_true",
                   help="let every client reuse the one kept prompt cache (one user, many connections); by "
                        "default a request reuses only its own client's: its API key's, else its connection's")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may hold the model (default 600; 0: no limit); past it the prompt "
                        "is refused (503) or the answer ends where it is")
    p.add_argument("--max-connections", type=int, default=32,
                   help="connections open at once (default 32); more get 503 at once")
    p.add_argument("--keep-alive", type=float, default=15.0,
                   help="seconds an idle connection is kept open (default 15)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="a request's max_tokens when it gives none (default 512, or --max-tokens-limit if lower)")
    p.add_argument("--max-tokens-limit", type=int, default=2048, help="the largest max_tokens a request may ask")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="the longest prompt a request may send (default: the --memory-limit plan's context, else 4096)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--queue-size", type=int, default=32, help="requests that may wait; more get 429")
    p.add_argument("--seed", type=int, default=None, help="seed MLX's sampler once at start")
    p.add_argument("--quiet", action="store_true", help="no line per request")
    return p


# long: the command read top to bottom: its body is one closure inside, for run()'s error handling
def main(argv=None):
    args = build_parser().parse_args(argv)

    # long: one linear pass, read top to bottom: each option checked, the model loaded, the server run and stopped
    def body():
        from ..errors import FlashError
        from ..server import Engine, Limits, Server
        from ..server.http import Access, is_loopback, origin_key

        if not is_loopback(args.host) and not args.allow_remote:
            raise FlashError(f"--host {args.host} listens beyond this machine: add --allow-remote to do it "
                             "(with --api-key, or anyone who reaches the port can use the model)")
        import os

        keys = args.api_key or [k for k in os.environ.get("MLX_FLASH_API_KEY", "").split(",") if k.strip()]
        keys = [k.strip() for k in keys]
        if any(not k or any(c.isspace() for c in k) for k in keys):
            raise FlashError("--api-key / MLX_FLASH_API_KEY: a key must be a non-empty word without spaces")
        origins = []
        for o in (o.strip() for o in args.allowed_origins.split(",") if o.strip()):
            key = "*" if o == "*" else origin_key(o)
            if key is None:
                raise FlashError(f"--allowed-origins: {o!r} is not an origin (http[s]://host[:port], no path) or '*'")
            origins.append(key)
        for name, lo in (("request_timeout", 0), ("keep_alive", 0.1)):
            if getattr(args, name) < lo:
                raise FlashError(f"--{name.replace('_', '-')} must be at least {lo}, got {getattr(args, name)}")
        for name in ("port", "max_tokens", "max_tokens_limit", "max_body_bytes", "queue_size", "max_prompt_tokens",
                     "max_connections"):
            v = getattr(args, name)
            lo, hi = (0, 65535) if name == "port" else (1, None)
            if v is not None and (v < lo or (hi is not None and v > hi)):
                raise FlashError(f"--{name.replace('_', '-')} must be "
                                 f"{'0..65535 (0: any free port)' if name == 'port' else 'at least 1'}, got {v}")
        if args.max_tokens is None:
            args.max_tokens = min(512, args.max_tokens_limit)
        elif args.max_tokens > args.max_tokens_limit:
            raise FlashError(f"--max-tokens {args.max_tokens} is above --max-tokens-limit {args.max_tokens_limit}")

        def log(msg):
            if not args.quiet or msg.startswith("error"):
                print(f"[mlx_flash.server {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

        import mlx.core as mx

        if args.seed is not None:
            mx.random.seed(args.seed)
        model, tokenizer, draft = load_with_draft(args)
        memory = model.runtime.memory
        max_prompt = args.max_prompt_tokens or (memory.context if memory is not None else 4096)
        if memory is not None and max_prompt > memory.context:
            raise FlashError(f"--max-prompt-tokens {max_prompt} is above the {memory.context} tokens of context "
                             "the --memory-limit plan holds a KV cache for (--ctx-size)")
        if memory is not None and args.max_tokens >= memory.context:
            log(f"the context holds {memory.context} tokens (--ctx-size): a request without max_tokens gets "
                f"what its prompt leaves of them, at most {args.max_tokens}")
        limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=max_prompt,
                        max_tokens=args.max_tokens_limit, default_max_tokens=args.max_tokens,
                        queue_size=args.queue_size, request_timeout=args.request_timeout or None)
        access = Access(allow_remote=args.allow_remote, allowed_origins=tuple(origins), api_keys=tuple(keys),
                        share_prompt_cache=args.share_prompt_cache, keep_alive=args.keep_alive,
                        max_connections=args.max_connections)
        if args.allow_remote and not keys:
            log("--allow-remote without --api-key: anyone who reaches the port can use the model")
        if draft is not None:
            log("with a draft model a prompt is read to its end before a client gone or --request-timeout "
                "is noticed (mlx_lm's speculative loop has no hook between prompt chunks)")
        engine = Engine(model, tokenizer, limits, log=log, draft=draft, num_draft_tokens=args.num_draft_tokens)
        from pathlib import Path

        given = args.model or default_model()
        model_id = Path(given).name if Path(given).exists() else given  # a folder's name, or the Hub repo
        try:
            server = Server((args.host, args.port), engine, model_id, log, aliases=(given,), access=access)
        except OSError as e:
            raise FlashError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        engine.start()
        host, port = server.server_address[:2]
        print(f"[mlx_flash.server] serving {model_id} on http://{host}:{port}/v1 "
              f"(prompts up to {max_prompt} tokens, max_tokens up to {args.max_tokens_limit}; "
              f"{'API key required' if keys else 'no API key'}; prompt cache "
              f"{'shared' if args.share_prompt_cache else 'per client'}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("[mlx_flash.server] stopping", file=sys.stderr)
        finally:
            server.server_close()
            engine.stop()

    return run(body, "mlx_flash.server")


if __name__ == "__main__":
    sys.exit(main())

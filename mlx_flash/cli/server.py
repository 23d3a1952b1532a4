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
                   help="allow a --host other than loopback (the server has no authentication)")
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


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        from ..errors import FlashError
        from ..server import Engine, Limits, Server
        from ..server.http import is_loopback

        if not is_loopback(args.host) and not args.allow_remote:
            raise FlashError(f"--host {args.host} listens beyond this machine and the server has no "
                             "authentication: add --allow-remote to do it anyway")
        for name in ("port", "max_tokens", "max_tokens_limit", "max_body_bytes", "queue_size", "max_prompt_tokens"):
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
        limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=max_prompt,
                        max_tokens=args.max_tokens_limit, default_max_tokens=args.max_tokens,
                        queue_size=args.queue_size)
        engine = Engine(model, tokenizer, limits, log=log, draft=draft, num_draft_tokens=args.num_draft_tokens)
        from pathlib import Path

        given = args.model or default_model()
        model_id = Path(given).name if Path(given).exists() else given  # a folder's name, or the Hub repo
        try:
            server = Server((args.host, args.port), engine, model_id, log, aliases=(given,))
        except OSError as e:
            raise FlashError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        engine.start()
        host, port = server.server_address[:2]
        print(f"[mlx_flash.server] serving {model_id} on http://{host}:{port}/v1 "
              f"(prompts up to {max_prompt} tokens, max_tokens up to {args.max_tokens_limit}); Ctrl-C stops",
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

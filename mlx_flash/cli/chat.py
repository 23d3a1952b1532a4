"""mlx_flash.chat: a chat loop on a model loaded from flash (reads stdin; works through a pipe)."""

import argparse
import sys

from . import run
from .generate import add_model_args, add_sampling_args, load_for_cli, sampling_kwargs


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.chat", description=__doc__)
    add_model_args(p)
    p.add_argument("--system-prompt", default=None)
    add_sampling_args(p)
    p.set_defaults(max_tokens=256)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from .. import stream_generate
        from ..generate import context_used

        if args.seed is not None:
            mx.random.seed(args.seed)
        model, tokenizer = load_for_cli(args)
        interactive = sys.stdin.isatty()
        if interactive:
            print("Type a message; 'q' or Ctrl-D quits, 'r' resets the conversation.")
        cache = make_prompt_cache(model)
        first = True
        while True:
            if interactive:
                print(">> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            query = line.strip()
            if not query:
                continue
            if query == "q":
                break
            if query == "r":
                cache, first = make_prompt_cache(model), True
                continue
            # The prompt cache carries the conversation: feed only the new turn.
            messages = []
            if first and args.system_prompt:
                messages.append({"role": "system", "content": args.system_prompt})
            messages.append({"role": "user", "content": query})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            memory = model.runtime.memory
            if memory is not None and context_used(cache) + len(prompt) + args.max_tokens > memory.context:
                # the KV cache the --memory-limit plan holds is full: start the conversation again
                print(f"[mlx_flash] the conversation reached the {memory.context} tokens of context the "
                      "memory limit plans for (--ctx-size): starting a new one", file=sys.stderr)
                cache = make_prompt_cache(model)
            first = False
            for resp in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                        prompt_cache=cache, **sampling_kwargs(args)):
                print(resp.text, end="", flush=True)
            print()

    return run(body, "mlx_flash.chat")


if __name__ == "__main__":
    sys.exit(main())

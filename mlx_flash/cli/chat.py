"""mlx_flash.chat: a conversation in the terminal with a model loaded from flash.

Type a message and Enter. The answer streams; a line after it gives its tokens/s. The whole
conversation stays in context (the oldest exchanges are dropped, with a notice, when it no
longer fits). Ctrl-C stops an answer and keeps the chat; Ctrl-D or /quit ends it.
Commands: /help, /reset, /stats, /save FILE, /load FILE, /quit. Works through a pipe too
(one message a line; the answers on stdout, the other lines on stderr).
"""

import argparse
import signal
import sys

from . import run
from .generate import (add_draft_args, add_model_args, add_sampling_args, check_sampling, check_text, load_with_draft,
                       sampling_kwargs, stats_lines, vocab_size_of)

HELP = """commands:
  /reset       start a new conversation (the system prompt stays)
  /stats       the conversation's context, the last answer's speed, the runtime's I/O
  /save FILE   write the conversation (JSON)
  /load FILE   continue a saved conversation
  /quit        end (or Ctrl-D); Ctrl-C stops an answer"""


def build_parser():
    p = argparse.ArgumentParser(prog="mlx_flash.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--load", default=None, metavar="FILE", help="start from a saved conversation (/save)")
    add_sampling_args(p)
    add_draft_args(p)
    p.set_defaults(max_tokens=256)
    return p


class StopOnCtrlC:
    """While an answer streams, Ctrl-C asks it to stop at the next token (a second one ends
    the chat); outside answers Ctrl-C behaves as usual."""

    def __init__(self):
        self.asked = False

    def __enter__(self):
        self.asked = False
        self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        return False

    def __call__(self):
        return self.asked


def say(msg):
    print(msg, file=sys.stderr, flush=True)


def read_line(stdin):
    """The next line of input as text, None at its end. A line that is not valid UTF-8 is said
    on stderr and comes back as "" (skipped): its bytes never reach the tokenizer."""
    buffer = getattr(stdin, "buffer", None)
    raw = buffer.readline() if buffer is not None else stdin.readline().encode("utf-8", "surrogatepass")
    if not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        say(f"[that line is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}): not sent; "
            "type it again as UTF-8 text]")
        return ""


def show_stats(conv, model):
    t = conv.last
    turns = sum(m["role"] == "user" for m in conv.messages)
    say(f"[conversation: {turns} exchanges, {conv.held} of {conv.context} tokens of context held]")
    if t is not None:
        say(f"[last answer: {t.tokens} tokens, {t.tps:.1f} tokens/s; prompt {t.prompt_tokens} tokens "
            f"({t.cached_tokens} from the kept cache) in {t.prompt_seconds:.2f} s]")
    for line in stats_lines(model.runtime.stats()["summary"]):
        say(f"[{line}]")


def main(argv=None):
    args = build_parser().parse_args(argv)

    def body():
        import mlx.core as mx

        from ..conversation import Conversation, read_messages
        from ..errors import FlashError

        check_sampling(args)
        check_text(args.system_prompt, "--system-prompt")
        if args.seed is not None:
            mx.random.seed(args.seed)
        saved = read_messages(args.load) if args.load else None  # its errors before the model loads
        model, tokenizer, draft = load_with_draft(args)
        check_sampling(args, vocab_size_of(model))
        conv = Conversation(model, tokenizer, args.system_prompt, args.max_tokens, sampling_kwargs(args),
                            draft=draft, num_draft_tokens=args.num_draft_tokens)
        if saved is not None:
            conv.messages = saved
            say(f"[loaded {len(saved)} messages from {args.load}]")
        interactive = sys.stdin.isatty()
        if interactive:
            say("Type a message and Enter; /help for commands, Ctrl-C stops an answer, Ctrl-D quits.")
        stopper = StopOnCtrlC()
        while True:
            if interactive:
                print(">> ", end="", flush=True)
            try:
                line = read_line(sys.stdin)
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print()
                continue
            if line is None:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("q", "/quit", "/exit"):
                break
            if text.startswith("/") or text == "r":
                cmd, _, arg = text.partition(" ")
                arg = arg.strip()
                try:
                    if cmd in ("/reset", "r"):
                        conv.reset()
                        say("[a new conversation]")
                    elif cmd == "/stats":
                        show_stats(conv, model)
                    elif cmd in ("/save", "/load") and not arg:
                        say(f"[{cmd} needs a file name: {cmd} FILE]")
                    elif cmd == "/save":
                        conv.save(arg)
                        say(f"[saved {len(conv.messages)} messages to {arg}]")
                    elif cmd == "/load":
                        conv.load(arg)
                        say(f"[loaded {len(conv.messages)} messages from {arg}]")
                    elif cmd == "/help":
                        say(HELP)
                    else:
                        say(f"[unknown command {cmd}; /help lists them]")
                except FlashError as e:  # a bad file: the chat goes on
                    say(f"[error: {e}]")
                continue
            try:
                with stopper:
                    turn = conv.ask(text, on_text=lambda s: print(s, end="", flush=True), stop=stopper)
            except FlashError as e:
                print()
                say(f"[error: {e}]")
                continue
            print()
            if turn.dropped:
                say(f"[the conversation outgrew the {conv.context}-token context: dropped its "
                    f"{turn.dropped} oldest exchange{'s' if turn.dropped > 1 else ''}]")
            note = {"interrupted": "; stopped", "length": f"; reached --max-tokens {args.max_tokens}"}.get(turn.finish, "")
            say(f"[{turn.tokens} tokens, {turn.tps:.1f} tokens/s; prompt {turn.prompt_tokens} tokens, "
                f"{turn.cached_tokens} of them kept from before{note}]")

    return run(body, "mlx_flash.chat")


if __name__ == "__main__":
    sys.exit(main())

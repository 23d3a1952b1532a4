"""A multi-turn conversation on a loaded model: the chat's library part.

The history is a list of messages; each turn renders the whole history with the model's
chat template and feeds only what the kept KV cache does not hold (prompt_cache). When the
history and an answer no longer fit the context, the oldest exchanges are dropped (the
system prompt stays) and the turn says how many. A turn can be stopped between two tokens
(`stop()`), keeping what was said so far.
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import FlashError
from .generate import draft_ahead
from .prompt_cache import PromptCache

ROLES = ("system", "user", "assistant")


@dataclass
class Turn:
    text: str
    finish: str  # "stop" (end of sequence) | "length" (max_tokens) | "interrupted"
    prompt_tokens: int
    cached_tokens: int
    tokens: int
    prompt_seconds: float
    seconds: float  # from the first token to the last
    dropped: int  # exchanges (user + assistant) dropped from the start to fit the context

    @property
    def tps(self):
        return (self.tokens - 1) / self.seconds if self.tokens > 1 and self.seconds > 0 else 0.0


def context_of(model):
    """Tokens a conversation may hold: the --memory-limit plan's KV cache, else the model's
    trained context (max_position_embeddings), else 4096."""
    memory = getattr(getattr(model, "runtime", None), "memory", None)
    if memory is not None:
        return memory.context
    args = getattr(model, "args", None)
    return int(getattr(args, "max_position_embeddings", 0) or 4096)


def is_utf8(text):
    """Whether `text` can be written as UTF-8: no lone surrogates (what JSON's "\\udcff" escapes
    and Python's decoding of bytes that are not UTF-8 leave), which a tokenizer cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_messages(path):
    """The messages of a saved conversation ({"messages": [...]}); FlashError naming the file."""
    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a path with a NUL byte in it
        raise FlashError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise FlashError(f"{path}: not a saved conversation (not UTF-8: byte {raw[e.start]:#04x} at "
                         f"offset {e.start})") from None
    except (ValueError, RecursionError) as e:  # ValueError: json.JSONDecodeError
        raise FlashError(f"{path}: not a saved conversation (not JSON: {e})") from None
    msgs = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(msgs, list):
        raise FlashError(f"{path}: not a saved conversation (no \"messages\" list)")
    for i, m in enumerate(msgs):
        if (not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
                or not is_utf8(m["content"])):
            raise FlashError(f"{path}: message {i + 1} is not {{\"role\": system|user|assistant, \"content\": "
                             "UTF-8 text}")
    return msgs


class Conversation:
    def __init__(self, model, tokenizer, system_prompt=None, max_tokens=256, sampling=None, context=None,
                 draft=None, num_draft_tokens=3):
        if getattr(tokenizer, "chat_template", None) is None:
            raise FlashError("this model has no chat template: use mlx_flash.generate for plain text")
        self.model, self.tokenizer = model, tokenizer
        self.max_tokens, self.sampling = max_tokens, dict(sampling or {})
        self.context = context or context_of(model)
        self.messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.kept = PromptCache(model, draft)
        if draft is not None:  # speculative decoding (draft.py)
            self.sampling.update(draft_model=draft.model, num_draft_tokens=num_draft_tokens)
        self.ahead = draft_ahead(self.sampling)  # tokens a draft proposes beyond the answer
        self.last = None

    def reset(self):
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.kept.reset()

    def save(self, path):
        """Write the conversation as JSON (UTF-8) through a temporary file beside `path`; a
        FlashError naming the path where it cannot be written (the messages are unchanged)."""
        path = Path(path).expanduser()
        if not path.name or path.is_dir():
            raise FlashError(f"{path}: is a folder; give a file name in it, e.g. {path / 'conversation.json'}")
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"messages": self.messages}, indent=1, ensure_ascii=False) + "\n",
                           encoding="utf-8")
            os.replace(tmp, path)
        except (OSError, ValueError) as e:  # ValueError: a path with a NUL byte in it
            try:
                tmp.unlink(missing_ok=True)
            except (OSError, ValueError):  # its folder is not one (a file, or missing): nothing was written
                pass
            raise FlashError(f"{path}: cannot write it ({getattr(e, 'strerror', None) or e}); "
                             "give a path in a folder you can write to") from None

    def load(self, path):
        self.messages = read_messages(path)

    @property
    def held(self):
        """Tokens of the conversation in the kept KV cache."""
        return self.kept.held

    def _ids(self, messages):
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def _fit(self, messages):
        """(the rendered prompt, exchanges dropped) within the context."""
        dropped = 0
        ids = self._ids(messages)
        while len(ids) + self.max_tokens + self.ahead > self.context:
            first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
            if first is None or first >= len(messages) - 1:  # only the new message is left
                raise FlashError(f"this message ({len(ids)} tokens with the template) + --max-tokens "
                                 f"({self.max_tokens}){f' + the drafted tokens ({self.ahead})' if self.ahead else ''} "
                                 f"exceed the context of {self.context} tokens")
            end = first + 1
            while end < len(messages) - 1 and messages[end]["role"] != "user":
                end += 1  # the exchange: a user message and the answers after it
            messages = messages[:first] + messages[end:]
            dropped += 1
            ids = self._ids(messages)
        return ids, messages, dropped

    def ask(self, text, on_text=None, stop=None):
        """Answer `text`; on_text(segment) as the answer streams; stop() -> True ends it early."""
        from .generate import stream_generate

        ids, messages, dropped = self._fit(self.messages + [{"role": "user", "content": text}])
        cache, cached = self.kept.prepare(ids)
        out, parts, finish = [], [], "length"
        t0 = time.perf_counter()
        t1 = None
        gen = stream_generate(self.model, self.tokenizer, ids[cached:], max_tokens=self.max_tokens,
                              prompt_cache=cache, **self.sampling)
        try:
            for resp in gen:
                if t1 is None:
                    t1 = time.perf_counter()
                out.append(resp.token)
                parts.append(resp.text)
                if on_text is not None and resp.text:
                    on_text(resp.text)
                if resp.finish_reason is not None:
                    finish = resp.finish_reason
                    break
                if stop is not None and stop():
                    finish = "interrupted"
                    break
        finally:
            gen.close()
        t2 = time.perf_counter()
        self.kept.keep(cache, ids + out)
        answer = "".join(parts)
        self.messages = messages + [{"role": "assistant", "content": answer}]
        eos = finish == "stop" and out and out[-1] in set(self.tokenizer.eos_token_ids)
        self.last = Turn(answer, finish, len(ids), cached, len(out) - int(bool(eos)),
                         (t1 or t2) - t0, t2 - (t1 or t2), dropped)
        return self.last

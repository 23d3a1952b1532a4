"""The chat as a person uses it: a real terminal (a pty), three turns that refer back to the
first, Ctrl-C during an answer, the commands; and the conversation's history in context."""

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from mlx_flash.conversation import Conversation, read_messages
from mlx_flash.errors import FlashError


class Terminal:
    """`python -m mlx_flash chat ...` on a pseudo-terminal: type lines, read the screen."""

    def __init__(self, *args):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_flash", "chat", *args], stdin=slave, stdout=slave,
                                     stderr=slave, preexec_fn=self._controlling_terminal, close_fds=True)
        os.close(slave)
        self.screen = ""

    @staticmethod
    def _controlling_terminal():
        """In the child: a session of its own whose controlling terminal is the pty, so that
        Ctrl-C typed there reaches it as SIGINT, as in a real terminal."""
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    def read_until(self, pattern, timeout=120):
        """Everything printed until `pattern` (a regex) appears after what was read before."""
        start, deadline = len(self.screen), time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.screen[start:])
            if m:
                return self.screen[start:start + m.end()]
            r, _, _ = select.select([self.master], [], [], 0.2)
            if r:
                try:
                    self.screen += os.read(self.master, 4096).decode(errors="replace").replace("\r\n", "\n")
                except OSError:
                    break
        raise AssertionError(f"timed out waiting for {pattern!r}; the screen:\n{self.screen}")

    def type(self, text):
        os.write(self.master, text.encode())

    def ctrl_c(self):
        os.write(self.master, b"\x03")  # the terminal turns it into SIGINT for the foreground process

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)
        os.close(self.master)


def test_three_turns_in_a_terminal(smollm2, tmp_path):
    t = Terminal("--model", str(smollm2), "--max-tokens", "48")
    try:
        t.read_until(r"/help for commands.*\n>> ")
        t.type("The secret word is pineapple.\n")
        t.read_until(r"tokens/s; prompt \d+ tokens, 0 of them kept from before\]\n>> ")
        t.type("What is 3 times 3?\n")
        t.read_until(r"\]\n>> ")
        t.type("What was the secret word?\n")
        third = t.read_until(r"tokens/s; prompt (\d+) tokens, (\d+) of them kept from before\]\n>> ")
        assert "pineapple" in third.lower()  # it answers from the first turn
        kept = re.search(r"prompt (\d+) tokens, (\d+) of them kept", third)
        assert int(kept.group(2)) > 40  # the first two exchanges came from the kept KV cache
        # Ctrl-C stops an answer; the chat goes on
        t.type("Write a very long story about a dragon.\n")
        t.read_until(r"\n\S+ \S+ \S+")  # a few words of the answer
        t.ctrl_c()
        t.read_until(r"; stopped\]\n>> ", timeout=30)
        t.type("/stats\n")
        stats = t.read_until(r"Mode \w+.*\]\n>> ")
        assert re.search(r"\[conversation: 4 exchanges, \d+ of \d+ tokens of context held\]", stats)
        t.type(f"/save {tmp_path / 'c.json'}\n")
        t.read_until(r"saved 8 messages")
        t.type("/reset\n")
        t.read_until(r"a new conversation\]\n>> ")
        t.type("/load /no/such/file.json\n")
        t.read_until(r"error: /no/such/file.json: cannot read it")
        t.type("\x04")  # Ctrl-D at the prompt ends the chat
        assert t.proc.wait(30) == 0
    finally:
        t.close()
    msgs = read_messages(tmp_path / "c.json")
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 4 and msgs[0]["content"] == "The secret word is pineapple."


@pytest.fixture(scope="module")
def loaded(smollm2):
    import mlx_flash

    return mlx_flash.load(str(smollm2))


def test_turns_equal_one_generation_of_the_whole_history(loaded):
    """The kept KV cache changes nothing: each answer is what generate gives on the whole history."""
    import mlx_flash

    model, tok = loaded
    conv = Conversation(model, tok, system_prompt="You are brief.", max_tokens=12, sampling={"temp": 0.0})
    for text in ("Name a colour.", "Name another one.", "And a third?"):
        before = conv.messages + [{"role": "user", "content": text}]
        turn = conv.ask(text)
        ids = tok.apply_chat_template(before, add_generation_prompt=True)
        assert turn.text == mlx_flash.generate(model, tok, ids, max_tokens=12, temp=0.0)
    assert turn.cached_tokens > 0 and conv.messages[0]["role"] == "system" and len(conv.messages) == 7


def test_history_is_trimmed_to_the_context(loaded, tmp_path):
    model, tok = loaded
    conv = Conversation(model, tok, system_prompt="Be brief.", max_tokens=8, sampling={"temp": 0.0}, context=110)
    turns = [conv.ask(f"Say the number {i}.") for i in range(5)]
    assert turns[0].dropped == 0 and sum(t.dropped for t in turns) >= 1
    assert all(t.prompt_tokens + 8 <= 110 for t in turns)
    assert conv.messages[0] == {"role": "system", "content": "Be brief."}
    assert conv.messages[-2]["content"] == "Say the number 4."
    with pytest.raises(FlashError, match="exceed the context of 110 tokens"):
        conv.ask("word " * 200)
    conv.save(tmp_path / "s.json")
    again = Conversation(model, tok, max_tokens=8, context=110)
    again.load(tmp_path / "s.json")
    assert again.messages == conv.messages
    (tmp_path / "bad.json").write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    with pytest.raises(FlashError, match="bad.json: message 1 is not"):
        read_messages(tmp_path / "bad.json")
    (tmp_path / "notjson.json").write_text("{")
    with pytest.raises(FlashError, match="notjson.json: not a saved conversation"):
        read_messages(tmp_path / "notjson.json")

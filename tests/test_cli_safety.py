"""The chat and generate tools under a user's mistakes: a bad /save or /load path, a line that
is not UTF-8, sampling flags out of range. Each is one clear line; the chat keeps the
conversation and goes on."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mlx_flash.cli import generate as generate_cli
from mlx_flash.conversation import read_messages
from mlx_flash.errors import FlashError


def chat_through_a_pipe(model, stdin: bytes, *args):
    """`python -m mlx_flash chat` with `stdin` piped in: (exit code, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "chat", "--model", str(model), "--max-tokens", "3", *args],
                       input=stdin, capture_output=True, timeout=120)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


def answers(stderr):
    """The chat's line after each answer: how many answers it gave."""
    return len(re.findall(r"\[\d+ tokens, [\d.]+ tokens/s; prompt", stderr))


def test_chat_save_to_unwritable_paths_keeps_the_conversation(smollm2, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    good = tmp_path / "good.json"
    lines = ["Say hello.",
             f"/save {a_file}/conv.json",  # under a regular file
             f"/save {tmp_path}/no/such/folder/conv.json",
             f"/save {tmp_path}",  # a folder
             "/save /",
             "Say bye.",
             f"/save {good}"]
    rc, _, err = chat_through_a_pipe(smollm2, ("\n".join(lines) + "\n").encode())
    assert rc == 0, err
    assert "Traceback" not in err
    assert f"[error: {a_file}/conv.json: cannot write it" in err
    assert f"[error: {tmp_path}/no/such/folder/conv.json: cannot write it" in err
    assert f"[error: {tmp_path}: is a folder" in err
    assert "[error: /: is a folder" in err
    assert answers(err) == 2  # the chat went on after the errors
    assert f"[saved 4 messages to {good}]" in err  # with the whole conversation
    assert [m["content"] for m in read_messages(good) if m["role"] == "user"] == ["Say hello.", "Say bye."]
    assert not list(tmp_path.glob("*.tmp"))


def test_chat_load_of_bad_files_keeps_the_conversation(smollm2, tmp_path):
    (tmp_path / "text.json").write_text("hello, not JSON")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "shape.json").write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}))
    (tmp_path / "latin1.json").write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}')
    (tmp_path / "surrogate.json").write_text('{"messages": [{"role": "user", "content": "a\\udcffb"}]}')
    good = tmp_path / "good.json"
    lines = ["Say hello.",
             f"/load {tmp_path}/missing.json",
             f"/load {tmp_path}/text.json",
             f"/load {tmp_path}/list.json",
             f"/load {tmp_path}/shape.json",
             f"/load {tmp_path}/latin1.json",
             f"/load {tmp_path}/surrogate.json",
             f"/load {tmp_path}",
             f"/save {good}"]
    rc, _, err = chat_through_a_pipe(smollm2, ("\n".join(lines) + "\n").encode())
    assert rc == 0, err
    assert "Traceback" not in err
    assert f"[error: {tmp_path}/missing.json: cannot read it" in err
    assert f"[error: {tmp_path}/text.json: not a saved conversation (not JSON" in err
    assert f"[error: {tmp_path}/list.json: not a saved conversation (no \"messages\" list)" in err
    assert f"[error: {tmp_path}/shape.json: message 1 is not" in err
    assert f"[error: {tmp_path}/latin1.json: not a saved conversation (not UTF-8" in err
    assert f"[error: {tmp_path}/surrogate.json: message 1 is not" in err
    assert f"[error: {tmp_path}: cannot read it" in err
    assert f"[saved 2 messages to {good}]" in err  # the conversation before the bad loads
    assert read_messages(good)[0]["content"] == "Say hello."


def test_chat_refuses_a_line_that_is_not_utf8_and_goes_on(smollm2, tmp_path):
    good = tmp_path / "good.json"
    stdin = b"Say hello.\n\xff\xfe hello\n" + f"/save {good}\n".encode() + b"Say bye.\n"
    rc, _, err = chat_through_a_pipe(smollm2, stdin)
    assert rc == 0, err
    assert "Traceback" not in err
    assert "not valid UTF-8" in err
    assert answers(err) == 2
    assert f"[saved 2 messages to {good}]" in err  # the bad line was not sent
    assert "hello" not in json.dumps(read_messages(good)[1:])


def test_chat_refuses_a_system_prompt_that_is_not_utf8(smollm2):
    r = subprocess.run([sys.executable.encode(), b"-m", b"mlx_flash", b"chat", b"--model", str(smollm2).encode(),
                        b"--system-prompt", b"be \xff brief"], input=b"hi\n", capture_output=True, timeout=120)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2 and "Traceback" not in err
    assert "--system-prompt is not valid UTF-8" in err


@pytest.mark.parametrize("flags, message", [
    (["--temp", "-1"], "--temp -1.0: "),
    (["--temp", "nan"], "--temp nan: "),
    (["--top-p", "5"], "--top-p 5.0: "),
    (["--top-p", "0"], "--top-p 0.0: "),
    (["--min-p", "-0.1"], "--min-p -0.1: "),
    (["--min-p", "2"], "--min-p 2.0: "),
    (["--top-k", "-3"], "--top-k -3: "),
    (["--repetition-penalty", "-1"], "--repetition-penalty -1.0: "),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0: "),
    (["--max-tokens", "-1"], "--max-tokens -1: "),
    (["--seed", "-1"], "--seed -1: "),
])
def test_generate_refuses_sampling_flags_out_of_range_before_loading(flags, message, capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(generate_cli, "load_with_draft", no_loading)
    monkeypatch.setattr(generate_cli, "load_for_cli", no_loading)
    assert generate_cli.main(["--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mlx_flash.generate: error: {message}") and "\n" == err[-1] and err.count("\n") == 1


def test_generate_refuses_output_paths_it_cannot_write_before_loading(tmp_path, capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the output paths were checked")

    monkeypatch.setattr(generate_cli, "load_with_draft", no_loading)
    monkeypatch.setattr(generate_cli, "load_for_cli", no_loading)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    assert generate_cli.main(["--prompt", "hi", "--stats-json", f"{a_file}/stats.json"]) == 2
    assert f"error: --stats-json {a_file}/stats.json: {a_file} is not a folder" in capsys.readouterr().err
    batch = tmp_path / "b.jsonl"
    batch.write_text('"hi"\n')
    assert generate_cli.main(["--batch-file", str(batch), "--batch-out", str(tmp_path)]) == 2
    assert f"error: --batch-out {tmp_path}: is a folder" in capsys.readouterr().err


def test_generate_refuses_top_k_of_the_whole_vocabulary(smollm2, capsys):
    assert generate_cli.main(["--model", str(smollm2), "--prompt", "hi", "--temp", "0.5", "--top-k", "100000",
                              "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "mlx_flash.generate: error: --top-k 100000: must be below the model's vocabulary of 49152" in err
    assert generate_cli.main(["--model", str(smollm2), "--prompt", "hi", "--temp", "0.5", "--top-k", "49151",
                              "--max-tokens", "2"]) == 0


def test_generate_refuses_a_prompt_that_is_not_utf8(smollm2, tmp_path):
    r = subprocess.run([sys.executable, "-m", "mlx_flash", "generate", "--model", str(smollm2), "--prompt", "-",
                        "--max-tokens", "2"], input=b"\xff\xfe hello\n", capture_output=True, timeout=120)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2 and "Traceback" not in err
    assert "--prompt -: the standard input is not valid UTF-8" in err
    batch = tmp_path / "b.jsonl"
    batch.write_text('"fine"\n"a\\udcffb"\n')
    with pytest.raises(FlashError, match=r"b.jsonl:2: not valid UTF-8"):
        generate_cli.read_batch_file(batch)


def test_chat_refuses_sampling_flags_out_of_range(smollm2):
    rc, _, err = chat_through_a_pipe(smollm2, b"hi\n", "--top-p", "5")
    assert rc == 2 and "mlx_flash.chat: error: --top-p 5.0: " in err and "Traceback" not in err
    rc, _, err = chat_through_a_pipe(smollm2, b"hi\n", "--temp", "0.5", "--top-k", "49152")
    assert rc == 2 and "mlx_flash.chat: error: --top-k 49152: must be below" in err and "Traceback" not in err


def test_check_sampling_names_what_the_caller_names():
    """The rule on its own: any object with the attributes, named as the caller names them."""
    check_sampling = generate_cli.check_sampling
    ok = SimpleNamespace(temp=0.7, top_p=1.0, top_k=40, min_p=0.05, repetition_penalty=None, max_tokens=8)
    check_sampling(ok, vocab_size=41)
    with pytest.raises(FlashError, match=r"^'top_k' 40: must be below the model's vocabulary of 40 tokens"):
        check_sampling(ok, vocab_size=40, name=lambda field: repr(field))
    check_sampling(SimpleNamespace(temp=0.0))  # absent settings are not checked

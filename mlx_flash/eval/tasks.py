"""Evaluation data: perplexity texts and zero-shot multiple-choice items.

Perplexity tasks give one text (scored as one token stream):
  wikitext  WikiText-2 raw, test split (`wikitext-2-raw/wiki.test.raw`: the
            split's non-empty rows, CRLF; read as rows joined by "\\n")
  c4        the 2000 C4 validation documents of `c4/c4-validation-2k.jsonl`,
            joined by a blank line ("\\n\\n")
  PATH      a user's file: .jsonl (one JSON object per line with a "text"
            field; documents joined by a blank line) or any other file read
            as UTF-8 text

Multiple-choice tasks give `MCItem`s built the way lm-evaluation-harness
builds its requests (context, and each choice scored as the continuation
" " + choice, the harness's default target delimiter):
  arc_easy, arc_challenge  AI2 ARC (Test split, or Dev): context
            "Question: {stem}\\nAnswer:", choices the answer texts
  hellaswag validation split (10042 items): context
            preprocess("{activity_label}: {ctx_a} {ctx_b.capitalize()}"),
            choices preprocess(ending) (see `hellaswag_preprocess`)

The data directory is $MLX_FLASH_DATA, else shared/data in the checkout's parent
folder.
"""

import gzip
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from ..errors import FlashError

PERPLEXITY_TASKS = ("wikitext", "c4")
CHOICE_TASKS = ("arc_easy", "arc_challenge", "hellaswag")
TASKS = PERPLEXITY_TASKS + CHOICE_TASKS

FILES = {
    "wikitext": "wikitext-2-raw/wiki.test.raw",
    "c4": "c4/c4-validation-2k.jsonl",
    "arc_easy": "zero-shot/arc/ARC-Easy-{split}.jsonl",
    "arc_challenge": "zero-shot/arc/ARC-Challenge-{split}.jsonl",
    "hellaswag": "zero-shot/hellaswag/hellaswag_val_full.txt.gz",
}
ARC_SPLITS = {"test": "Test", "dev": "Dev"}


def default_data_dir():
    env = os.environ.get("MLX_FLASH_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass
class MCItem:
    """One multiple-choice question: score " " + choice after `context` for each choice."""

    id: str
    context: str
    choices: List[str]
    gold: int
    delimiter: str = " "
    meta: dict = field(default_factory=dict)

    @property
    def continuations(self):
        return [self.delimiter + c for c in self.choices]


def _data_file(task, data_dir=None, **fmt):
    path = Path(data_dir or default_data_dir()) / FILES[task].format(**fmt)
    if not path.is_file():
        raise FlashError(f"{task}: data file {path} is missing (set --data-dir or $MLX_FLASH_DATA)")
    return path


# --- perplexity texts


def is_path_like(task):
    return os.sep in task or "/" in task or Path(task).suffix != "" or Path(task).exists()


def load_text(task, data_dir=None):
    """(text, description) of a perplexity task or a user's file; FlashError if missing or empty."""
    if task == "wikitext":
        path = _data_file(task, data_dir)
        text = _read_text(path).replace("\r\n", "\n")
        desc = f"WikiText-2 raw test ({path})"
    elif task == "c4":
        path = _data_file(task, data_dir)
        text = _read_jsonl_text(path)
        desc = f"C4 validation, 2000 documents ({path})"
    else:
        path = Path(task).expanduser()
        if not path.exists():
            raise FlashError(f"missing file: {task}")
        if not path.is_file():
            raise FlashError(f"not a file: {task}")
        if path.suffix.lower() == ".jsonl":
            text = _read_jsonl_text(path)
        else:
            text = _read_text(path).replace("\r\n", "\n")
        desc = str(path)
    if not text.strip():
        raise FlashError(f"{task}: the text is empty")
    return text, desc


def _read_text(path):
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FlashError(f"{path}: not UTF-8 text ({e})")
    except OSError as e:
        raise FlashError(f"{path}: unreadable ({e})")


def _read_jsonl_text(path):
    docs = []
    for i, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise FlashError(f"{path}:{i}: not JSON ({e})")
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise FlashError(f'{path}:{i}: no "text" field')
        docs.append(row["text"])
    return "\n\n".join(docs)


# --- multiple choice


def load_arc(task, split="test", data_dir=None):
    """AI2 ARC items (`arc_easy` or `arc_challenge`), in file order."""
    if split not in ARC_SPLITS:
        raise FlashError(f"unknown ARC split '{split}' (choose from {', '.join(ARC_SPLITS)})")
    path = _data_file(task, data_dir, split=ARC_SPLITS[split])
    items = []
    for i, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            q = row["question"]
            labels = [c["label"] for c in q["choices"]]
            choices = [c["text"] for c in q["choices"]]
            gold = labels.index(row["answerKey"])
        except (ValueError, KeyError, TypeError) as e:
            raise FlashError(f"{path}:{i}: not an AI2 ARC item ({e})")
        items.append(MCItem(id=row.get("id", str(i)), context=f"Question: {q['stem']}\nAnswer:",
                            choices=choices, gold=gold))
    return items


def hellaswag_preprocess(text):
    """lm-evaluation-harness's HellaSwag clean-up (WikiHow bracket artifacts)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


_SENTENCE_END = re.compile(r"[.!?] ")


def restore_ctx_b_capital(line):
    """The harness builds ctx_a + " " + ctx_b.capitalize(); the file keeps the dataset's ctx
    (ctx_b in lower case). ActivityNet contexts end in that ctx_b fragment (no final
    punctuation), WikiHow ones have an empty ctx_b and end a sentence: capitalize the
    fragment after the last sentence end when the context does not end one."""
    label, sep, ctx = line.partition(": ")
    if not sep or not ctx or ctx.rstrip()[-1:] in ".!?\"')":
        return line
    ends = list(_SENTENCE_END.finditer(ctx))
    start = ends[-1].end() if ends else 0
    frag = ctx[start:]
    if not frag[:1].islower():
        return line
    return label + sep + ctx[:start] + frag.capitalize()


def load_hellaswag(data_dir=None, capitalize_ctx_b=True):
    """HellaSwag validation items from the 6-lines-per-item text file."""
    path = _data_file("hellaswag", data_dir)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise FlashError(f"{path}: unreadable ({e})")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise FlashError(f"{path}: {len(lines)} lines, not 6 per item")
    items = []
    for k in range(0, len(lines), 6):
        ctx, label, endings = lines[k], lines[k + 1], lines[k + 2: k + 6]
        if not label.strip().isdigit() or int(label) > 3:
            raise FlashError(f"{path}:{k + 2}: gold label '{label}' is not 0-3")
        if capitalize_ctx_b:
            ctx = restore_ctx_b_capital(ctx)
        items.append(MCItem(id=str(k // 6), context=hellaswag_preprocess(ctx),
                            choices=[hellaswag_preprocess(e) for e in endings], gold=int(label)))
    return items


def load_choice_task(task, split=None, data_dir=None):
    if task in ("arc_easy", "arc_challenge"):
        return load_arc(task, split or "test", data_dir)
    if task == "hellaswag":
        return load_hellaswag(data_dir)
    raise FlashError(f"'{task}' is not a multiple-choice task")


def resolve_task(task):
    """'perplexity' or 'choice'; FlashError for an unknown name or a missing file."""
    if task in PERPLEXITY_TASKS:
        return "perplexity"
    if task in CHOICE_TASKS:
        return "choice"
    if is_path_like(task):
        p = Path(task).expanduser()
        if not p.exists():
            raise FlashError(f"missing file: {task}")
        if not p.is_file():
            raise FlashError(f"not a file: {task}")
        return "perplexity"
    raise FlashError(f"unknown task '{task}' (choose from {', '.join(TASKS)}, or give a .txt/.jsonl file)")

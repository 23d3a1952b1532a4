"""Do mlx_flash's tokens (the tokenizer rebuilt from the GGUF's SentencePiece vocabulary) equal
llama.cpp's on the same file? WikiText-2 test text and a few hard strings, each compared whole.

    .venv/bin/python benchmarks/gemma-3-270m/tokens.py MODEL_FOLDER GGUF

llama.cpp tokenizes in .venv-peers (`make peers-setup`), with its BOS and without parsing
control tokens in the text (special=False), so the strings hold none.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([llm.tokenize(t.encode(), add_bos=True, special=False) for t in json.load(open(sys.argv[2]))]))
"""
HARD = ["Hello world, hello tokens!", "In 2024 there were 366 days.", "Ünïcödé ß 日本 🎉",
        "  two spaces\n\tand a tab", "def f(x):\n    return x  # comment\n\n\n", " leading space"]


def main(model, gguf):
    from mlx_flash.eval.tasks import default_data_dir
    from mlx_flash.tokenizer import load_tokenizer

    text = (Path(default_data_dir()) / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    texts = [text[i:i + 50_000] for i in range(0, min(len(text), 500_000), 50_000)] + HARD
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "texts.json"
        path.write_text(json.dumps(texts))
        ref = json.loads(subprocess.check_output([str(ROOT / ".venv-peers" / "bin" / "python"), "-c", CHILD,
                                                  gguf, str(path)], stderr=subprocess.DEVNULL))
    tok = load_tokenizer(Path(model))
    same = sum(tok.encode(t) == r for t, r in zip(texts, ref))
    n = sum(len(r) for r in ref)
    print(f"{same} of {len(texts)} texts tokenized as llama.cpp does ({n:,} llama.cpp tokens; "
          f"WikiText-2 test, its first {min(len(text), 500_000):,} characters in 50,000-character pieces, "
          f"and {len(HARD)} hard strings)")
    return 0 if same == len(texts) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

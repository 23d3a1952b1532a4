"""mlx_flash.eval: the data loaders, the scoring arithmetic against brute force, and the CLI."""

import json
import math
import time

import numpy as np
import pytest

import mlx.core as mx

import mlx_flash
from mlx_flash.cli.eval import main as eval_main
from mlx_flash.eval import tasks
from mlx_flash.eval.harness import (
    choice_metrics,
    encode,
    encode_pair,
    evaluate,
    evaluate_choices,
    evaluate_perplexity,
    prefix_token,
    token_nll,
    tokenize_stream,
)
from mlx_flash.eval.tasks import MCItem

DATA = tasks.default_data_dir()
needs_data = pytest.mark.skipif(not (DATA / "SOURCES.md").exists(), reason=f"no data sets at {DATA}")

TEXT = ("the quick brown fox jumps over the lazy dog. hello world, paris is the capital. " * 6
        + "zebra quartz vexing jumbo wave! ")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama("eval", "float32").flash


@pytest.fixture(scope="module")
def tiny_loaded(tiny):
    return mlx_flash.load(tiny)


def log_probs(model, tokens):
    """Full-sequence log-softmax, computed independently in numpy (float64)."""
    logits = np.array(model(mx.array([tokens]))[0].astype(mx.float32), dtype=np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def brute_force_ll(model, tok, context, continuation):
    """Sum of log P(continuation tokens) from the logits of the whole sequence, one choice at a time."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tok.encode(context, add_special_tokens=False))
    seq = tok.encode(context, add_special_tokens=False) + whole[n_ctx:]
    lp = log_probs(model, seq)
    return sum(lp[i - 1, seq[i]] for i in range(n_ctx, len(seq)))


ITEMS = [
    MCItem("a", "Question: what is the capital?\nAnswer:", ["paris", "the lazy dog", "fox"], 0),
    MCItem("b", "the quick brown", ["fox jumps", "dog", "world, hello there", "x"], 1),
    MCItem("c", "hello", ["world", "wörld café", "capital is paris", "q", "the"], 2),
    MCItem("d", "zebra quartz", ["vexing jumbo wave!", "a"], 1),
    MCItem("e", "over the lazy dog.", ["hello world", "paris is the capital", "the", "fox"], 3),
]


# --- loaders on the real files


@needs_data
def test_arc_loaders_parse_the_real_files():
    counts = {("arc_easy", "test"): 2376, ("arc_challenge", "test"): 1172,
              ("arc_easy", "dev"): 570, ("arc_challenge", "dev"): 299}
    for (task, split), n in counts.items():
        items = tasks.load_arc(task, split)
        assert len(items) == n, (task, split, len(items))
        assert all(0 <= it.gold < len(it.choices) and 3 <= len(it.choices) <= 5 for it in items)
        assert all(it.context.startswith("Question: ") and it.context.endswith("\nAnswer:") for it in items)
    first = tasks.load_arc("arc_easy", "dev")[0]
    assert first.context == "Question: Which technology was developed most recently?\nAnswer:"
    assert first.choices == ["cellular telephone", "television", "refrigerator", "airplane"]
    assert first.gold == 0 and first.continuations[0] == " cellular telephone"
    # numeric labels (1-4) map to the right index
    by_id = {it.id: it for it in tasks.load_arc("arc_easy", "dev")}
    assert by_id["NYSEDREGENTS_2014_8_8"].gold == 1
    assert by_id["NYSEDREGENTS_2014_8_8"].choices[1] == "pedigree chart"


@needs_data
def test_hellaswag_loader_parses_the_real_file():
    items = tasks.load_hellaswag()
    assert len(items) == 10042
    assert all(len(it.choices) == 4 and 0 <= it.gold <= 3 for it in items)
    first = items[0]
    assert first.context == "Roof shingle removal: A man is sitting on a roof. He"  # ctx_b capitalized
    assert first.choices[3] == "starts pulling up roofing on a roof." and first.gold == 3
    assert not any("[" in it.context and "]" in it.context.split("[", 1)[1] for it in items)
    assert not any("  " in it.context or it.context != it.context.strip() for it in items)
    raw = tasks.load_hellaswag(capitalize_ctx_b=False)
    changed = sum(a.context != b.context for a, b in zip(items, raw))
    assert 3000 < changed < 3300  # the ActivityNet items (their ctx_b); WikiHow ones end a sentence


def test_hellaswag_preprocess_matches_the_harness_rules():
    assert tasks.hellaswag_preprocess(" How to x [title] Do it. [step] Now  go ") == "How to x. Do it. Now go"
    assert tasks.hellaswag_preprocess("See [www.site.org] for more") == "See for more"
    assert tasks.restore_ctx_b_capital("Sumo: A video is shown. two men") == "Sumo: A video is shown. Two men"
    assert tasks.restore_ctx_b_capital("Health: How to rest. Sleep well.") == "Health: How to rest. Sleep well."
    assert tasks.restore_ctx_b_capital("Dance: the girl") == "Dance: The girl"


@needs_data
def test_perplexity_texts_load():
    text, _ = tasks.load_text("wikitext")
    assert text.startswith(" = Robert Boulter = \n") and "\r" not in text
    c4, _ = tasks.load_text("c4")
    assert c4.count("\n\n") >= 1999


# --- scoring against brute force on a tiny random model


def test_choice_logliks_and_acc_match_brute_force(tiny_loaded):
    model, tok = tiny_loaded
    res = evaluate_choices(model, tok, ITEMS)
    want_acc, want_norm = [], []
    for item, r in zip(ITEMS, res["items"]):
        want = [brute_force_ll(model, tok, item.context, c) for c in item.continuations]
        np.testing.assert_allclose(r["lls"], want, rtol=1e-4, atol=1e-4)
        want_acc.append(float(np.argmax(want) == item.gold))
        want_norm.append(float(np.argmax([w / len(c) for w, c in zip(want, item.choices)]) == item.gold))
    m = res["metrics"]
    assert m["acc"] == pytest.approx(np.mean(want_acc))
    assert m["acc_norm"] == pytest.approx(np.mean(want_norm))
    p = np.mean(want_acc)
    assert m["acc_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (len(ITEMS) - 1)))
    assert res["n"] == len(ITEMS)


def test_acc_norm_arithmetic():
    rs = [{"gold": 0, "lls": [-6.0, -4.0], "chars": [6, 2], "bytes": [7, 3]},   # norm: -1.0 vs -2.0
          {"gold": 1, "lls": [-3.0, -3.0], "chars": [3, 3], "bytes": [4, 4]},   # tie -> first choice
          {"gold": 1, "lls": [-9.0, -2.0], "chars": [1, 1], "bytes": [2, 2]},
          {"gold": 0, "lls": [-4.0, -2.1], "chars": [4, 2], "bytes": [6, 3]}]   # chars: -1, -1.05; bytes: -0.67, -0.7
    m = choice_metrics(rs)
    assert m["acc"] == 0.25 and m["acc_norm"] == 0.75 and m["acc_norm_bytes"] == 0.75
    rs[3]["bytes"] = [3, 3]  # -1.33 vs -0.7 -> 1: wrong by bytes, right by chars
    m = choice_metrics(rs)
    assert m["acc_norm"] == 0.75 and m["acc_norm_bytes"] == 0.5


def test_encode_pair_moves_trailing_spaces_and_splits_the_whole_encoding(tiny_loaded):
    _, tok = tiny_loaded
    ctx, cont = encode_pair(tok, "hello ", "world")
    assert ctx == encode(tok, "hello")
    assert encode(tok, "hello world")[len(ctx):] == cont


def test_a_limited_stream_is_the_head_of_the_whole_encoding(tiny_loaded):
    _, tok = tiny_loaded
    text = TEXT * 40
    whole = encode(tok, text)
    for n in (1, 37, 500, len(whole), len(whole) + 10):
        assert tokenize_stream(tok, text, n) == whole[:n]


def test_dense_perplexity_is_exp_mean_nll(tiny_loaded):
    model, tok = tiny_loaded
    context = 16
    res = evaluate_perplexity(model, tok, TEXT, context=context, limit=50)
    seq = [prefix_token(tok)] + encode(tok, TEXT)
    nll = []
    for s in range(0, 50, context):
        e = min(s + context, 50)
        lp = log_probs(model, seq[s:e])
        nll += [-lp[i, seq[s + i + 1]] for i in range(e - s)]
    assert len(nll) == 50 == res["n"]
    assert res["metrics"]["perplexity"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    assert res["windows"] == 4


def test_token_by_token_equals_windowed_for_dense(tiny_loaded):
    model, tok = tiny_loaded
    seq = [prefix_token(tok)] + encode(tok, TEXT)
    n = min(len(seq) - 1, 70)
    a = token_nll(model, seq, n, 24, incremental=False)
    b = token_nll(model, seq, n, 24, incremental=True)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert math.exp(b.mean()) == pytest.approx(math.exp(a.mean()), rel=1e-4)
    one = evaluate_choices(model, tok, ITEMS, incremental=False)
    inc = evaluate_choices(model, tok, ITEMS, incremental=True)
    for r1, r2 in zip(one["items"], inc["items"]):
        np.testing.assert_allclose(r2["lls"], r1["lls"], rtol=1e-4, atol=1e-4)


def test_flash_mode_scores_token_by_token_through_the_store(tiny, tiny_loaded):
    """naive mode reads every FFN row from flash every token: exact, so it must match dense."""
    model, tok = tiny_loaded
    dense = evaluate(model, tok, "x", loaded=("perplexity", TEXT, "text"), limit=40, context=20)
    naive, ntok = mlx_flash.load(tiny, mode="naive")
    res = evaluate(naive, ntok, "x", loaded=("perplexity", TEXT, "text"), limit=40, context=20)
    assert res["incremental"] and not dense["incremental"]
    assert res["metrics"]["perplexity"] == pytest.approx(dense["metrics"]["perplexity"], rel=1e-4)
    assert naive.runtime.stats()["summary"]["n_tokens"] == 40  # one store call per token, each of 1 token


def test_flash_mode_choices_token_by_token_and_batch_prefill(tiny, tiny_loaded):
    """flash + oracle at density 1 keeps every neuron: both ways through the store equal dense."""
    model, tok = tiny_loaded
    dense = evaluate_choices(model, tok, ITEMS)
    flash, ftok = mlx_flash.load(tiny, mode="flash", sparsity="oracle", density=1.0)
    for incremental in (True, False):
        res = evaluate_choices(flash, ftok, ITEMS, incremental=incremental)
        for r1, r2 in zip(dense["items"], res["items"]):
            np.testing.assert_allclose(r2["lls"], r1["lls"], rtol=1e-4, atol=1e-4)


# --- the CLI


def test_cli_errors_are_one_line_exit_2(tiny, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases = [
        (["--task", "wikitxt"], "unknown task 'wikitxt'"),
        (["--task", str(tmp_path / "nope.txt")], "missing file"),
        (["--task", str(empty)], "the text is empty"),
        (["--task", "hellaswag", "--limit", "0"], "--limit must be positive"),
        (["--task", "hellaswag", "--split", "dev"], "--split applies to arc_easy"),
    ]
    for argv, msg in cases:
        assert eval_main(["--model", str(tiny)] + argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mlx_flash.eval: error: ") and msg in err[0], err


def test_cli_perplexity_of_a_jsonl_file_with_json(tiny, tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": TEXT[i::3]}) for i in range(3)))
    out = tmp_path / "r.json"
    rc = eval_main(["--model", str(tiny), "--task", str(src), "--limit", "60", "--context", "32",
                    "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "perplexity" in text and "first 60 tokens (--limit)" in text
    r = json.loads(out.read_text())
    assert r["n"] == 60 and r["windows"] == 2 and r["metrics"]["perplexity"] > 1
    assert r["config"]["mode"] == "dense" and "weights_in_dram_bytes" in r["stats"]


def test_cli_choices_with_json(tiny, tmp_path, capsys, monkeypatch):
    data = tmp_path / "data" / "zero-shot" / "arc"
    data.mkdir(parents=True)
    rows = [{"id": f"q{i}", "question": {"stem": f"what {w}?", "choices": [
        {"text": "paris", "label": "1"}, {"text": "the dog", "label": "2"}, {"text": w, "label": "3"}]},
        "answerKey": "3"} for i, w in enumerate(["fox", "world", "capital"])]
    (data / "ARC-Easy-Dev.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "r.json"
    rc = eval_main(["--model", str(tiny), "--task", "arc_easy", "--split", "dev", "--data-dir",
                    str(tmp_path / "data"), "--json", str(out), "--no-progress"])
    assert rc == 0
    assert "acc_norm" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["n"] == 3 and len(r["items"]) == 3 and all(it["gold"] == 2 for it in r["items"])
    assert 0 <= r["metrics"]["acc"] <= 1 and "acc_norm_stderr" in r["metrics"]


# --- the real model


@pytest.mark.slow  # (4 min: real data through the whole evaluation; -m slow runs it)
def test_smollm2_wikitext_and_arc_easy(smollm2):
    if not (DATA / "SOURCES.md").exists():
        pytest.skip(f"no data sets at {DATA}")
    t0 = time.perf_counter()
    model, tok = mlx_flash.load(smollm2, verify=False)
    ppl = evaluate(model, tok, "wikitext", limit=256)
    arc = evaluate(model, tok, "arc_easy", split="dev", limit=40)
    p, acc = ppl["metrics"]["perplexity"], arc["metrics"]["acc"]
    print(f"SmolLM2: WikiText-2 ppl {p:.2f} (256 tokens); ARC-Easy dev[:40] acc {acc:.3f} "
          f"acc_norm {arc['metrics']['acc_norm']:.3f}; {time.perf_counter() - t0:.1f} s")
    assert math.isfinite(p) and p < 100
    assert acc > 0.25

"""Speculative decoding with a draft in DRAM: greedy tokens identical to no drafting, the
acceptance counted right (a perfect draft is accepted every time), the flags' errors."""

import os
import subprocess
import sys

import pytest

import mlx_flash
from mlx_flash.draft import Acceptance, load_draft, parse_layers
from mlx_flash.errors import FlashError

BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def six_layers(tiny_llama):
    return tiny_llama("draft", "float32", num_hidden_layers=6).flash


def test_parse_layers():
    assert parse_layers("5", 30) == [0, 26, 27, 28, 29]
    assert parse_layers("24", 30) == list(range(20)) + [26, 27, 28, 29]
    assert parse_layers("0-2, 5", 6) == [0, 1, 2, 5]
    for bad, msg in (("30", "1 to 29"), ("0-29", "keeps every layer"), ("3-1", "not within"),
                     ("0-40", "not within"), ("a", "layer count")):
        with pytest.raises(FlashError, match=msg):
            parse_layers(bad, 30)


def test_acceptance_counts_passes():
    a = Acceptance(num_draft=3, max_tokens=9)
    for flag in (True, True, False, False, True, False, True, True, False):  # passes of 3, 1, 2, 3 tokens
        a.add(flag)
    assert (a.tokens, a.accepted, a.passes) == (9, 5, 4)
    assert a.proposed == 3 + 3 + 3 + 3  # every pass began with at least 3 tokens left
    assert "5 of 12 drafted tokens accepted" in a.line()


def greedy(model, tok, n, **kw):

    ids = tok.encode("the quick brown fox")
    acc = Acceptance(kw.get("num_draft_tokens", 1), n)
    out = []
    for r in mlx_flash.stream_generate(model, tok, ids, max_tokens=n, **kw):
        out.append(r.token)
        acc.add(r.from_draft)
    return out, acc


OPTIONS = {"dense": {"mode": "dense"}, "hybrid": {"mode": "hybrid", "memory_budget": "70%"},
           "flash": {"mode": "flash", "sparsity": "oracle", "density": 0.5, "window": 3, "memory_budget": "90%"}}


@pytest.mark.parametrize("mode", list(OPTIONS))
def test_drafting_keeps_the_greedy_tokens(six_layers, mode):
    from mlx_flash.draft import speculative_cache

    opts = OPTIONS[mode]
    model, tok = mlx_flash.load(str(six_layers), **opts)
    base, _ = greedy(model, tok, 20)
    self_draft = load_draft("self:3", str(six_layers))
    self_draft.check(tok)
    out, acc = greedy(model, tok, 20, draft_model=self_draft.model, num_draft_tokens=3,
                      prompt_cache=speculative_cache(model, self_draft))
    assert out == base and acc.tokens == 20
    # a draft that is the model itself (another copy) is accepted every time: 4 tokens a pass
    twin = load_draft(str(six_layers), str(six_layers))
    out, acc = greedy(model, tok, 20, draft_model=twin.model, num_draft_tokens=3,
                      prompt_cache=speculative_cache(model, twin))
    assert out == base
    if mode != "flash":  # (sparse, the model is not its dense twin)
        assert acc.accepted == acc.proposed and acc.passes == 5
    if mode != "dense":  # the verifying passes read from flash
        assert sum(r["bytes_read"] for r in model.runtime.store.stats.rows) > 0


def test_a_rejection_leaves_the_window_the_accepted_positions_neurons(six_layers):
    import mlx.core as mx
    import numpy as np

    opts = dict(OPTIONS["flash"], memory_budget="5MB")  # every neuron fits: a pass of 3 positions in one piece
    model, tok = mlx_flash.load(str(six_layers), **opts)
    store = model.runtime.store
    model(mx.array([tok.encode("the quick brown fox")[:3]]))  # a pass of 3 positions, say a verify pass
    masks = [m[-1][1] for m in store.masks]
    assert all(m is not None and m.shape[0] == 3 for m in masks)
    counts = [c.copy() for c in store.counts]
    model.runtime.rewind(2)  # its last two positions were rejected
    for layer, m in enumerate(masks):
        kept = np.flatnonzero(m[:1].any(axis=0))
        assert np.array_equal(np.sort(store.history[layer][-1]), kept)
        lost = np.setdiff1d(np.flatnonzero(m.any(axis=0)), kept)
        assert np.all(store.counts[layer][lost] == counts[layer][lost] - 1)
        assert np.all(store.counts[layer][kept] == counts[layer][kept])
    model.runtime.rewind(1)  # and the first: the pass leaves the window
    assert all(len(h) == 0 for h in store.history) and all(not c.any() for c in store.counts)
    # a pass that ran in halves (a small budget): its entries are rewound position by position
    model, tok = mlx_flash.load(str(six_layers), **OPTIONS["flash"])
    store = model.runtime.store
    model(mx.array([tok.encode("the quick brown fox")[:3]]))
    before = [len(h) for h in store.history]
    model.runtime.rewind(2)
    after = [len(h) for h in store.history]
    assert all(a < b for a, b in zip(after, before)) and all(c.min() >= 0 for c in store.counts)


def test_draft_with_a_memory_limit_counts_its_cache(six_layers):
    d = load_draft("self:2", str(six_layers))
    d.allocate(300)
    cache = d.cache()
    assert cache[0].offset == 0 and cache[0].keys.shape[2] >= 300  # allocated once, for the whole context


def test_generate_cli_draft(six_layers, tmp_path):
    run = lambda *a: subprocess.run([f"{BIN}/mlx_flash.generate", "--model", str(six_layers), "--prompt", "hello",
                                     "--max-tokens", "8", *a], capture_output=True, text=True, timeout=300)
    plain = run()
    r = run("--draft-model", "self:3", "--num-draft-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "Speculative:" in r.stdout and "draft self-draft, 3 of the model's 6 layers" in r.stderr
    assert r.stdout.split("==========")[0] == plain.stdout.split("==========")[0]  # the same text
    r = run("--draft-model", "self:9")
    assert r.returncode == 2 and "1 to 5 of the model's 6 layers" in r.stderr
    (tmp_path / "b.jsonl").write_text('"hi"\n')
    r = run("--draft-model", "self:3", "--batch-file", str(tmp_path / "b.jsonl"), "--prompt", "x")
    assert r.returncode == 2


def test_a_conversation_with_a_draft_answers_as_without(six_layers):
    """The chat's and the server's kept KV cache holds the draft's caches beside the model's."""
    from mlx_flash.conversation import Conversation

    model, tok = mlx_flash.load(str(six_layers), **OPTIONS["hybrid"])
    draft = load_draft("self:3", str(six_layers))
    plain = Conversation(model, tok, max_tokens=6, sampling={"temp": 0.0})
    drafted = Conversation(model, tok, max_tokens=6, sampling={"temp": 0.0}, draft=draft, num_draft_tokens=2)
    for text in ("the quick", "brown fox", "paris is"):
        a, b = plain.ask(text), drafted.ask(text)
        assert a.text == b.text
    assert b.cached_tokens > 0  # the second and third turns reused both caches
    assert drafted.kept.cache[0].offset == drafted.held or drafted.kept.cache[6].offset == drafted.held

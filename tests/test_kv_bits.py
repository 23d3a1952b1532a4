"""--kv-bits (issue 13 item 5): a KV cache quantized group-wise from the first token (mlx_lm's
QuantizedKVCache), planned at its size under --memory-limit, and scored by eval through it."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

import mlx_flash
from mlx_flash.errors import FlashError
from mlx_flash.runtime import memory
from test_parity import TOKENS, greedy

MB = 10**6


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_cache_from_the_first_token(smollm2, bits):
    model, tok = mlx_flash.load(smollm2, kv_bits=bits, progress=False)
    cache = make_prompt_cache(model)
    assert all(isinstance(c, QuantizedKVCache) and c.bits == bits and c.group_size == 64 for c in cache)
    got = model(mx.array([TOKENS]), cache=cache)[0, -1]
    dense, _ = mlx_flash.load(smollm2, progress=False)
    want = dense(mx.array([TOKENS]), cache=make_prompt_cache(dense))[0, -1]
    # an approximation of the keys and values: the same next token, and a next-token distribution
    # close to the float cache's (KL, blind to an offset common to every logit: 4-bit keys moved
    # the logits by 1.07 on average, 3.3 at most, for a KL of 0.069 on a Zen 5 whose OpenBLAS runs
    # its Haswell kernels; the max difference had passed a bound of 3.0 on Zen 4; 8-bit: 1.7e-4)
    assert mx.argmax(got).item() == mx.argmax(want).item()
    lp, lq = want - mx.logsumexp(want), got - mx.logsumexp(got)
    assert (mx.exp(lp) * (lp - lq)).sum().item() < (0.005 if bits == 8 else 0.2)
    assert len(greedy(model, TOKENS, 6)) == 6
    model.runtime.close()
    dense.runtime.close()


def test_memory_limit_plans_the_quantized_cache(smollm2):
    limit = memory.process_rss() + 250 * MB
    model, _ = mlx_flash.load(smollm2, mode="hybrid", memory_limit=str(limit), ctx_size=64, kv_bits=4,
                              progress=False)
    m = model.runtime.memory
    per_value = 4 / 8 + 2 * 4 / 64  # packed 4-bit + a float32 scale and bias per 64 values
    assert m.kv == int(64 * m.shape.kv_per_token * per_value)
    cache = make_prompt_cache(model)
    model(mx.array([[1] * 10]), cache=cache)
    model(mx.array([[1] * 40]), cache=cache)  # allocated once, at the planned context
    held = sum(a.nbytes for c in cache for part in (c.keys, c.values) for a in part)
    assert held == m.kv and all(c.offset == 50 for c in cache)
    float_plan = memory.plan_memory(str(limit), m.shape, 4, 64, baseline=m.baseline)
    assert float_plan.kv == pytest.approx(m.kv * 4 / per_value, rel=1e-3) and m.weights > float_plan.weights
    model.runtime.close()


def test_kv_options_refused_where_they_do_nothing(smollm2):
    with pytest.raises(FlashError, match="give --kv-bits too"):
        mlx_flash.load(smollm2, kv_group_size=32, progress=False)
    with pytest.raises(FlashError, match="does not divide the model's head dimension"):
        mlx_flash.load(smollm2, kv_bits=4, kv_group_size=128, progress=False)


def test_eval_scores_through_the_quantized_cache(smollm2, tmp_path, capsys):
    from mlx_flash.cli.eval import main as eval_main

    out = tmp_path / "r.json"
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert eval_main(["--model", str(smollm2), "--task", str(text), "--limit", "48", "--context", "24",
                      "--kv-bits", "4", "--no-progress", "--json", str(out)]) == 0
    assert "evaluating token by token, through the quantized KV cache" in capsys.readouterr().err
    r = json.loads(out.read_text())
    assert r["config"]["kv_bits"] == 4 and r["incremental"] and r["metrics"]["perplexity"] > 1

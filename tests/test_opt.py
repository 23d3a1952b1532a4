"""OPT: converted and loaded with every FFN row in DRAM, the logits match transformers' OPTForCausalLM."""

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from mlx_flash.models import opt
from helpers import make_opt_folder, write_safetensors
from reference import reference_logits

TOKENS = [1, 5, 9, 33, 70, 12, 4, 100, 7, 250, 3]
TOL = 1e-4


def flash_logits(model, tokens):
    return np.array(model(mx.array([tokens]))[0])


def incremental_logits(model, tokens, prefill=5):
    """Prefill, then one token at a time through an mlx_lm KV cache."""
    cache = make_prompt_cache(model)
    out = [np.array(model(mx.array([tokens[:prefill]]), cache=cache)[0])]
    for t in tokens[prefill:]:
        out.append(np.array(model(mx.array([[t]]), cache=cache)[0]))
    return np.concatenate(out)


@pytest.mark.parametrize(
    "variant, lm_head",
    [("opt", False), ("opt-350m", False), ("opt", True)],
    ids=["pre-ln", "post-ln-proj", "pre-ln-lm_head-stored"],
)
def test_opt_matches_transformers(tmp_path, variant, lm_head):
    src, cfg, _ = make_opt_folder(tmp_path / "hf", variant, seed=1, lm_head=lm_head)
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    model, _ = mlx_flash.load(out)
    assert model.runtime.compute_dtype == "float32"

    tokens = TOKENS[:9]
    ref = reference_logits(src, tokens)
    got = flash_logits(model, tokens)
    assert got.shape == ref.shape == (len(tokens), cfg["vocab_size"])
    assert np.abs(got - ref).max() < TOL
    assert (got.argmax(-1) == ref.argmax(-1)).all()

    # prefill 5, then 3 single tokens: positions continue from cache.offset
    inc = incremental_logits(model, tokens[:8])
    assert np.abs(inc - ref[:8]).max() < TOL
    assert (inc.argmax(-1) == ref[:8].argmax(-1)).all()


def test_opt_structure():
    base = dict(
        model_type="opt", hidden_size=64, num_hidden_layers=2, ffn_dim=256,
        num_attention_heads=4, vocab_size=100,
    )
    pre = opt.ModelArgs.from_dict(base)
    post = opt.ModelArgs.from_dict(dict(base, do_layer_norm_before=False, word_embed_proj_dim=32))
    old = opt.ModelArgs.from_dict(dict(base, _remove_final_layer_norm=True))
    assert pre.has_final_layer_norm and not pre.has_projections
    assert not post.has_final_layer_norm and post.has_projections
    assert not old.has_final_layer_norm
    assert opt.ffn_kinds(pre) == ("up", "down")
    assert opt.ffn_tensors(pre, 3) == {
        "up": ("model.decoder.layers.3.fc1.weight", False),
        "down": ("model.decoder.layers.3.fc2.weight", True),
    }
    for prefix in ("model.decoder.", "decoder."):
        assert opt.resident_name(pre, prefix + "layers.1.fc1.bias") == "model.decoder.layers.1.mlp.up_bias"
        assert opt.resident_name(pre, prefix + "layers.1.fc2.bias") == "model.decoder.layers.1.mlp.down_bias"
        assert opt.resident_name(pre, prefix + "embed_positions.weight") == "model.decoder.embed_positions.weight"
    assert opt.resident_name(pre, "lm_head.weight") is None
    names = {k for k, _ in tree_flatten(opt.Model(post).parameters())}
    assert "model.decoder.project_in.weight" in names and "model.decoder.final_layer_norm.weight" not in names
    assert "model.decoder.layers.0.mlp.up_bias" in names


def test_opt_positions_beyond_table(tmp_path):
    src, cfg, _ = make_opt_folder(tmp_path / "hf", "opt", max_position_embeddings=8)
    model, _ = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False))
    model(mx.array([TOKENS[:8]]))
    with pytest.raises(FlashError, match="at most 8 positions"):
        model(mx.array([TOKENS[:9]]))


def test_opt_checkpoint_without_model_prefix(tmp_path):
    src, cfg, tensors = make_opt_folder(tmp_path / "hf", "opt", seed=2)
    write_safetensors(
        src / "model.safetensors", {k[len("model."):]: v for k, v in tensors.items()}
    )
    tokens = TOKENS[:6]
    ref = reference_logits(src, tokens)  # transformers accepts both namings
    model, _ = mlx_flash.load(convert(src, tmp_path / "flash", dtype="float32", progress=False))
    assert np.abs(flash_logits(model, tokens) - ref).max() < TOL

"""Quantized flash: values kept bit-exact from quantized sources, and parity with mlx_lm on the
same quantized weights (float32 compute), in every exact mode."""

import json

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import convert as mlx_lm_convert
from mlx_lm.utils import load_model

import mlx_flash
from mlx_flash.convert import convert
from mlx_flash.convert.quantize import QuantOptions
from mlx_flash.errors import FlashError
from mlx_flash.layout import quant
from mlx_flash.layout.format import read_manifest
from helpers import make_llama_folder, make_opt_folder
from test_parity import TOKENS, greedy

EXACT_MODES = [dict(mode="dense"), dict(mode="naive"), dict(mode="hybrid"),
               dict(mode="flash", sparsity="oracle", density=1.0)]


def assert_logits_in_modes(folder, x, want, modes, what=""):
    """`folder` loaded in each of `modes` (load()'s options) gives `want` for x within 1e-4."""
    for options in modes:
        model, _ = mlx_flash.load(folder, **options)
        diff = mx.abs(model(x) - want).max().item()
        assert diff < 1e-4, f"{what} {options}: max |logit diff| {diff}"
        model.runtime.close()


@pytest.mark.parametrize("bits", quant.BITS)
def test_packing_is_mlx_bit_stream(bits):
    w = mx.random.normal((8, 256), key=mx.random.key(bits))
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    packed = np.array(wq)
    q = quant.unpack(packed, bits, 256)
    want = np.array(mx.dequantize(wq, s, b, group_size=32, bits=bits))
    got = quant.dequantize(packed, np.array(s), np.array(b), bits, 32, 256)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert np.array_equal(quant.to_words(quant.pack(q, bits)), packed)
    cols = quant.unpack(quant.columns(packed, bits, 256), bits, 8)  # [in, out]: values transposed
    assert np.array_equal(cols, q.T)


def test_gguf_q4_1_and_q8_0_blocks_are_kept_bit_exact(smollm2_gguf):
    """Our repacking of llama.cpp's blocks equals MLX's own GGUF reader, word for word."""
    from mlx_flash.convert.gguf import GGUFSource

    src = GGUFSource(smollm2_gguf)
    ref = mx.load(str(smollm2_gguf))
    checked = 0
    for name in src.names():
        if src.quant(name) is None:
            continue
        t = src._tensors[name]
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            continue  # rows un-permuted (llama.cpp's rotary order); checked through the logits below
        w = src.read_quantized(name)
        stem = t.name[: -len("weight")]
        for got, key in ((w.packed, t.name), (w.scales, stem + "scales"), (w.biases, stem + "biases")):
            want = np.array(ref[key])
            assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8)), key
        checked += 1
    assert checked > 100
    src.close()


def _reference_from_gguf(path, config):
    """An mlx_lm model holding the GGUF's own quantized values, read by MLX's GGUF reader."""
    from mlx_lm.models.llama import Model, ModelArgs

    from mlx_flash.convert.gguf import hf_name, unpermute

    model = Model(ModelArgs.from_dict(config))
    raw = mx.load(str(path))
    weights = {}
    for key, value in raw.items():
        stem, part = key.rsplit(".", 1)
        name = hf_name(stem + ".weight")[: -len(".weight")] + "." + part
        if ".q_proj." in name or ".k_proj." in name:
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            value = mx.array(unpermute(np.array(value), heads))
        weights[name] = value
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda p, m: (f"{p}.scales" in weights
                                              and {"group_size": 32, "bits": 8 if "embed" in p else 4}))
    model.load_weights(list(weights.items()), strict=False)
    model.set_dtype(mx.float32)
    return model


@pytest.mark.slow  # (over 10 s here: `make test-slow` runs it)
def test_smollm2_q4_1_gguf_matches_mlx_lm_on_its_own_values(tmp_path, smollm2_gguf):
    """The reference: mlx_lm's llama holding the values MLX's own GGUF reader gives. Where both
    compute with the same kernels, 1e-4: our FFN (BLAS on the dequantized rows) against the
    reference with its MLP dequantized, its attention held quantized like ours under MLX's
    quantized kernel, or dequantized (our --resident-dtype float32, and what our held
    quantized weights compute for a prompt: dequantized chunks + BLAS). Against MLX's
    quantized kernel everywhere, the logits (magnitude ~30) move by float32 summation order
    alone (~4e-4 here), and so do the modes that sum the FFN in parts (hybrid: resident +
    streamed rows) or on rows held at their bits (the native kernels' order): they must stay
    within that; greedy tokens agree."""
    from mlx_flash.models.quantized import dequantize_modules

    out = convert(smollm2_gguf, tmp_path / "q4", progress=False)
    m = read_manifest(out)
    assert (m.layout.quant.bits, m.layout.quant.group_size) == (4, 32)
    config = json.loads((out / "config.json").read_text())
    ref = _reference_from_gguf(smollm2_gguf, config)
    x = mx.array([TOKENS])
    want_q = ref(x)
    tokens_q = greedy(ref, TOKENS, 8)
    for layer in ref.model.layers:
        dequantize_modules(layer.mlp, mx.float32)
    want_held = ref(x)
    dequantize_modules(ref, mx.float32)
    want = ref(x)
    noise = max(mx.abs(w - want_q).max().item() for w in (want, want_held))
    model, _ = mlx_flash.load(out, resident_dtype="quantized")
    assert mx.abs(model(x) - want).max().item() < 1e-4
    for options in EXACT_MODES + [dict(mode="naive", ffn_rows="float32")]:
        model, _ = mlx_flash.load(out, **options)
        got = model(x)
        # rows held at their bits (the CPU's default outside dense) sum in the kernels' order
        exact = options["mode"] == "dense" or options.get("ffn_rows") == "float32"
        tol = 1e-4 if exact else noise + 1e-4
        assert mx.abs(got - want).max().item() < tol, options
        assert mx.abs(got - want_q).max().item() <= 2 * noise + 1e-4, options
        if options["mode"] == "dense":
            assert greedy(model, TOKENS, 8) == tokens_q
        model.runtime.close()


def _mlx_lm_quantized(tmp_path, variant, bits, group=64, **cfg):
    src, _, _ = make_llama_folder(tmp_path / "hf", variant, intermediate_size=128, **cfg)
    q = tmp_path / f"mlx-q{bits}"
    mlx_lm_convert(str(src), str(q), quantize=True, q_bits=bits, q_group_size=group, dtype="float16")
    return src, q


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3", "phi3", "granite"])
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_folder_matches_mlx_lm(tmp_path, variant, bits):
    _, q = _mlx_lm_quantized(tmp_path, variant, bits)
    out = convert(q, tmp_path / "flash", progress=False, dip=True)
    # (mlx_lm's Granite keeps down_proj at 8 bits: the FFN's one width is then 8, gate and up widened)
    assert read_manifest(out).layout.quant.bits == (8 if variant == "granite" else bits)
    ref, _ = load_model(q)
    ref.set_dtype(mx.float32)
    x = mx.array([TOKENS])
    want = ref(x)
    for options in EXACT_MODES + [dict(mode="flash", sparsity="dip", density=1.0)]:
        model, _ = mlx_flash.load(out, **options)
        diff = mx.abs(model(x) - want).max().item()
        assert diff < 1e-4, f"{variant} {bits}-bit {options}: max |logit diff| {diff}"
        if options["mode"] == "dense":
            assert greedy(model, TOKENS) == greedy(ref, TOKENS)
        model.runtime.close()


def test_convert_quantize_gives_mlx_lm_convert_values(tmp_path):
    """`convert --quantize` of a float model = `mlx_lm.convert -q` of it (same dtype, bits, group)."""
    src, q = _mlx_lm_quantized(tmp_path, "llama", 4)
    ours = convert(src, tmp_path / "flash", progress=False, quant=QuantOptions(quantize=True, bits=4,
                                                                                  group_size=64))
    from_mlx = convert(q, tmp_path / "flash-from-mlx", progress=False)
    a = mx.load(str(ours / "resident.safetensors"))
    b = mx.load(str(from_mlx / "resident.safetensors"))
    assert a.keys() == b.keys() and any(k.endswith(".scales") for k in a)
    for k in a:
        assert mx.array_equal(a[k], b[k]), k
    for fa, fb in zip(read_manifest(ours).ffn_files, read_manifest(from_mlx).ffn_files):
        assert fa["sha256"] == fb["sha256"]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_opt_matches_its_dequantized_weights(tmp_path, bits):
    """OPT has no mlx_lm model: the reference is the float model of the same quantized values."""
    src, cfg, tensors = make_opt_folder(tmp_path / "hf", "opt")
    out = convert(src, tmp_path / "q", dtype="float32", progress=False,
                  quant=QuantOptions(quantize=True, bits=bits, group_size=32))
    assert read_manifest(out).layout.quant.bits == bits
    rounded = {}
    for k, v in tensors.items():
        if k.endswith(".weight") and v.ndim == 2 and v.shape[1] % 32 == 0:
            w = quant.quantize(v, bits, 32, "float32")
            v = w.dequantized()
        rounded[k] = v
    ref_src, _, _ = make_opt_folder(tmp_path / "hf-rounded", "opt")
    from helpers import write_safetensors

    write_safetensors(ref_src / "model.safetensors", rounded)
    ref = convert(ref_src, tmp_path / "ref", dtype="float32", progress=False)
    ref_model, _ = mlx_flash.load(ref)
    x = mx.array([TOKENS])
    assert_logits_in_modes(out, x, ref_model(x), EXACT_MODES)


def test_quantized_folder_is_smaller(tmp_path):
    # wide rows, as in real models (a tiny model's bundles are mostly the 512-byte alignment)
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=256, hidden_size=1536,
                                  num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2)
    f16 = convert(src, tmp_path / "f16", progress=False)
    q4 = convert(src, tmp_path / "q4", progress=False, quant=QuantOptions(quantize=True))
    size = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and "tokenizer" not in f.name)
            for p in (f16, q4)}
    assert size[q4] <= 0.32 * size[f16], size
    ffn = {p: sum(e["size"] for e in read_manifest(p).ffn_files) for p in (f16, q4)}
    assert ffn[q4] <= 0.3 * ffn[f16], ffn


def test_bad_quantization_options_and_inputs(tmp_path):
    with pytest.raises(FlashError, match="7-bit"):
        QuantOptions(quantize=True, bits=7)
    with pytest.raises(FlashError, match="group size 48"):
        QuantOptions(quantize=True, group_size=48)
    with pytest.raises(FlashError, match="--dequantize cannot"):
        QuantOptions(dequantize=True, bits=4)
    # an mlx-lm folder whose scales do not match its weights: a clear error, nothing written
    _, q = _mlx_lm_quantized(tmp_path, "llama", 4)
    from mlx_flash.layout.safetensors_io import SafetensorsFile

    files = list(q.glob("*.safetensors"))
    tensors = {}
    for f in files:
        st = SafetensorsFile(f)
        tensors.update({n: st.read_raw(n)[0] for n in st.names()})
        f.unlink()
    name = "model.layers.0.mlp.up_proj.scales"
    tensors[name] = tensors[name][:-1].copy()  # a row short
    mx.save_safetensors(str(q / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    with pytest.raises(FlashError, match="up_proj"):
        convert(q, tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad*"))


def test_version_1_float_folders_still_load(tmp_path):
    """A folder written before quantized layouts (version 1: no quant fields) loads as before."""
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama")
    out = convert(src, tmp_path / "f32", dtype="float32", progress=False)
    model, _ = mlx_flash.load(out)
    want = model(mx.array([TOKENS]))
    m = json.loads((out / "manifest.json").read_text())
    for key in ("scales", "options"):
        m.pop(key)
    for key in ("quant", "columns", "tables"):
        m["layout"].pop(key)
    m["version"] = 1
    (out / "manifest.json").write_text(json.dumps(m))
    old, _ = mlx_flash.load(out, mode="naive")
    assert mx.array_equal(old(mx.array([TOKENS])), want)


def test_gguf_with_mixed_block_types_is_widened_exactly(tmp_path):
    """Q4_1 gate, Q8_0 up, Q4_0 down (test_gguf's file): held at 8 bits, every value as stored."""
    from test_gguf import write_gguf

    from mlx_flash.convert.gguf import GGUFSource
    from mlx_flash.layout.format import read_tables
    from mlx_flash.runtime.stores.base import read_layer_file

    path = tmp_path / "mixed.gguf"
    write_gguf(path)
    out = convert(path, tmp_path / "flash", progress=False)
    m = read_manifest(out)
    assert m.layout.quant.bits == 8
    src = GGUFSource(path)
    tables = read_tables(out, m, m.layout)
    for layer, entry in enumerate(m.ffn_files):
        rows = read_layer_file(out, entry, m.layout, tables=tables[layer])
        for kind, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            want = src.read(f"model.layers.{layer}.mlp.{name}.weight")
            assert np.array_equal(rows[kind], want.T if kind == "down" else want), (layer, kind)
    model, _ = mlx_flash.load(out, mode="naive", ffn_rows="float32")  # the values, dequantized on read
    dense, _ = mlx_flash.load(out)
    packed, _ = mlx_flash.load(out, mode="naive")  # at their bits: the kernels' summation order
    assert mx.abs(packed(mx.array([[1, 2, 3, 4]])) - dense(mx.array([[1, 2, 3, 4]]))).max().item() < 1e-4
    x = mx.array([[1, 2, 3, 4]])  # (4 positions: the resident weights' kernels take them one by one)
    assert mx.abs(model(x) - dense(x)).max().item() < 1e-4


def test_gguf_types_with_no_exact_form_are_requantized_and_say_so(tmp_path, monkeypatch, capfd):
    """Q6_K (super-blocks of 256 values: a 256-wide model) has no affine group-32 form."""
    import test_gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants as gguf_quants

    for name, value in (("HIDDEN", 256), ("FFN", 256), ("HEAD_DIM", 64)):
        monkeypatch.setattr(test_gguf, name, value)
    d, f, hd = 256, 256, 64
    shapes = {"attn_q": (4 * hd, d), "attn_k": (2 * hd, d), "attn_v": (2 * hd, d), "attn_output": (d, 4 * hd),
              "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
    layers = [(b, h, shapes.get(b, (d,)), T.Q6_K if b.startswith("ffn_") and b != "ffn_norm" else t)
              for b, h, _, t in test_gguf.LAYER_TENSORS]
    monkeypatch.setattr(test_gguf, "LAYER_TENSORS", layers)
    real = gguf_quants.quantize

    def quantize(x, qtype):  # (gguf-py cannot write Q6_K: random blocks, their scale d finite)
        if qtype != T.Q6_K:
            return real(x, qtype)
        raw = np.random.default_rng(0).integers(0, 256, (x.shape[0], x.shape[1] // 256, 210), dtype=np.uint8)
        raw[..., 208:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        return raw.reshape(x.shape[0], -1)

    monkeypatch.setattr(gguf_quants, "quantize", quantize)
    path = tmp_path / "q6.gguf"
    test_gguf.write_gguf(path)
    out = convert(path, tmp_path / "flash", progress=False)
    err = capfd.readouterr().err
    assert "GGUF Q6_K tensors have no exact MLX form: dequantized and re-quantized to 8-bit" in err, err
    q = read_manifest(out).layout.quant
    assert (q.bits, q.group_size) == (8, 32)  # at least the source's width, one with fast kernels


def test_gguf_q5_blocks_are_kept_exactly_at_8_bits(tmp_path, monkeypatch, capfd):
    """Q5_0 gate, Q5_1 up (Gemma 3's GGUFs store their FFN so): the file's values, held at 8 bits."""
    import test_gguf
    from gguf import GGMLQuantizationType as T

    from mlx_flash.convert.gguf import GGUFSource

    kinds = {"ffn_gate": T.Q5_0, "ffn_up": T.Q5_1, "ffn_down": T.Q8_0}
    layers = [(b, h, s, kinds.get(b, t)) for b, h, s, t in test_gguf.LAYER_TENSORS]
    monkeypatch.setattr(test_gguf, "LAYER_TENSORS", layers)
    path = tmp_path / "q5.gguf"
    test_gguf.write_gguf(path)
    src = GGUFSource(path)
    for name in ("mlp.gate_proj", "mlp.up_proj"):
        w = src.read_quantized(f"model.layers.1.{name}.weight")
        assert w.spec.bits == 8
        assert np.array_equal(w.dequantized(), src.read(f"model.layers.1.{name}.weight"))
    out = convert(path, tmp_path / "flash", progress=False)
    assert "no exact MLX form" not in capfd.readouterr().err
    assert read_manifest(out).layout.quant.bits == 8


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quant_blocks_are_affine_groups_of_32(kind):
    """A Q4_K / Q5_K sub-block of 32 is scale * q + bias exactly (before the float16 rounding of
    scale and bias): the values gguf's own dequantization gives, for random blocks."""
    from gguf import GGMLQuantizationType, quants

    from mlx_flash.convert.kquants import BLOCK_BYTES, affine_groups

    rng = np.random.default_rng(0)
    rows, n = 3, 512
    raw = rng.integers(0, 256, size=(rows, n // 256 * BLOCK_BYTES[kind]), dtype=np.uint8)
    blocks = raw.reshape(rows, n // 256, BLOCK_BYTES[kind])
    blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # d, dmin: finite values
    blocks[..., 2:4] = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)
    want = quants.dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(rows, n)
    q, scales, biases = affine_groups(kind, raw, rows, n)
    assert q.max() == (15 if kind == "Q4_K" else 31)
    got = (q.reshape(rows, -1, 32) * scales[..., None] + biases[..., None]).reshape(rows, n)
    assert np.array_equal(got, want)


def test_q_bits_without_quantize_on_a_float_source_is_an_error(tmp_path):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=128)
    with pytest.raises(FlashError, match="need --quantize"):
        convert(src, tmp_path / "out", progress=False, quant=QuantOptions(bits=8))
    assert not (tmp_path / "out").exists()


def test_rebuilding_a_runtime_counts_its_tables_once(tmp_path):
    from mlx_flash.runtime import FlashConfig, rebuild_runtime

    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=128)
    out = convert(src, tmp_path / "q4", progress=False, quant=QuantOptions(quantize=True, bits=4, group_size=32))
    model, _ = mlx_flash.load(out, mode="naive")
    first = model.runtime.resident.held_bytes
    for _ in range(3):
        rebuild_runtime(model, FlashConfig(mode="naive"))
    assert model.runtime.resident.held_bytes == first


def test_one_token_past_cache_and_scratch_streams_in_passes(tmp_path):
    """A token that needs more neurons than its cache and the scratch hold is computed exactly,
    its extra neurons read into the scratch a load at a time."""
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=128)
    out = convert(src, tmp_path / "q4", progress=False, quant=QuantOptions(quantize=True, bits=4, group_size=32))
    dense, _ = mlx_flash.load(out)
    x = mx.array([[7]])
    want = dense(x)
    model, _ = mlx_flash.load(out, mode="flash", sparsity="oracle", density=1.0, memory_budget="80%",
                              prefetch=False)
    store = model.runtime.store
    assert store.caches[0].capacity + store.scratch.capacity < 128
    assert mx.abs(model(x) - want).max().item() < 1e-4


def test_a_budget_too_small_for_dequantized_residents_is_refused_before_loading(smollm2):
    """--resident-dtype float32 under a budget: the check counts the values the 4-bit words
    become, not the words."""
    with pytest.raises(FlashError, match="too small"):
        mlx_flash.load(smollm2, mode="naive", resident_dtype="float32", memory_budget="100MB")
    model, _ = mlx_flash.load(smollm2, mode="naive", memory_budget="100MB")  # held at their bits: fits
    assert model.runtime.resident_dtype == "quantized"


def test_q_keep_holds_parts_float_per_layer_as_mlx_lm_predicate_does(tmp_path):
    """--q-keep embed,attn:0-0: the embeddings and layer 0's attention stay float, the rest is
    4-bit; the same values as mlx_lm.convert with the equivalent quant_predicate, and its logits."""
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=128)
    keep = lambda path: "embed_tokens" in path or path.startswith("model.layers.0.self_attn")  # noqa: E731
    ref_dir = tmp_path / "mlx-q4-mixed"
    mlx_lm_convert(str(src), str(ref_dir), quantize=True, q_bits=4, q_group_size=64, dtype="float16",
                   quant_predicate=lambda path, module, *_: not keep(path))
    ours = convert(src, tmp_path / "flash", progress=False,
                   quant=QuantOptions(quantize=True, bits=4, group_size=64, keep=("embed", "attn:0-0")))
    a = mx.load(str(ours / "resident.safetensors"))
    b = mx.load(str(convert(ref_dir, tmp_path / "flash-from-mlx", progress=False) / "resident.safetensors"))
    assert a.keys() == b.keys()
    assert "model.layers.0.self_attn.q_proj.scales" not in a and "model.layers.1.self_attn.q_proj.scales" in a
    assert "model.embed_tokens.scales" not in a
    for k in a:
        assert mx.array_equal(a[k], b[k]), k
    ref, _ = load_model(ref_dir)
    ref.set_dtype(mx.float32)
    x = mx.array([TOKENS])
    for options in (dict(mode="dense"), dict(mode="hybrid")):
        model, _ = mlx_flash.load(ours, **options)
        diff = mx.abs(model(x) - ref(x)).max().item()
        assert diff < 1e-4, f"{options}: max |logit diff| {diff}"
        model.runtime.close()


@pytest.mark.parametrize("keep, expect", [
    (("ffn",), "unknown part"), (("embed:0-1",), "not per layer"), (("attn:2-1",), "A <= B"),
    (("attn:x",), "A or A-B"), (("attn:0-9",), "layers 0-1")])
def test_bad_q_keep_items_are_clear_errors(tmp_path, keep, expect):
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=128)
    with pytest.raises(FlashError, match=expect):
        convert(src, tmp_path / "flash", progress=False, quant=QuantOptions(quantize=True, keep=keep))
    assert not (tmp_path / "flash").exists()


def test_the_ffn_width_is_the_widest_the_source_keeps_exactly():
    """Q4_K beside Q6_K (a Q4_K_M GGUF): the FFN is held at 4 bits, the Q6_K weights (re-quantized
    anyway) re-quantized to 4; Q4_0 beside Q8_0 (both exact): 8 bits, the 4-bit values widened;
    --ffn-bits 8 widens the Q4_K values instead."""
    from mlx_flash.convert.quantize import ffn_spec
    from mlx_flash.layout.quant import QuantSpec

    q4, q8 = QuantSpec(4, 32, "float16"), QuantSpec(8, 32, "float16")
    k_m = {"gate": ("keep", q4), "up": ("keep", q4), "down": ("quantize", q8)}
    assert ffn_spec(k_m, "x") == q4 and k_m["down"] == ("quantize", q4) and k_m["gate"] == ("keep", q4)
    k_m = {"gate": ("keep", q4), "up": ("keep", q4), "down": ("quantize", q8)}
    assert ffn_spec(k_m, "x", bits=8) == q8 and k_m["gate"] == ("widen", q8)
    exact = {"gate": ("keep", q4), "up": ("keep", q8), "down": ("keep", q4)}
    assert ffn_spec(exact, "x") == q8 and exact["gate"] == ("widen", q8) and exact["up"] == ("keep", q8)
    exact = {"gate": ("keep", q4), "up": ("keep", q8)}
    assert ffn_spec(exact, "x", bits=4) == q4 and exact["up"] == ("quantize", q4)  # narrowed: re-quantized

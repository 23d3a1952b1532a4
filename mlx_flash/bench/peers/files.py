"""The peers' model files: the float32 size of a flash folder, the float32 HF export for
mlx_lm, the F32/F16 GGUFs for llama.cpp, the interpreter that imports llama_cpp, and
the prompt's token ids. Imports nothing of the package."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ...errors import FlashError

DEFAULT_GGUF = "models/download/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[3]


# --- the model and what each peer needs ---


def model_stored_bytes(folder):
    """The model's weights as stored (quantized or not): the resident file plus every FFN
    layer file, without the optional DIP / predictor files."""
    from ...layout.format import read_manifest

    folder = Path(folder)
    manifest = read_manifest(folder)
    from ...layout.experts import expert_files

    experts = expert_files(manifest.experts) if manifest.experts else []
    return (folder / manifest.resident["file"]).stat().st_size + sum(f["size"] for f in manifest.ffn_files + experts)


def model_float32_bytes(folder):
    """The model's weights in float32: resident tensors plus every FFN neuron (what dense holds)."""
    from ...layout.format import read_manifest
    from ...layout.safetensors_io import SafetensorsFile

    folder = Path(folder)
    manifest = read_manifest(folder)
    st = SafetensorsFile(folder / manifest.resident["file"])
    from ...layout.quant import value_shapes

    quantization = json.loads((folder / "config.json").read_text()).get("quantization") or {}
    resident = sum(_prod(shape) for shape in value_shapes(st, quantization).values())
    lay = manifest.layout
    ffn = len(manifest.ffn_files) * len(lay.kinds) * lay.d_model * lay.n_neurons
    if manifest.experts:  # a mixture of experts: every expert's three matrices
        ex = manifest.experts["layout"]
        ffn += sum(f is not None for f in manifest.experts["files"]) * ex.n_experts * 3 * ex.d_model * ex.d_expert
    return 4 * (resident + ffn)


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def peers_home(folder):
    """Where the exported HF folder and GGUFs of a model are kept ($MLX_FLASH_HOME/peers/...)."""
    from ...layout.format import read_manifest
    from ...home import default_home

    m = read_manifest(folder)
    tag = (m.resident.get("sha256") or "nosha")[:10]
    return default_home() / "peers" / f"{Path(folder).resolve().name}-{tag}"


def ensure_hf_export(folder, home, progress=print):
    """The flash folder as a float32 Hugging Face folder for mlx_lm, exported once."""
    from ...layout.export import export_hf

    out = Path(home) / "hf-float32"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    progress(f"[peers] exporting {folder} to a float32 HF folder for mlx_lm: {out}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(folder, tmp, dtype="float32")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def source_gguf(folder, given=None):
    """The GGUF the flash folder was converted from (or --gguf), or None."""
    if given:
        p = Path(given)
        if not p.is_file():
            raise FlashError(f"--gguf {given}: no such file")
        return p
    from ...layout.format import read_manifest

    src = read_manifest(folder).source or ""
    for cand in (src, DEFAULT_GGUF):
        if cand and cand.lower().endswith(".gguf") and Path(cand).is_file():
            return Path(cand)
    return None


def write_float_gguf(src, dst, kind):
    """A F32 or F16 copy of a (quantized) GGUF, for llama.cpp.

    Every tensor is dequantized (gguf.quants) and rounded to float16, which is
    what `mlx_flash.convert --dtype float16` stores: the F16 file holds exactly
    the flash folder's values, the F32 file the same values widened. 1-D
    tensors (norms) stay F32 as llama.cpp's own converter keeps them (with the
    float16-rounded values). Metadata is copied, general.file_type updated.
    Written to a temporary name, then renamed.
    """
    import gguf
    import numpy as np

    if kind not in ("f32", "f16"):
        raise FlashError(f"cannot write a {kind} GGUF (f32 or f16)")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    file_type = gguf.LlamaFileType.ALL_F32 if kind == "f32" else gguf.LlamaFileType.MOSTLY_F16
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = int(file_type) if f.name == gguf.Keys.General.FILE_TYPE else f.contents()
        writer.add_key_value(f.name, value, vtype, sub_type=sub)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(int(file_type))

    def values(t):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
        if len(t.shape) == 1 or kind == "f32":
            return w.astype(np.float32)
        return w

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        dtype = np.float32 if (len(t.shape) == 1 or kind == "f32") else np.float16
        writer.add_tensor_info(t.name, shape, np.dtype(dtype), _prod(shape) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(np.ascontiguousarray(values(t)))
    writer.close()
    tmp.rename(dst)
    return dst


def ensure_gguf(src, home, kind, progress=print):
    if kind in ("q4_1", "gguf"):  # the source GGUF as it is
        return Path(src)
    out = Path(home) / f"{Path(src).stem.split('.')[0]}-{kind.upper()}.gguf"
    if not out.exists():
        progress(f"[peers] writing the {kind.upper()} GGUF for llama.cpp from {src}: {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        write_float_gguf(src, out, kind)
    return out


def llama_cpp_python(given=None):
    """(interpreter, version) that imports llama_cpp, or (None, why not)."""
    tried = []
    if given:
        cands = [given]
    else:
        cands = [os.environ.get("MLX_FLASH_PEERS_PYTHON"), ".venv-peers/bin/python",
                 str(REPO / ".venv-peers" / "bin" / "python"), sys.executable]
    for c in dict.fromkeys(c for c in cands if c):
        if not Path(c).exists():
            tried.append(f"{c} (not found)")
            continue
        ok, out = check_import(c, "llama_cpp")
        if ok:
            return c, out
        tried.append(f"{c} ({out})")
    return None, ("llama_cpp is not importable by " + "; ".join(tried)
                  + ". Build it with `make peers-setup` (llama-cpp-python from its sdist, "
                  "in .venv-peers) or pass --llama-python")


def check_import(python, module):
    try:
        r = subprocess.run([python, "-c", f"import {module} as m; print(getattr(m, '__version__', '?'))"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if r.returncode == 0:
        return True, r.stdout.strip()
    last = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
    return False, last


PASSAGE = (
    "The lighthouse keeper of the northern island kept a log of every ship that passed, every storm "
    "that broke against the rocks and every bird that rested on the rail of the lamp room. For "
    "thirty years the entries were short: the wind, the sea, the hours the lamp was lit. Then, one "
    "autumn, the supply boat stopped coming. At first she thought the weather had kept it in the "
    "harbour, but the sea was calm for a week and the radio answered only with static. She counted "
    "what was left in the store room: flour for a month, oil for the lamp for two, a crate of "
    "apples, salt fish, candles and the seeds her predecessor had left in a tin marked for spring. "
    "She decided to keep the lamp burning every night, whatever happened on the mainland, because "
    "a light that goes out is a promise broken. She mended the nets, dug a garden in the thin soil "
    "behind the tower, caught fish from the landing and wrote longer entries in the log, as if "
    "someone would one day read them and want to know how she had spent the days. In the third "
    "week a small boat appeared on the horizon, moving slowly against the current, with a patched "
    "sail and a single figure at the tiller. She watched it through the telescope until dusk, lit "
    "the lamp, and went down to the landing with a lantern to wait. The figure was a boy of about "
    "twelve, soaked and exhausted, who said that the town had been emptied by a fever and that he "
    "had followed the light because it was the only one still burning along the whole coast."
)
INSTRUCTION = "Read this passage, then continue the story in detail: what do they do next?\n\n"


def prompt_ids(folder, n_tokens):
    """A fixed prompt of about n_tokens (chat template included) as token ids, and its text."""
    from ...tokenizer import load_tokenizer

    config = json.loads((Path(folder) / "config.json").read_text())
    tok = load_tokenizer(Path(folder), eos_token_ids=config.get("eos_token_id"))
    words = PASSAGE.split()
    while len(words) < 4 * n_tokens:
        words = words + PASSAGE.split()

    def ids(k):
        text = INSTRUCTION + " ".join(words[:k])
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            out = tok.encode(text)
        return list(out), text

    lo, hi = 0, len(words)
    while lo < hi:  # the most words whose prompt fits n_tokens
        mid = (lo + hi + 1) // 2
        if len(ids(mid)[0]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    out, text = ids(lo)
    eos = sorted(int(i) for i in (getattr(tok, "eos_token_ids", None) or [tok.eos_token_id]))
    return out, text, eos

"""The files are safe by default: bad input is one clear error naming the file and the place (a
FlashError, exit code 2 from the CLIs), never a traceback, and never a folder lost.

convert --force replaces only a converted model (or an unfinished conversion); MLX_FLASH_HOME must
be a folder; a manifest is checked against its schema (layout/schema.py) and names only files in
its folder; a folder without a manifest says so; an unreadable data file is named; verify checks
a manifest against config.json."""

import ctypes
import json
import os
import shutil
import subprocess
import sys

import pytest

import mlx_flash
from mlx_flash.cli import convert as convert_cli
from mlx_flash.cli import doctor as doctor_cli
from mlx_flash.cli import verify as verify_cli
from mlx_flash.convert import convert
from mlx_flash.errors import FlashError
from mlx_flash.layout.format import read_manifest


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """(a Hugging Face folder, its conversion): a 2-layer random llama."""
    m = tiny_llama("safety", "float32")
    return m.hf, m.flash


def copy_model(flash, tmp_path, name="model"):
    out = tmp_path / name
    shutil.copytree(flash, out)
    return out


def edit_manifest(folder, change):
    """Apply change(manifest dict) (its return value, if not None, is the new manifest) and write it."""
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    new = change(m)
    path.write_text(json.dumps(m if new is None else new))


def cli(main, argv, capsys):
    """A CLI's main(argv) in-process -> (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def snapshot(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- convert --out: --force replaces only a model folder


def test_force_refuses_a_folder_that_is_not_a_model(tiny, tmp_path, capsys):
    src, _ = tiny
    work = tmp_path / "work"
    (work / "notes").mkdir(parents=True)
    (work / "notes" / "todo.txt").write_text("mine")
    (work / "manifest.json").write_text(json.dumps({"name": "a web app's manifest"}))
    before = snapshot(work)
    with pytest.raises(FlashError, match="not an mlx_flash model folder"):
        convert(src, work, force=True, progress=False)
    code, _, err = cli(convert_cli.main, ["--model", src, "--out", work, "--force", "--quiet"], capsys)
    assert code == 2 and str(work) in err and "--force replaces only" in err, err
    assert snapshot(work) == before
    assert not list(tmp_path.glob(".work*"))  # nothing left beside it either


def test_force_refuses_the_current_folder(tiny, tmp_path, capsys, monkeypatch):
    src, _ = tiny
    work = tmp_path / "project"
    work.mkdir()
    (work / "main.py").write_text("print('hello')")
    monkeypatch.chdir(work)
    code, _, err = cli(convert_cli.main, ["--model", src, "--out", ".", "--force", "--quiet"], capsys)
    assert code == 2 and "not an mlx_flash model folder" in err and "no manifest.json" in err, err
    assert (work / "main.py").read_text() == "print('hello')"


def test_force_replaces_a_model_and_an_unfinished_conversion(tiny, tmp_path, capsys):
    src, flash = tiny
    model = copy_model(flash, tmp_path)
    code, _, err = cli(convert_cli.main, ["--model", src, "--out", model, "--dtype", "float16", "--force",
                                          "--quiet"], capsys)
    assert code == 0, err
    assert read_manifest(model).dtype == "float16"
    unfinished = tmp_path / "unfinished"  # what a killed conversion leaves: its journal, some files
    unfinished.mkdir()
    (unfinished / "journal.json").write_text(json.dumps({"key": {"source": "x"}, "done": {}}))
    (unfinished / "resident.safetensors").write_bytes(b"\0" * 100)
    code, _, err = cli(convert_cli.main, ["--model", src, "--out", unfinished, "--quiet"], capsys)
    assert code == 2 and "unfinished conversion" in err and "--force" in err, err
    code, _, err = cli(convert_cli.main, ["--model", src, "--out", unfinished, "--force", "--quiet"], capsys)
    assert code == 0, err
    assert read_manifest(unfinished).dtype == "float16" and not (unfinished / "journal.json").exists()


def test_out_is_a_file(tiny, tmp_path, capsys):
    src, _ = tiny
    target = tmp_path / "results.csv"
    target.write_text("a,b\n1,2\n")
    for extra in ([], ["--force"]):
        code, _, err = cli(convert_cli.main, ["--model", src, "--out", target, "--quiet"] + extra, capsys)
        assert code == 2 and str(target) in err and "is a file" in err, err
        assert target.read_text() == "a,b\n1,2\n"
    code, _, err = cli(convert_cli.main, ["--model", src, "--out", target / "model", "--quiet"], capsys)
    assert code == 2 and str(target) in err, err


# ---- MLX_FLASH_HOME


def test_home_is_a_file(tiny, tmp_path, capsys, monkeypatch):
    src, _ = tiny
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("MLX_FLASH_HOME", str(home))
    with pytest.raises(FlashError, match=f"MLX_FLASH_HOME={home} is a file"):
        mlx_flash.load(src)  # (a folder to convert into the home)
    code, _, err = cli(doctor_cli.main, ["--no-probe"], capsys)
    assert code == 2 and f"MLX_FLASH_HOME={home} is a file" in err, err
    monkeypatch.setenv("MLX_FLASH_HOME", str(home / "below"))
    with pytest.raises(FlashError, match=f"MLX_FLASH_HOME={home / 'below'} lies under {home}, a file"):
        mlx_flash.load(src)
    assert home.read_text() == "not a folder"


# ---- the manifest's schema

SCHEMA_CASES = {
    "top level a list": (lambda m: [], "top level: expected a JSON object"),
    "align 0": (lambda m: m["layout"].update(align=0), "layout.align: expected a power of two"),
    "align not a power of two": (lambda m: m["layout"].update(align=1000), "layout.align"),
    "size a string": (lambda m: m["ffn_files"][0].update(size="big"), "ffn_files[0].size: expected an integer"),
    "ffn_files null": (lambda m: m.update(ffn_files=None), "ffn_files: expected a list"),
    "negative size": (lambda m: m["ffn_files"][1].update(size=-4096), "ffn_files[1].size: expected an integer >= 0"),
    "layer entry an int": (lambda m: m["ffn_files"].__setitem__(0, 7), "ffn_files[0]: expected an object"),
    "layer entry without file": (lambda m: m["ffn_files"][1].pop("file") and None, "ffn_files[1]: no 'file'"),
    "d_model a string": (lambda m: m["layout"].update(d_model="64"), "layout.d_model: expected an integer"),
    "n_neurons negative": (lambda m: m["layout"].update(n_neurons=-1), "layout.n_neurons"),
    "unknown kind": (lambda m: m["layout"].update(kinds=["gate", "up", "sideways"]), "layout.kinds"),
    "bad dtype": (lambda m: m["layout"].update(dtype="float8"), "layout.dtype"),
    "bad bits": (lambda m: m["layout"].update(quant={"bits": 7, "group_size": 64, "scale_dtype": "float16"}),
                 "layout.quant.bits"),
    "no resident": (lambda m: m.pop("resident") and None, "top level: no 'resident'"),
    "sha256 a number": (lambda m: m["resident"].update(sha256=12), "resident.sha256"),
    "no checksum file": (lambda m: m["ffn_files"][0].pop("crc32c") and None, "ffn_files[0]: no 'crc32c'"),
    "sizes against the layout": (lambda m: m["layout"].update(n_neurons=m["layout"]["n_neurons"] // 2),
                                 "ffn_files[0].size"),
    "calibration a list": (lambda m: m.update(calibration=[]), "calibration: expected an object"),
}


@pytest.mark.parametrize("case", SCHEMA_CASES)
def test_a_malformed_manifest_names_the_field(tiny, tmp_path, capsys, case):
    change, expect = SCHEMA_CASES[case]
    model = copy_model(tiny[1], tmp_path)
    edit_manifest(model, change)
    code, _, err = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 2 and f"{model / 'manifest.json'}: " in err and expect in err, err
    with pytest.raises(FlashError, match="manifest.json: ") as e:
        mlx_flash.load(model)
    assert expect in str(e.value)


# ---- the manifest names files inside its folder only


def _outside_copy(model):
    """ffn/layer_000.bin moved out of the folder, a symlink in its place."""
    outside = model.parent / "elsewhere.bin"
    shutil.move(model / "ffn" / "layer_000.bin", outside)
    (model / "ffn" / "layer_000.bin").symlink_to(outside)


ESCAPES = {
    "parent path": (lambda m: edit_manifest(m, lambda d: d["ffn_files"][0].update(file="../../etc/hostname")),
                    "ffn_files[0].file: '../../etc/hostname' is not a path inside the model folder"),
    "absolute path": (lambda m: edit_manifest(m, lambda d: d["resident"].update(file="/etc/hostname")),
                      "resident.file: '/etc/hostname' is not a path inside the model folder"),
    "checksum file": (lambda m: edit_manifest(m, lambda d: d["ffn_files"][1]["crc32c"].update(file="ffn/../../x")),
                      "ffn_files[1].crc32c.file"),
    "symlink out": (_outside_copy, "ffn_files[0].file: 'ffn/layer_000.bin' resolves to"),
}


@pytest.mark.parametrize("case", ESCAPES)
def test_files_outside_the_folder_are_refused(tiny, tmp_path, capsys, case):
    escape, expect = ESCAPES[case]
    model = copy_model(tiny[1], tmp_path)
    escape(model)
    code, _, err = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 2 and expect in err, err
    for mode in ("dense", "naive"):
        with pytest.raises(FlashError, match="manifest.json: ") as e:
            mlx_flash.load(model, mode=mode)
        assert expect in str(e.value)


def test_a_symlink_inside_the_folder_is_followed(tiny, tmp_path, capsys):
    model = copy_model(tiny[1], tmp_path)
    (model / "store").mkdir()
    shutil.move(model / "ffn" / "layer_001.bin", model / "store" / "layer_001.bin")
    (model / "ffn" / "layer_001.bin").symlink_to(model / "store" / "layer_001.bin")
    code, out, err = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 0, out + err


# ---- a folder without a manifest


def test_a_folder_without_a_manifest_says_so(tiny, tmp_path, capsys):
    src, flash = tiny
    model = copy_model(flash, tmp_path)
    (model / "manifest.json").unlink()
    expect = f"{model} has no manifest.json: not an mlx_flash model folder"
    with pytest.raises(FlashError, match=expect) as e:
        mlx_flash.load(model)
    assert "mlx_flash.convert" in str(e.value)
    for main, argv in ((verify_cli.main, [model, "--quiet"]),
                       (convert_cli.main, ["--model", model, "--out", tmp_path / "again", "--quiet"])):
        code, _, err = cli(main, argv, capsys)
        assert code == 2 and expect in err and "mlx_flash.convert" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FlashError, match=f"{empty} has no manifest.json: .* and no config.json"):
        mlx_flash.load(empty)
    code, _, err = cli(convert_cli.main, ["--model", flash, "--out", tmp_path / "twice", "--quiet"], capsys)
    assert code == 2 and "converted mlx_flash model folder already" in err, err


# ---- unreadable data files


def _without_dac_override():
    """(a subprocess's preexec_fn) Drop root's power to read any file, so that chmod 000 holds for
    it as for any user: the bounding set loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, which
    the exec then leaves out. Not root: nothing to drop (it fails, harmlessly)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP


UNREADABLE_SCRIPT = r"""
import json, sys
import mlx_flash
from mlx_flash.cli import verify
from mlx_flash.errors import FlashError
path, folder = sys.argv[1], sys.argv[2]
try:
    open(path, "rb").close()
    print(json.dumps({"readable": True}))
    sys.exit()
except PermissionError:
    pass
for name, call in (("dense", lambda: mlx_flash.load(folder, mode="dense")),
                   ("dense, no verify", lambda: mlx_flash.load(folder, mode="dense", verify=False)),
                   ("naive", lambda: mlx_flash.load(folder, mode="naive"))):
    try:
        call()
        print(json.dumps({name: "loaded"}))
    except FlashError as e:
        print(json.dumps({name: str(e)}))
sys.stdout.flush()
print(json.dumps({"verify": verify.main([folder, "--quiet"])}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="drops a Linux capability for root")
@pytest.mark.parametrize("name, readers", [("ffn/layer_001.bin", ("dense", "dense, no verify", "naive")),
                                           ("ffn/layer_000.crc32c", ("naive",)),  # (dense reads no checksum files)
                                           ("resident.safetensors", ("dense", "dense, no verify", "naive"))])
def test_an_unreadable_data_file_is_named(tiny, tmp_path, name, readers):
    model = copy_model(tiny[1], tmp_path)
    (model / name).chmod(0)
    r = subprocess.run([sys.executable, "-c", UNREADABLE_SCRIPT, str(model / name), str(model)],
                       capture_output=True, text=True, timeout=120, preexec_fn=_without_dac_override,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "Traceback" not in r.stderr, r.stderr
    results = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            results |= json.loads(line)
    if results.get("readable"):
        pytest.skip("this process can read a file of mode 000 (its capabilities could not be dropped)")
    for mode in readers:
        assert str(model / name) in results[mode] and ("cannot" in results[mode] or "read" in results[mode]), results
    assert results["verify"] == 1 and f"{name}" in r.stdout and "Permission denied" in r.stdout, r.stdout


def test_a_folder_in_place_of_a_data_file_is_named(tiny, tmp_path, capsys):
    model = copy_model(tiny[1], tmp_path)
    (model / "ffn" / "layer_001.bin").unlink()
    (model / "ffn" / "layer_001.bin").mkdir()
    for mode in ("dense", "naive"):
        with pytest.raises(FlashError, match="layer_001.bin: (a folder|read failed)"):
            mlx_flash.load(model, mode=mode)
    code, out, _ = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 1 and "ffn/layer_001.bin: a folder" in out, out


# ---- verify checks the manifest against config.json


def test_verify_finds_missing_layers(smollm2, tmp_path, capsys):
    model = tmp_path / "smollm2"  # the default model's manifest listing 3 of its 30 layers
    model.mkdir()
    for f in smollm2.iterdir():
        if f.is_file() and f.name != "manifest.json":
            shutil.copy(f, model / f.name)
    m = json.loads((smollm2 / "manifest.json").read_text())
    for section in ("ffn_files", "scales"):
        m[section] = m[section][:3]
    for part in m["dip"].values():
        part["files"] = part["files"][:3]
    for e in m["ffn_files"] + m["scales"] + [f for p in m["dip"].values() for f in p["files"]]:
        for entry in (e, e.get("crc32c")):
            if entry:
                (model / entry["file"]).parent.mkdir(exist_ok=True)
                shutil.copy(smollm2 / entry["file"], model / entry["file"])
    (model / "manifest.json").write_text(json.dumps(m))
    code, out, err = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 1, out + err
    assert "manifest.json: layers 3..29 missing (it lists 3 of config.json's 30 layers)" in out, out
    with pytest.raises(FlashError, match="layers 3..29 missing"):
        mlx_flash.load(model)


def test_verify_checks_the_manifest_against_config_json(tiny, tmp_path, capsys):
    model = copy_model(tiny[1], tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    code, out, _ = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 1 and "manifest.json: layer 2 missing (it lists 2 of config.json's 3 layers)" in out, out
    (model / "config.json").write_text(json.dumps(dict(cfg, model_type="opt", architectures=["OPTForCausalLM"],
                                                       ffn_dim=cfg["intermediate_size"])))
    code, out, _ = cli(verify_cli.main, [model, "--quiet"], capsys)  # an OPT's FFN: up and down
    assert code == 1 and "weight kinds gate, up, down, the model needs up, down" in out, out
    (model / "config.json").write_text(json.dumps(dict(cfg, hidden_size=128)))
    code, out, _ = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 1 and "hidden size 64, config.json says 128" in out, out
    (model / "config.json").write_text("[]")
    code, out, _ = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 1 and "config.json: not a JSON object" in out, out


def test_verify_checks_a_mixture_of_experts(tmp_path, capsys):
    from helpers import make_moe_folder

    src, _, _ = make_moe_folder(tmp_path / "hf", "mixtral")
    model = convert(src, tmp_path / "moe", dtype="float32", progress=False)
    edit_manifest(model, lambda m: m["experts"]["files"].__setitem__(1, None))
    code, out, _ = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 1 and "manifest.json: the experts of layer 1 missing (config.json has 2 layers)" in out, out
    edit_manifest(model, lambda m: m["experts"]["layout"].update(n_experts=0))
    code, _, err = cli(verify_cli.main, [model, "--quiet"], capsys)
    assert code == 2 and "experts.layout.n_experts: expected an integer >= 1, got 0" in err, err

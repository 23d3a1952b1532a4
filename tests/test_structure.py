"""The architecture's rules (docs/architecture.md), checked on the source: no import
circle anywhere in mlx_flash (imports inside functions included), stores imported only
by the runtime, manifest.json written only by the layout, no `model.flash`, a short
load(), the sparsity sources found by their registry, and a `# long:` reason above every
function past 80 lines."""

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import mlx_flash

PKG = Path(mlx_flash.__file__).resolve().parent
REPO = PKG.parent


def modules():
    """{module name: path} of every module in mlx_flash."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    for p in PKG.rglob("*.so"):  # compiled extensions (io/_native): imported, never importing
        parts = p.relative_to(PKG.parent).parts
        out[".".join(parts[:-1] + (p.name.split(".")[0],))] = None
    return out


def imports_of(name, path, known):
    """Every mlx_flash module `name` imports, at the top or inside a function."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base[: len(base) - node.level + 1]
                mod = ".".join(pkg + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # mlx_flash.x.y.Name -> the module that defines it
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def test_no_import_circle():
    known = modules()
    graph = {m: imports_of(m, p, known) if p else set() for m, p in known.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_module_imports_alone_in_reverse_order():
    names = [m for m, p in modules().items() if p and not m.endswith("__main__") and "peers.child" not in m]
    code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\n" % sorted(names, reverse=True)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]


def test_stores_are_imported_only_inside_the_runtime():
    known = modules()
    for m, p in known.items():
        if m.startswith("mlx_flash.runtime") or p is None:
            continue
        bad = [t for t in imports_of(m, p, known) if t.startswith("mlx_flash.runtime.stores")]
        assert not bad, f"{p} imports {bad}"


def test_low_layers_know_no_models():
    """io and kernels know bytes and arrays: nothing of mlx_flash above them (io's only
    neighbour is the kernels' numeric header, a C include)."""
    known = modules()
    for m, p in known.items():
        if p is None or not m.startswith(("mlx_flash.io", "mlx_flash.kernels")):
            continue
        pkg = ".".join(m.split(".")[:2])
        bad = [t for t in imports_of(m, p, known) if not t.startswith(pkg) and t != "mlx_flash.errors"]
        assert not bad, f"{p} imports {bad}"


def test_the_product_imports_nothing_from_the_benchmarks():
    """cli/, server/, runtime/, plan/ and models/ import nothing from bench/: the machine probe
    that --mode auto needs is plan/measure.py. The one exception is cli/benchmark.py, the
    `mlx_flash.benchmark` command, whose subcommands are bench/'s modules."""
    known = modules()
    product = ("mlx_flash.cli", "mlx_flash.server", "mlx_flash.runtime", "mlx_flash.plan", "mlx_flash.models")
    for m, p in known.items():
        if p is None or not m.startswith(product) or m == "mlx_flash.cli.benchmark":
            continue
        bad = [t for t in imports_of(m, p, known) if t == "mlx_flash.bench" or t.startswith("mlx_flash.bench.")]
        assert not bad, f"{p} imports {bad}"


def test_only_the_layout_writes_the_manifest():
    """layout/format.py's write_manifest / add_manifest_section are the only writers."""
    for p in PKG.rglob("*.py"):
        if p == PKG / "layout" / "format.py":
            continue
        text = p.read_text()
        assert ".to_json()" not in text, p
        assert not re.search(r"MANIFEST[^\n]*[\"'][wa]b?[\"']", text), p


def test_no_model_flash_dict():
    for root in (PKG, REPO / "scripts"):
        for p in root.rglob("*.py"):
            assert "model.flash" not in p.read_text(), p


def test_load_is_short():
    from mlx_flash.loader import load

    assert len(inspect.getsource(load).splitlines()) < 60


def test_a_function_past_80_lines_says_why():
    """A function of more than 80 lines (its `def` to its last line; methods and nested ones
    too) has a one-line comment directly above it (above its decorators) that starts with
    `# long:` and gives the reason; the others are split into steps with names."""
    unexplained = []
    for p in sorted(PKG.rglob("*.py")):
        text = p.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            top = min([node.lineno] + [d.lineno for d in node.decorator_list])
            above = lines[top - 2].strip() if top > 1 else ""
            if length > 80 and not (above.startswith("# long:") and above[len("# long:"):].strip()):
                unexplained.append(f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert not unexplained, "past 80 lines without a `# long:` line above:\n" + "\n".join(unexplained)


def test_sparsity_choices_come_from_the_registry():
    import argparse

    from mlx_flash.cli.generate import add_model_args
    from mlx_flash.sparsity import Source, source_names, sources

    p = argparse.ArgumentParser()
    add_model_args(p)
    choices = next(a.choices for a in p._actions if a.dest == "sparsity")
    assert tuple(choices) == source_names() and {"oracle", "threshold", "predictor", "dip", "dip-ca"} <= set(choices)
    for name, cls in sources().items():
        assert issubclass(cls, Source) and cls.name == name and cls.store in ("flash", "dip")


NEW_SOURCE = '''
"""every: keeps every neuron (a source written for this test)."""
import numpy as np

from .base import Source


class Every(Source):
    name = "every-test"
    calls = 0

    @classmethod
    def build(cls, ctx):
        return cls()

    def select(self, layer, x):
        type(self).calls += 1
        return np.ones((int(np.prod(x.shape[:-1])), self.n), dtype=bool)
'''


def test_a_new_source_is_one_file(tmp_path, monkeypatch):
    """A module with a Source subclass in the sparsity package is a --sparsity choice, and
    load(mode="flash", sparsity=its name) runs it: nothing else to register."""
    import mlx.core as mx

    import mlx_flash.sparsity as sparsity
    from mlx_flash.convert import convert
    from helpers import make_llama_folder

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "every_test.py").write_text(NEW_SOURCE.replace("self.n", "64"))
    monkeypatch.setattr(sparsity, "__path__", list(sparsity.__path__) + [str(tmp_path / "pkg")])
    monkeypatch.setattr(sparsity, "_registry", None)
    assert "every-test" in sparsity.source_names()
    src, _, _ = make_llama_folder(tmp_path / "hf", "llama", intermediate_size=64)
    out = convert(src, tmp_path / "flash", dtype="float32", progress=False)
    dense, _ = mlx_flash.load(out)
    model, _ = mlx_flash.load(out, mode="flash", sparsity="every-test")
    x = mx.array([[1, 2, 3]])
    assert mx.allclose(model(x), dense(x), atol=1e-5)
    assert sparsity.source_class("every-test").calls >= len(model.layers)


def test_the_runtime_never_imports_the_planner():
    """plan/ may import runtime/, never the other way (the loader hands the runtime the planner:
    build_runtime(planner=mlx_flash.plan)); models/ imports neither, nor the loader."""
    known = modules()
    for m, p in known.items():
        if p is None:
            continue
        deps = imports_of(m, p, known)
        if m.startswith("mlx_flash.runtime"):
            bad = [t for t in deps if t.startswith("mlx_flash.plan")]
            assert not bad, f"{p} imports {bad}"
        if m.startswith("mlx_flash.models"):
            bad = [t for t in deps if t.startswith(("mlx_flash.runtime", "mlx_flash.plan", "mlx_flash.loader"))]
            assert not bad, f"{p} imports {bad}"


def test_the_product_imports_nothing_from_the_quality_table():
    """cli/ (but its eval front end), server/, runtime/, plan/ and models/ import nothing from
    eval/table*: the quality table is a measurement, not part of a run."""
    known = modules()
    product = ("mlx_flash.cli", "mlx_flash.server", "mlx_flash.runtime", "mlx_flash.plan", "mlx_flash.models")
    for m, p in known.items():
        if p is None or not m.startswith(product) or m == "mlx_flash.cli.eval":
            continue
        bad = [t for t in imports_of(m, p, known) if t.startswith("mlx_flash.eval.table")]
        assert not bad, f"{p} imports {bad}"


def test_the_library_states_facts_not_history():
    """No tracked path or text under mlx_flash/ names a run (stopNN), an issue number, or a file
    outside the repository (FACTS, ../shared): code, comments and help texts say what is true now."""
    tracked = subprocess.run(["git", "ls-files", "mlx_flash"], capture_output=True, text=True, cwd=REPO)
    paths = tracked.stdout.split() if tracked.returncode == 0 and tracked.stdout else [
        str(p.relative_to(REPO)) for p in PKG.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    pattern = re.compile(r"stop[0-9]|issue [0-9]|FACTS|\.\./shared")
    bad = [p for p in paths if pattern.search(p)]
    for p in paths:
        f = REPO / p
        if f.suffix in (".py", ".c", ".h", ".md", ".txt", ".json", ".toml") and f.is_file():
            bad += [f"{p}:{i}" for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
                    if pattern.search(line)]
    assert not bad, bad

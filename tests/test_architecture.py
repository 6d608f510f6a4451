"""The import rules of ARCHITECTURE.md, checked on the source (AST, every import incl. lazy ones).

* ``format/`` is the bottom: it imports no other part of the package;
* ``engines/`` (the target model: HF, SGLang) sits on ``format/`` alone, below everything that runs a model;
* ``extract/`` (writes) and ``stream/`` (reads) never import each other, nor ``tools/`` or ``cli/``;
* ``regen/`` (rewrites chat data) builds on ``extract/``; ``extract/`` reads its output through ``format/``;
* nothing below ``cli/`` parses command lines (argparse / jsonargparse);
* the installed packages never import ``benchmarks`` (not installed);
* training (``eagle_train``) reads through ``stream/``/``tools/`` and runs models through ``engines/``;
  of ``eagle_data`` only ``cli/`` imports training (the package-level edge goes one way).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("format", "engines", "extract", "regen", "stream", "tools", "cli")
#: part -> parts of eagle_data it may import (besides itself and the leaf modules)
ALLOWED = {
    "format": set(),
    "engines": {"format"},
    "extract": {"format", "engines"},
    "regen": {"format", "extract", "engines"},
    "stream": {"format"},
    "tools": {"format", "engines", "extract", "stream"},
    "cli": {"format", "engines", "extract", "regen", "stream", "tools"},
}
LEAVES = {"eagle_data", "eagle_data.packing", "eagle_data.assets", "eagle_data.checks", "eagle_data.background",
          "eagle_data.host", "eagle_data.templates"}  # imported from anywhere
CLI_PARSERS = ("argparse", "jsonargparse")
TRAIN = "train/eagle_train"  # the training package's folder (the design card's train/)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def _part(mod: str) -> str | None:
    bits = mod.split(".")
    return bits[1] if len(bits) > 1 and bits[0] == "eagle_data" and bits[1] in PARTS else None


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "cpu_sgl_kernel" not in p.parts)


def test_every_module_lives_in_a_part_or_is_a_leaf():
    top = {p.stem for p in (ROOT / "eagle_data").glob("*.py")} - {"__init__"}
    assert {f"eagle_data.{m}" for m in top} <= LEAVES, top


def test_leaves_import_no_part():
    """The leaf modules (and the templates package) sit below every part: they import none."""
    files = [ROOT / "eagle_data" / f"{m.split('.')[1]}.py" for m in LEAVES if m.count(".") == 1]
    files = [f for f in files if f.exists()] + _files("eagle_data/templates")
    bad = [f"{f.relative_to(ROOT)} imports {mod}" for f in files for mod in _imports(f) if _part(mod) is not None]
    assert len(files) >= 4 and bad == []


@pytest.mark.parametrize("part", PARTS)
def test_part_imports_only_what_it_may(part):
    bad = []
    for f in _files(f"eagle_data/{part}"):
        for mod in _imports(f):
            other = _part(mod)
            if other is not None and other != part and other not in ALLOWED[part]:
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
            if mod.split(".")[0] == "benchmarks":
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
            if part != "cli" and mod.split(".")[0] == "eagle_train":
                bad.append(f"{f.relative_to(ROOT)} imports training ({mod})")
            if part != "cli" and mod.split(".")[0] in CLI_PARSERS:
                bad.append(f"{f.relative_to(ROOT)} parses command lines ({mod})")
    assert bad == []


def test_training_reads_through_stream_and_tools_only():
    """... and runs models through ``engines/`` (serve-check: the SGLang engine settings and the
    HF capture), never through the extraction, the regeneration or the command line."""
    files = _files(TRAIN)
    bad = [f"{f.relative_to(ROOT)} imports {m}" for f in files for m in _imports(f)
           if _part(m) in ("extract", "regen", "cli") or m.split(".")[0] == "benchmarks"]
    assert len(files) > 10 and bad == []


def test_the_rules_see_lazy_imports(tmp_path):
    """The checker itself: an import inside a function counts."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from eagle_data.extract.run import run_extract\n")
    assert "eagle_data.extract.run" in _imports(f) and _part("eagle_data.extract.run") == "extract"


def _limits_broken(folders: tuple[str, ...]) -> list[str]:
    """Modules over 400 lines, functions over 60 lines, ``__init__`` over 12 parameters."""
    bad = []
    for folder in folders:
        for f in (ROOT / folder).rglob("*.py"):
            src = f.read_text()
            if src.count("\n") > 400:
                bad.append(f"{f.relative_to(ROOT)}: {src.count(chr(10))} lines")
            for node in ast.walk(ast.parse(src)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if node.end_lineno - node.lineno + 1 > 60:
                    bad.append(f"{f.relative_to(ROOT)}:{node.name}: {node.end_lineno - node.lineno + 1} lines")
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1 + (a.vararg is not None) + (a.kwarg is not None)
                if node.name == "__init__" and n > 12:
                    bad.append(f"{f.relative_to(ROOT)}:__init__: {n} parameters")
    return bad


def test_installed_code_keeps_the_size_rules():
    """ARCHITECTURE.md's size rules hold for the package and the trainer."""
    assert _limits_broken(("eagle_data", TRAIN)) == []


def test_benchmarks_keep_the_size_rules():
    """... and for the benchmarks (not installed: run from a checkout)."""
    assert _limits_broken(("benchmarks",)) == []


def test_the_size_check_sees_a_long_function(tmp_path, monkeypatch):
    """The checker itself: a 61-line function and a 13-parameter ``__init__`` are reported."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "p").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    params = ", ".join(f"a{i}" for i in range(13))
    (tmp_path / "p" / "m.py").write_text(f"def f():\n{body}\n\nclass C:\n    def __init__(self, {params}):\n        pass\n")
    assert sorted(b.split(":")[1] for b in _limits_broken(("p",))) == ["__init__", "f"]

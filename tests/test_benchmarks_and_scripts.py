"""benchmarks/, scripts/ and tests/ each import the installed ``detjac`` package, never each other's files: no
benchmark or script edits ``sys.path`` or imports a test helper or another benchmark, and no test imports a
benchmark or a script (it may run one as a subprocess). Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

BENCHMARKS, SCRIPTS = ROOT / "benchmarks", ROOT / "scripts"


def _module_names(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py")}


def _path_edits_and_imports(path: Path) -> tuple[list[int], list[tuple[int, str]], list[int]]:
    """(lines editing ``sys.path``, (line, module) of every import, lines loading a file of benchmarks/ or
    scripts/ by its path)."""
    edits, imports, loads = [], [], []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            edits.append(node.lineno)  # any use: insert, append, assignment, remove
        elif isinstance(node, ast.Import):
            imports += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imports.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("spec_from_file_location",
                                                                                  "run_path", "import_module"):
            words = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            if words & {"benchmarks", "scripts"} or any(w.endswith(".py") for w in words):
                loads.append(node.lineno)
    return edits, imports, loads


def outside_offences() -> dict[str, list[str]]:
    """What each benchmark, script and test reaches for beyond the installed package: ``sys.path`` edits (in
    benchmarks and scripts), imports of tests' helpers or of other benchmarks (benchmarks, scripts), imports of
    benchmarks or scripts (tests)."""
    tests, benchmarks, scripts = _module_names(TESTS), _module_names(BENCHMARKS), _module_names(SCRIPTS)
    found: dict[str, list[str]] = {}
    files = [*sorted(BENCHMARKS.glob("*.py")), *sorted(SCRIPTS.glob("*.py")), *sorted(TESTS.rglob("*.py"))]
    for path in files:
        rel, edits, imports, loads = str(path.relative_to(ROOT)), *_path_edits_and_imports(path)
        kind = path.relative_to(ROOT).parts[0]
        out = []
        if kind != "tests":
            out += [f"line {n}: edits sys.path" for n in edits]
        forbidden = {"benchmarks": tests | benchmarks | scripts, "scripts": tests | benchmarks,
                     "tests": benchmarks | scripts}[kind] - ({path.stem} if kind != "tests" else set())
        prefixes = {"benchmarks": ("tests", "benchmarks", "scripts"), "scripts": ("tests", "benchmarks"),
                    "tests": ("benchmarks", "scripts")}[kind]
        out += [f"line {n}: imports {m}" for n, m in imports
                if m.partition(".")[0] in forbidden or m.partition(".")[0] in prefixes]
        if kind == "tests":
            out += [f"line {n}: loads a benchmark or script by its path" for n in loads]
            out += [f"line {n}: puts benchmarks/ or scripts/ on sys.path" for n in edits
                    if any(w in path.read_text(encoding="utf-8").splitlines()[n - 1] for w in ("BENCH", "scripts"))]
        if out:
            found[rel] = out
    return found


def test_benchmarks_scripts_and_tests_import_the_package_not_each_other():
    found = outside_offences()
    assert not found, "Expected benchmarks and scripts to import only the installed detjac (no sys.path edits, no "\
                      "benchmark or test imported) and tests to import no benchmark or script. Got:\n" + "\n".join(
                          f"  {rel}: {'; '.join(why)}" for rel, why in found.items())


def test_the_offences_are_found(tmp_path, monkeypatch):
    """The checker sees a sys.path edit, a benchmark importing a sibling and a test loading a script by path."""
    edits, imports, loads = _path_edits_and_imports(_written(tmp_path / "a.py", (
        "import sys\nsys.path.insert(0, 'x')\nfrom streamed import peak_mib\n"
        "import importlib.util\nimportlib.util.spec_from_file_location('c', ROOT / 'scripts' / 'corpus.py')\n")))
    assert edits == [2] and (3, "streamed") in imports and loads == [5]


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path

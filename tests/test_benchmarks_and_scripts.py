"""benchmarks/ and scripts/ are packages run from the repository root as ``python -m benchmarks.NAME`` and
``python -m scripts.NAME``: each imports its own package (its helpers live inside it) and detjac's public modules,
never a test helper or a private detjac module; a script may use the support the benchmarks keep
(``benchmarks.support``), no benchmark imports a script. Nothing in benchmarks/, scripts/ or tests/ edits
``sys.path`` or runs or loads a benchmark or script by its file path. Tests may import the packages (the benchmarks'
own support is tested that way). Read from the source with ``ast``; only the ``--help`` test runs anything."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
BENCHMARKS, SCRIPTS = ROOT / "benchmarks", ROOT / "scripts"
LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader"}


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"


BY_PATH_OK = {"mkdocs_hooks.py"}  # mkdocs loads its hooks by path (mkdocs.yml); it imports no benchmark or script


def _names_a_file(node: ast.AST, own: bool = True) -> bool:
    """``__file__`` (``own``: the module itself), or a path into benchmarks/ or scripts/: a ``"benchmarks"`` or
    ``"scripts"`` part joined with a ``.py`` file (``ROOT / "scripts" / "x.py"``) or a string that starts with one
    (``"benchmarks/x.py"``)."""
    words = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    files = {w.rsplit("/", 1)[-1] for w in words if w.endswith(".py")} - BY_PATH_OK
    return (own and any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node))) \
        or any(w.split("/")[0] in ("benchmarks", "scripts") and "/" in w and not w.endswith(tuple(BY_PATH_OK))
               for w in words) \
        or bool(files and words & {"benchmarks", "scripts"})


def _runs_a_file(node: ast.AST) -> bool:
    """A command list holding ``sys.executable`` and a file by its path, a file loader given one, or a path to a
    file of benchmarks/ or scripts/ built with ``/`` (judged whole, at its outermost ``/``)."""
    if isinstance(node, ast.List | ast.Tuple):
        runs = any(isinstance(e, ast.Attribute) and e.attr == "executable" and getattr(e.value, "id", None) == "sys"
                   for e in node.elts)
        return runs and _names_a_file(node)
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in LOADERS:
        return _names_a_file(node)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return not isinstance(getattr(node, "parent", None), ast.BinOp) and _names_a_file(node, own=False)
    return False


def scan(path: Path) -> tuple[list[int], list[tuple[int, str, list[str]]], list[int]]:
    """(lines using ``sys.path``, (line, module, names) of every absolute import, lines running or loading a Python
    file by its path)."""
    edits, imports, loads = [], [], []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]  # a path is judged whole, at its outermost "/"
    for node in ast.walk(tree):
        if _is_sys_path(node):
            edits.append(node.lineno)  # any use: insert, append, assignment, remove
        elif isinstance(node, ast.Import):
            imports += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imports.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif _runs_a_file(node):
            loads.append(node.lineno)
    return edits, imports, sorted(set(loads))


def _private(module: str, names: list[str]) -> bool:
    return any(part.startswith("_") for part in module.split(".")) or any(n.startswith("_") for n in names)


def offences(path: Path, kind: str) -> list[str]:
    """What one file of benchmarks/, scripts/ or tests/ (``kind``) does against the rule."""
    edits, imports, loads = scan(path)
    helpers = {p.stem for p in TESTS.glob("*.py")}
    out = [f"line {n}: uses sys.path" for n in edits]
    out += [f"line {n}: runs or loads a file by its path" for n in loads]
    for n, module, names in imports:
        top = module.partition(".")[0]
        other = {"benchmarks": "scripts", "scripts": "benchmarks"}.get(kind)
        if kind != "tests" and (top in helpers or top == "tests" or (top == other and not (
                kind == "scripts" and module.startswith("benchmarks.support")))):
            out.append(f"line {n}: imports {module}")
        elif kind != "tests" and top == "detjac" and _private(module, names):
            out.append(f"line {n}: imports a private part of detjac ({module}: {', '.join(names)})")
    return out


def all_offences() -> dict[str, list[str]]:
    files = [(p, "benchmarks") for p in sorted(BENCHMARKS.rglob("*.py"))]
    files += [(p, "scripts") for p in sorted(SCRIPTS.glob("*.py"))]
    files += [(p, "tests") for p in sorted(TESTS.rglob("*.py"))]
    found = {str(p.relative_to(ROOT)): offences(p, kind) for p, kind in files}
    return {rel: why for rel, why in found.items() if why}


def test_benchmarks_and_scripts_are_packages_that_import_their_own_and_detjac():
    assert (BENCHMARKS / "__init__.py").is_file() and (SCRIPTS / "__init__.py").is_file()
    found = all_offences()
    assert not found, ("Expected benchmarks and scripts to import their own package and detjac's public modules, and "
                       "no file of benchmarks/, scripts/ or tests/ to touch sys.path or run a file by its path. Got:\n"
                       + "\n".join(f"  {rel}: {'; '.join(why)}" for rel, why in found.items()))


def test_the_offences_are_found(tmp_path):
    """The checker sees a sys.path edit, a test helper, the other package, a private detjac module and name, a
    sibling run by its path and a file loaded by its path; a relative import and detjac's public API pass."""
    path = tmp_path / "a.py"
    path.write_text(
        "import sys, subprocess\nsys.path.insert(0, 'x')\nfrom tiny_models import tiny\nimport scripts.lens_prompts\n"
        "from detjac.engine._x import y\nfrom detjac.engine import _z\n"
        "subprocess.run([sys.executable, __file__, '--one'])\n"
        "import importlib.util\nimportlib.util.spec_from_file_location('c', ROOT / 'scripts' / 'corpus.py')\n"
        "from .support import peers\nfrom detjac.engine import jacobian\nimport benchmarks.support.flops\n"
        "subprocess.run([sys.executable, '-m', __spec__.name, '--one'])\n"
        "cmd = [sys.executable, str(Path(__file__).resolve()), '--worker']\n"
        "SCRIPT = Path(__file__).parent.parent / 'benchmarks' / 'gpu_check.py'\n"
        "HOOK = ROOT / 'scripts' / 'mkdocs_hooks.py'\nDATA = Path(__file__).parent / 'data' / 'x.txt'\n")
    assert offences(path, "benchmarks") == [
        "line 2: uses sys.path", "line 7: runs or loads a file by its path", "line 9: runs or loads a file by its path",
        "line 14: runs or loads a file by its path", "line 15: runs or loads a file by its path",
        "line 3: imports tiny_models", "line 4: imports scripts.lens_prompts",
        "line 5: imports a private part of detjac (detjac.engine._x: y)",
        "line 6: imports a private part of detjac (detjac.engine: _z)"]
    script = tmp_path / "s.py"
    script.write_text("from benchmarks.support.shipped import shipped_gguf\nimport benchmarks.graphs\n")
    assert offences(script, "scripts") == ["line 2: imports benchmarks.graphs"]
    assert offences(path, "tests") == ["line 2: uses sys.path", "line 7: runs or loads a file by its path",
                                       "line 9: runs or loads a file by its path",
                                       "line 14: runs or loads a file by its path",
                                       "line 15: runs or loads a file by its path"]


def runnable(folder: Path) -> list[str]:
    """The modules of a package that run as ``python -m``: those with a ``__main__`` block."""
    return sorted(p.stem for p in folder.glob("*.py") if "__name__ == \"__main__\"" in p.read_text(encoding="utf-8"))


def test_every_benchmark_is_runnable():
    """Each benchmark module is a command (its helpers are in benchmarks.support)."""
    plain = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")
    assert runnable(BENCHMARKS) == plain


# One interpreter runs every module as ``python -m NAME --help`` would (runpy, as __main__), so torch and detjac are
# imported once rather than once per module (about 3 s each on 2 cores).
_HELP_ALL = """
import contextlib, io, json, runpy, sys
found = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
            code = "returned without exiting"
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:  # noqa: BLE001  reported with the module's name
            code = repr(exc)
    found[name] = [code, "usage" in text.getvalue().lower(), text.getvalue()[-600:]]
print(json.dumps(found))
"""


@pytest.mark.slow
def test_every_benchmark_and_script_answers_help():
    """``python -m benchmarks.NAME --help`` (and ``scripts.NAME``) from the repository root prints its usage and exits
    0."""
    import json

    names = [f"benchmarks.{m}" for m in runnable(BENCHMARKS)]
    names += [f"scripts.{m}" for m in runnable(SCRIPTS)]
    got = subprocess.run([sys.executable, "-c", _HELP_ALL, *names], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    results = json.loads(got.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(names)
    bad = [f"{name}: exit {code}: {text}" for name, (code, usage, text) in results.items() if code != 0 or not usage]
    assert not bad, "Expected every benchmark and script to print its usage. Got:\n" + "\n".join(bad)

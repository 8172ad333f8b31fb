"""The layers of detjac import each other one way only (README, "Architecture"); read from the source.

Every ``.py`` file under core/, engine/, graphs/, store/, analysis/, runs/, view/ and cli/ is parsed with
``ast`` (nothing is imported, so this runs without torch in a fraction of a second), and every
import is collected: module-level ones, those inside functions and classes, relative ones
(resolved with the folder -> package mapping of pyproject.toml), ``importlib.import_module``
of a literal name, and imports under ``if TYPE_CHECKING:`` too -- a type-only import still
ties one layer's source to another's, and an annotation can name a Protocol of its own
layer instead, so they are held to the same rules.

Edges are module to module (``from detjac.store import create_store`` is an edge to
``detjac.store``; ``from . import format`` to ``detjac.store.format``). The implicit import
of a module's parent packages by Python is not an edge: it would make every package
``__init__`` that re-exports a submodule a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"core": "detjac", "engine": "detjac.engine", "graphs": "detjac.graphs", "store": "detjac.store",
           "analysis": "detjac.analysis", "runs": "detjac.runs", "view": "detjac.view", "cli": "detjac.cli"}

TORCH = ("torch", "transformers", "accelerate", "bitsandbytes")  # torch, or packages that import it
ZARR_DASK = ("zarr", "numcodecs", "dask", "distributed")
LAYERS = ("detjac.engine", "detjac.graphs", "detjac.store", "detjac.analysis", "detjac.runs", "detjac.view",
          "detjac.cli")


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repository root
    line: int
    module: str  # the importing module, e.g. detjac.store.backend.zarr_store
    target: str  # the imported module, e.g. detjac.store.format or numpy.linalg

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    """``store/backend/zarr_store.py`` -> ``detjac.store.backend.zarr_store``; ``engine/families/__init__.py`` ->
    ``detjac.engine.families``."""
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def all_modules() -> set[str]:
    return {module_name(p) for p in source_files()}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules a ``from X import a, b`` statement imports: ``X.a`` where that is a module, else ``X``."""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    targets = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
    if len(targets) < len(node.names):
        targets.append(base)  # names that are attributes of the module, not submodules
    return targets


def imports_of(path: Path, known: set[str]) -> Iterator[Import]:
    """Every import in one file of the tree (see the module docstring for what counts)."""
    return parse_imports(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)), module_name(path),
                         path.name == "__init__.py", known)


def parse_imports(source: str, rel: str, module: str, is_package: bool, known: set[str]) -> Iterator[Import]:
    """Every import in ``source``, the text of module ``module`` in file ``rel``."""
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = _resolve(node, module, is_package, known)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            targets = [node.args[0].value]
        else:
            continue
        for target in targets:
            yield Import(rel, node.lineno, module, target)


def all_imports() -> list[Import]:
    known = all_modules()
    return [imp for path in source_files() for imp in imports_of(path, known)]


def within(name: str, *packages: str) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def top_level(name: str) -> str:
    return name.partition(".")[0]


# layer -> (what it must not import, why)
RULES = {
    "detjac.engine": (lambda t: within(t, "detjac.graphs", "detjac.store", "detjac.analysis", "detjac.runs",
                                       "detjac.cli") or top_level(t) in ZARR_DASK,
                      "engine/ computes; it never imports graphs, store, analysis, runs, cli, zarr or dask"),
    "detjac.graphs": (lambda t: within(t, "detjac.store", "detjac.analysis", "detjac.runs", "detjac.view",
                                       "detjac.cli") or top_level(t) in ZARR_DASK,
                      "graphs/ builds on the engine's façade and core only: no store, analysis, runs, view, cli, "
                      "zarr or dask"),
    "detjac.store": (lambda t: within(t, "detjac.engine", "detjac.graphs", "detjac.analysis", "detjac.runs",
                                      "detjac.cli") or top_level(t) in TORCH,
                     "store/ never imports torch, engine, graphs, analysis, runs or cli"),
    "detjac.analysis": (lambda t: within(t, "detjac.engine", "detjac.graphs", "detjac.runs", "detjac.cli")
                        or top_level(t) in TORCH,
                        "analysis/ reads the store only: no torch, engine, graphs, runs or cli"),
    "detjac.view": (lambda t: within(t, "detjac.engine", "detjac.graphs", "detjac.runs", "detjac.cli")
                    or top_level(t) in TORCH,
                    "view/ shows the store and the analyses: no torch, engine, graphs, runs or cli"),
}


def _layer(module: str) -> str | None:
    """The layer a module belongs to (``detjac.store`` for ``detjac.store.backend.zarr_store``); None for core/."""
    return next((layer for layer in LAYERS if within(module, layer)), None)


def violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        layer = _layer(imp.module)
        if layer in RULES and RULES[layer][0](imp.target):
            out.append(f"{imp}  ({RULES[layer][1]})")
        if within(imp.target, "detjac.cli") and layer != "detjac.cli":
            out.append(f"{imp}  (only cli/ imports detjac.cli: it is the outermost layer)")
        if layer is None and (within(imp.target, *LAYERS) or top_level(imp.target) in TORCH + ZARR_DASK):
            out.append(f"{imp}  (core/ is the dependency-free base every layer imports)")
    return out


def past_facades(imports: list[Import]) -> list[str]:
    """Imports from one layer into another that reach past the other's façade: a layer's package (``detjac.store``)
    is its API, its modules (``detjac.store.backend.zarr_store``) are its own business."""
    out = []
    for imp in imports:
        layer, target = _layer(imp.module), _layer(imp.target)
        if target is not None and target != layer and imp.target != target:
            out.append(f"{imp}  (import from {target}, the façade)")
    return out


def cycles(imports: list[Import]) -> list[list[Import]]:
    """The import cycles between detjac modules: for each strongly connected component of more than one module
    (or a module importing itself), the imports inside it."""
    known = all_modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for imp in imports:
        if imp.target in known:
            edges[imp.module].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the module graph is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                components.append(component)

    for v in sorted(known):
        if v not in index:
            visit(v)
    return [sorted((i for i in imports if i.module in c and i.target in c), key=lambda i: (i.file, i.line))
            for c in components]


def test_the_source_is_found():
    """The checks below would pass vacuously on an empty tree: make sure they see every layer."""
    modules = all_modules()
    assert {"detjac", "detjac.errors", "detjac.engine", "detjac.store.reader", "detjac.analysis.spectra",
            "detjac.runs.batch", "detjac.view.server", "detjac.cli.main"} <= modules
    found = all_imports()
    assert any(i.module == "detjac.store.backend.zarr_store" and i.target == "detjac.store.format" for i in found)
    assert any(i.module == "detjac.store.backend.sealed" and i.target == "zarr" for i in found)  # inside a function


def test_no_import_cycles_between_detjac_modules():
    found = cycles(all_imports())
    message = "\n\n".join(f"cycle through {', '.join(sorted({i.module for i in c}))}:\n  "
                          + "\n  ".join(str(i) for i in c) for c in found)
    assert not found, f"Expected no import cycles between detjac modules. Got {len(found)}:\n\n{message}"


def test_layers_import_one_way():
    found = violations(all_imports())
    assert not found, (f"Expected each layer to import only the layers below it (README, 'Architecture'). "
                       f"Got {len(found)} imports that do not:\n  " + "\n  ".join(found))


def test_other_layers_import_only_a_layers_facade():
    found = past_facades(all_imports())
    assert not found, (f"Expected imports between layers to go through the façade of the layer imported (its package "
                       f"__init__, README 'Architecture'). Got {len(found)}:\n  " + "\n  ".join(found))


def test_the_checks_catch_what_they_claim():
    """Each rule fires on a made-up import of the kind it forbids, with the file and line in its message; imports
    inside functions and under TYPE_CHECKING are seen, relative ones resolved."""
    fake = [Import("store/x.py", 3, "detjac.store.x", "torch.nn"),
            Import("analysis/y.py", 9, "detjac.analysis.y", "detjac.engine.streamed.streamed_engine"),
            Import("engine/z.py", 5, "detjac.engine.z", "dask.array"),
            Import("runs/w.py", 7, "detjac.runs.w", "detjac.cli.main"),
            Import("core/v.py", 2, "detjac.v", "detjac.store"),
            Import("view/u.py", 4, "detjac.view.u", "detjac.engine"),
            Import("store/ok.py", 1, "detjac.store.ok", "numpy"),
            Import("cli/ok.py", 1, "detjac.cli.ok", "detjac.cli.render")]
    assert [f.split("  (")[0] for f in violations(fake)] == [
        "store/x.py:3 imports torch.nn", "analysis/y.py:9 imports detjac.engine.streamed.streamed_engine",
        "engine/z.py:5 imports dask.array", "runs/w.py:7 imports detjac.cli.main", "core/v.py:2 imports detjac.store",
        "view/u.py:4 imports detjac.engine"]
    crossing = [Import("cli/a.py", 1, "detjac.cli.a", "detjac.store.format"),
                Import("cli/b.py", 2, "detjac.cli.b", "detjac.store"),
                Import("runs/c.py", 3, "detjac.runs.c", "detjac.engine.streamed.tracing"),
                Import("store/d.py", 4, "detjac.store.d", "detjac.store.format"),
                Import("runs/e.py", 5, "detjac.runs.e", "detjac.targets")]
    assert [f.split("  (")[0] for f in past_facades(crossing)] == [
        "cli/a.py:1 imports detjac.store.format", "runs/c.py:3 imports detjac.engine.streamed.tracing"]
    loop = [Import("store/a.py", 1, "detjac.store.reader", "detjac.store.format"),
            Import("store/b.py", 2, "detjac.store.format", "detjac.store.reader"),
            Import("store/c.py", 4, "detjac.store.backend.lock", "detjac.store.format")]
    assert [[str(i) for i in c] for c in cycles(loop)] == [["store/a.py:1 imports detjac.store.format",
                                                            "store/b.py:2 imports detjac.store.reader"]]
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    import torch\n\ndef f():\n    from ..engine import streamed\n"
              "    from . import format as fmt, nothing_such\n    importlib.import_module('detjac.cli.main')\n")
    found = {(i.line, i.target) for i in parse_imports(source, "store/f.py", "detjac.store.f", False, all_modules())}
    assert found == {(1, "__future__"), (2, "typing"), (4, "torch"), (7, "detjac.engine.streamed"),
                     (8, "detjac.store.format"), (8, "detjac.store"), (9, "detjac.cli.main")}


# -- the store and analysis tests run without torch ------------------------------------------------------------------

TESTS = ROOT / "tests"
TORCH_FREE_TESTS = ("store", "analysis")  # folders of tests/ whose tests need neither torch nor a model
TEST_HELPERS_FORBIDDEN = ("tiny_models",)  # helpers of tests/ that build torch models
FORBIDDEN_NAMES = {("store_helpers", "run_default")}  # runs the default model through `detjac run`


def _test_imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in a test file, at any depth; relative imports are not used there."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def test_store_and_analysis_tests_import_neither_torch_nor_a_model():
    """Their files, conftest.py included, and the helpers of tests/ they import (transitively), read with ast."""
    todo = [p for folder in TORCH_FREE_TESTS for p in sorted((TESTS / folder).glob("*.py"))]
    assert {"conftest.py", "test_store_conformance.py"} <= {p.name for p in todo}
    seen: set[Path] = set()
    found, factory = [], False
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for line, module, names in _test_imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            factory = factory or module == "detjac.store.testing"
            if top_level(module) in TORCH or within(module, "detjac.engine", "detjac.runs") \
                    or module in TEST_HELPERS_FORBIDDEN:
                found.append(where)
            found += [f"{where}.{name}" for name in names if (module, name) in FORBIDDEN_NAMES]
            helper = TESTS / f"{module}.py"
            if helper.is_file():
                todo.append(helper)
    assert factory, "Expected the store and analysis tests to build their stores with detjac.store.testing"
    assert not found, ("Expected the tests of tests/store and tests/analysis to need neither torch nor a model (their "
                       "stores come from detjac.store.testing; tests of a real run go to tests/runs). Got:\n  "
                       + "\n  ".join(found))


def test_store_and_analysis_test_modules_load_without_torch():
    """Importing them (conftest.py first, as pytest does) loads neither torch nor the engine, transitively."""
    import os
    import subprocess
    import sys

    files = [str(p) for folder in TORCH_FREE_TESTS for p in sorted((TESTS / folder).glob("*.py"))]
    code = ("import importlib.util, sys\n"
            f"for i, f in enumerate(sorted({files!r}, key=lambda f: not f.endswith('conftest.py'))):\n"
            "    spec = importlib.util.spec_from_file_location(f'm{i}', f)\n"
            "    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(module)\n"
            "print(sorted({m if m.startswith('detjac') else m.partition('.')[0] for m in sys.modules\n"
            "              if m.partition('.')[0] in ('torch', 'transformers', 'tiny_models')\n"
            "              or m.startswith(('detjac.engine', 'detjac.runs'))}))")
    # the import path pytest gives the tests (pyproject's pythonpath: the root and tests/), given the same way
    path = os.pathsep.join([str(ROOT), str(TESTS)])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"Expected no torch, engine or runs modules. Got {out.stdout.strip()}."

"""The command modules stay thin: from the CLI package they import only the shared ``options``, ``render`` and
``graph_options``; only ``main`` imports the command modules (to register them); and no cli module imports torch,
at import time or inside a command (the library does the computing)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import detjac.cli

CLI = Path(detjac.cli.__file__).parent
SHARED = {"options", "render", "graph_options", "attention_pages"}


def _cli_imports(path: Path) -> set[str]:
    """Modules of the CLI package that ``path`` imports, anywhere in the file (relative or absolute)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import render
                found |= {alias.name for alias in node.names}
            elif node.level == 1:
                found.add(node.module.split(".")[0])
            elif node.module and node.module.startswith("detjac.cli."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("detjac.cli.")}
    return found


def test_command_modules_import_only_options_and_render():
    modules = sorted(p for p in CLI.glob("*.py") if p.stem not in {"__init__", "main", *SHARED})
    assert {p.stem for p in modules} >= {"analyze_cmds", "run_cmd", "steer_cmd", "store_cmds", "svd_cmd"}
    for path in modules:
        assert _cli_imports(path) <= SHARED, path.name
    for shared in SHARED:
        assert _cli_imports(CLI / f"{shared}.py") == set(), shared


def test_main_registers_the_command_modules():
    commands = {p.stem for p in CLI.glob("*.py")} - {"__init__", "main", *SHARED}
    assert _cli_imports(CLI / "main.py") == commands | {"options", "render"}


def _torch_imports(path: Path) -> list[int]:
    """The lines of ``path`` that import torch (or a torch submodule), at any level: module, function, branch."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name == "torch" or name.startswith("torch.") for name in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_cli_file_imports_torch_anywhere():
    found = {p.name: lines for p in sorted(CLI.glob("*.py")) if (lines := _torch_imports(p))}
    assert found == {}, f"cli modules importing torch (file: lines): {found}"


def test_the_ast_check_sees_an_import_inside_a_function(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    if True:\n        import torch.nn as nn\n    from torch import cat\n")
    assert _torch_imports(sample) == [3, 4]


def test_importing_every_cli_module_leaves_torch_unimported():
    modules = sorted(f"detjac.cli.{p.stem}" for p in CLI.glob("*.py") if p.stem != "__init__")
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

"""The command modules stay thin: from the CLI package they import only ``options`` and ``render``; only
``main`` imports the command modules (to register them)."""

from __future__ import annotations

import ast
from pathlib import Path

import detjac.cli

CLI = Path(detjac.cli.__file__).parent
SHARED = {"options", "render"}


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
    assert _cli_imports(CLI / "main.py") == commands | SHARED

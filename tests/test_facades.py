"""The lazy façades (analysis/, runs/, view/) declare under ``if TYPE_CHECKING:`` exactly the names their lazy map
exports, from the same module, so that type checkers and go-to-definition see what ``__getattr__`` gives at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _declared(tree: ast.Module) -> dict[str, str]:
    """name -> "module" or "module:attr" (the lazy map's spelling) of the imports under ``if TYPE_CHECKING:``."""
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    out = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        for alias in node.names:
            name = alias.asname or alias.name
            out[name] = node.module + ("" if alias.name == name else f":{alias.name}")
    return out


def _exports(tree: ast.Module) -> dict[str, str]:
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_EXPORTS")
    return ast.literal_eval(node.value)


@pytest.mark.parametrize("package", ["analysis", "runs", "view"])
def test_the_type_checking_block_declares_the_lazy_names(package: str) -> None:
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    exports = {k: v.removesuffix(f":{k}") for k, v in _exports(tree).items()}
    assert _declared(tree) == exports


@pytest.mark.parametrize("package", ["analysis", "runs", "view"])
def test_the_runtime_names_are_the_declared_objects(package: str) -> None:
    import importlib

    facade = importlib.import_module(f"detjac.{package}")
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    for name, target in _declared(tree).items():
        module, _, attr = target.partition(":")
        assert getattr(facade, name) is getattr(importlib.import_module(f"detjac.{package}.{module}"), attr or name)

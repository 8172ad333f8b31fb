"""Lazy façades: a layer's package exports its API by name and imports the module behind a name on first use, so
that importing the package stays cheap (the analyses pull in dask and matplotlib, runs/ pulls in torch).

A façade lists each name once, under its own name: the imports under its ``if TYPE_CHECKING:`` block, which type
checkers and go-to-definition read, are also the map :func:`lazy_exports` reads (with ``ast``, nothing imported)."""

from __future__ import annotations

import ast
import importlib
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def declared_exports(init_file: str | Path) -> dict[str, str]:
    """name -> the module (relative to the package) that defines it, from the ``from .module import name`` lines
    under the ``if TYPE_CHECKING:`` block of a package's ``__init__.py``.

    Raises
    ------
    ValueError
        The block is missing, or imports a name under another name (``import a as b``) or not relatively.
    """
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    block = next((node for node in tree.body if isinstance(node, ast.If)
                  and getattr(node.test, "id", None) == "TYPE_CHECKING"), None)
    if block is None:
        raise ValueError(f"Expected an `if TYPE_CHECKING:` block of the façade's names in {init_file}. Got none.")
    exports = {}
    for node in block.body:
        if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module):
            raise ValueError(f"Expected only `from .module import name` lines in {init_file}'s TYPE_CHECKING block. "
                             f"Got line {node.lineno}.")
        for alias in node.names:
            if alias.asname is not None:
                raise ValueError(f"Expected each name of {init_file} under its own name. Got {alias.name} as "
                                 f"{alias.asname} on line {node.lineno}.")
            exports[alias.name] = node.module
    return exports


def lazy_exports(package: str, init_file: str | Path, renamed: Mapping[str, str] | None = None
                 ) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` of the façade ``package`` whose ``__init__.py`` is ``init_file``: each name of
    :func:`declared_exports` from its module, imported when the name is first asked for. ``renamed`` maps former
    names to current ones: still given, with a DeprecationWarning the first time each is used."""
    exports = declared_exports(init_file)
    renamed = dict(renamed or {})
    warned: set[str] = set()

    def __getattr__(name: str) -> Any:
        if name in renamed:
            if name not in warned:
                warned.add(name)
                warnings.warn(f"{package}.{name} is now {renamed[name]}; the old name will be removed.",
                              DeprecationWarning, stacklevel=2)
            name = renamed[name]
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return sorted(exports), __getattr__

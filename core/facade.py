"""Lazy façades: a layer's package exports its API by name and imports the module behind a name on first use, so
that importing the package stays cheap (the analyses pull in dask and matplotlib, runs/ pulls in torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that gives each name of ``exports`` (name -> the module, relative to
    ``package``, that defines it; ``module:other`` where it is called ``other`` there) from that module, imported
    when the name is first asked for."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = exports[name].partition(":")
        return getattr(importlib.import_module(f"{package}.{module}"), attr or name)

    return __getattr__

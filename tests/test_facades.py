"""The lazy façades (analysis/, runs/, view/) list each name once, under its own name, in their ``if TYPE_CHECKING:``
block: type checkers and go-to-definition read it, and so does :func:`detjac.facade.lazy_exports` at run time."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from detjac.facade import declared_exports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["analysis", "runs", "view"]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_name_is_listed_once_under_its_own_name(package: str) -> None:
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    names = [alias for node in block.body for alias in node.names]  # type: ignore[attr-defined]
    assert all(alias.asname is None for alias in names)
    assert len({alias.name for alias in names}) == len(names)
    assert "_EXPORTS" not in (ROOT / package / "__init__.py").read_text()


@pytest.mark.parametrize("package", PACKAGES)
def test_the_runtime_names_are_the_declared_objects(package: str) -> None:
    import importlib

    facade = importlib.import_module(f"detjac.{package}")
    declared = declared_exports(ROOT / package / "__init__.py")
    assert facade.__all__ == sorted(declared)
    for name, module in declared.items():
        assert getattr(facade, name) is getattr(importlib.import_module(f"detjac.{package}.{module}"), name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        facade.nothing_here  # noqa: B018


def test_a_renamed_name_still_works_with_a_warning() -> None:
    import detjac.analysis as analysis

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert analysis.token_texts is analysis.piece_reader
    assert any("detjac.analysis.token_texts is now piece_reader" in str(w.message) for w in caught)


def test_an_alias_in_a_facade_is_refused(tmp_path: Path) -> None:
    init = tmp_path / "__init__.py"
    init.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .jobs import svd as prompt_svds\n")
    with pytest.raises(ValueError, match="under its own name. Got svd as prompt_svds"):
        declared_exports(init)

"""The documentation site builds from docs/ in strict mode: a broken link, a missing anchor or an API reference
to something that does not exist fails the build (mkdocs + mkdocstrings, the ``test`` extra)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def missing(modules: dict[str, str]) -> list[str]:
    """The distributions (values) whose modules (keys) cannot be imported."""
    out = []
    for module, distribution in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is absent
            found = False
        if not found:
            out.append(distribution)
    return out


MISSING = missing({"mkdocs": "mkdocs", "mkdocstrings": "mkdocstrings", "mkdocstrings_handlers.python":
                   "mkdocstrings-python", "mkdocs_jupyter": "mkdocs-jupyter", "material": "mkdocs-material"})
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"docs build skipped: {', '.join(MISSING)} not installed; "
                                                      "install with pip install -e '.[test]' (or make install)")


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict``; the notebooks are rendered as committed (tests/test_notebooks.py runs them)."""
    env = {**os.environ, "DETJAC_DOCS_EXECUTE": "false"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=root,
                          capture_output=True, text=True, timeout=600, env=env)


def test_docs_build_in_strict_mode(tmp_path: Path) -> None:
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "engine" / "index.html").read_text()
    assert "load_engine" in api and "hf download" in api  # rendered from the docstrings
    pages = ("user-guide", "store-format", "engine", "modules", "graphs", "performance", "results", "notebooks/tour",
             "notebooks/layers-and-steering")
    for page in pages:
        assert (tmp_path / "site" / page / "index.html").is_file()
    inventory = (tmp_path / "site" / "modules" / "index.html").read_text()
    unlisted = [name for name in module_names() if f"<code>{name}</code>" not in inventory]
    assert not unlisted, f"Expected the Modules page to list every module. Got these missing: {unlisted}"
    assert "The one error hierarchy of detjac." in inventory  # core/errors.py's docstring, read at build time


def module_names() -> list[str]:
    """Every module of the package as Python imports it, from pyproject.toml's package-dir (independent of the hook
    that writes the Modules page)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    names = []
    for package, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            names.append(".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return names


def test_a_broken_link_or_reference_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("mkdocs.yml", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "docs", copy / "docs")
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", copy / "scripts")
    for folder in ("core", "engine", "graphs", "store", "analysis", "runs", "cli"):
        (copy / folder).symlink_to(ROOT / folder)
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    result = build(copy, tmp_path / "site")
    assert result.returncode != 0 and "no-such-page.md" in result.stderr
    index.write_text(index.read_text().replace("[nowhere](no-such-page.md)", "nothing"))
    (copy / "docs" / "api" / "core.md").write_text("# x\n\n::: detjac.no_such_module\n")
    result = build(copy, tmp_path / "site2")
    assert result.returncode != 0 and "detjac.no_such_module" in result.stderr

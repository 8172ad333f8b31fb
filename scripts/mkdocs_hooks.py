"""mkdocs hook: lay the ``detjac`` package out as Python imports it, for the API reference, and list its modules.

The source folders are mapped to packages by setuptools ``package-dir`` (core/ -> detjac,
engine/ -> detjac.engine, ...), a layout griffe (mkdocstrings' reader) cannot follow. Before
the pages are rendered this hook builds ``build/docs-src/detjac``: symlinks to core/'s files and
to the other folders, read from pyproject.toml, so griffe reads the sources statically
(``paths: [build/docs-src]`` in mkdocs.yml). Nothing is imported.

It also adds the page ``modules.md`` to the site: every module of the package with the first paragraph of its
docstring, read from the sources as they are when the site is built (so the inventory cannot drift from the tree;
a module without a docstring is listed as such).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "docs-src"


def package_tree(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Build ``tree/detjac`` from pyproject.toml's package-dir mapping; returns ``tree``."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(tree, ignore_errors=True)
    top = tree / "detjac"
    top.mkdir(parents=True)
    for entry in (root / mapping["detjac"]).iterdir():  # the top package's own modules
        if entry.suffix == ".py":
            os.symlink(entry, top / entry.name)
    for package, folder in mapping.items():
        if package != "detjac":
            os.symlink(root / folder, tree / package.replace(".", "/"))
    return tree


@event_priority(100)  # before mkdocstrings reads its search paths
def on_config(config: Any) -> Any:
    package_tree()
    return config


MODULES_PAGE = "modules.md"
ROLE = re.compile(r":\w+:`~?([^`]+)`")  # a Sphinx role (:mod:`x`, :class:`~x.Y`) -> `x`


def _summary(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line, as markdown table text."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        return "*(no module docstring)*"
    text = " ".join(doc.split("\n\n")[0].split())
    text = ROLE.sub(r"`\1`", text).replace("``", "`").replace("|", "\\|")
    return text if len(text) <= 400 else text[:399].rsplit(" ", 1)[0] + " …"


def module_inventory(root: Path = ROOT) -> str:
    """The page of every module under pyproject.toml's package-dir folders, one table per package folder."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = ["# Modules", "",
           "Every module of the `detjac` package with the first paragraph of its docstring, generated from the source "
           "tree when this site is built. Which folder imports which, and the layers' order: "
           "[engine internals](engine.md#layout).", ""]
    for package, folder in mapping.items():
        base = root / folder
        if not base.is_dir():  # a partial copy of the tree (the docs test's broken-link build)
            continue
        files = sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)
        out += [f"## `{package}` (`{folder}/`)", "", "| module | what it holds |", "|---|---|"]
        for path in files:
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))
            out.append(f"| `{name}` | {_summary(path)} |")
        out.append("")
    return "\n".join(out)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, MODULES_PAGE, content=module_inventory()))
    return files


# Pages whose examples the build runs, putting each command's output, as produced, under it
# (tests/doc_examples.py; the test suite runs the same examples and builds with DETJAC_DOCS_EXECUTE=false).
EXECUTED_PAGES = ("user-guide.md", "lens.md")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if os.environ.get("DETJAC_DOCS_EXECUTE", "true").lower() == "false" or page.file.src_uri not in EXECUTED_PAGES:
        return markdown
    import subprocess
    import sys

    # run by the test suite's example runner, in its own process (a script imports no test module)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "doc_examples.py"), "--with-outputs",
                           f"docs/{page.file.src_uri}"], input=markdown, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"Expected the examples of docs/{page.file.src_uri} to run. Got exit status "
                           f"{done.returncode}:\n{done.stderr[-4000:]}")
    sys.stderr.write(done.stderr)
    return done.stdout

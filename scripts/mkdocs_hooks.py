"""mkdocs hook: lay the ``detjac`` package out as Python imports it, for the API reference.

The source folders are mapped to packages by setuptools ``package-dir`` (core/ -> detjac,
engine/ -> detjac.engine, ...), a layout griffe (mkdocstrings' reader) cannot follow. Before
the pages are rendered this hook builds ``build/docs-src/detjac``: symlinks to core/'s files and
to the other folders, read from pyproject.toml, so griffe reads the sources statically
(``paths: [build/docs-src]`` in mkdocs.yml). Nothing is imported.
"""

from __future__ import annotations

import os
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

"""The SHA-256 of detjac's package sources (the folders its wheel is built from, and pyproject.toml).

``scripts/gpu_wheels.sh`` writes it beside the detjac wheel it builds; ``scripts/gpu_install.sh`` compares it with
the working tree's before installing, so that a GPU run never measures a wheel built from other code."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

PACKAGE_DIRS = ("core", "engine", "graphs", "store", "analysis", "runs", "view", "cli")


def digest(root: Path) -> str:
    h = hashlib.sha256()
    files = [f for d in PACKAGE_DIRS for f in (root / d).rglob("*")
             if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"]
    for f in sorted([*files, root / "pyproject.toml"]):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", type=Path, nargs="?", default=Path(__file__).resolve().parent.parent,
                        help="the repository root (default: this checkout's)")
    print(digest(parser.parse_args().root))

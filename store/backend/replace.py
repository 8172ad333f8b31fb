"""A store replaced by ``--force-new`` is kept aside (``.NAME.replaced-<pid>-<random>``) until the new run holds a
prompt, and put back otherwise, also by the next writer after a kill (``docs/store-format.md``, "Replacing a
store").
"""

from __future__ import annotations

import os
from pathlib import Path

from detjac.aside import aside_pid, new_folder

from .. import format as fmt
from ..integrity import PROMPT_ID
from .disk import alive, discard_folder, fsync_dir


def replaced_name(path: Path) -> Path:
    """Where this process's ``--force-new`` keeps the store it replaces: a new, empty folder beside it under an
    unpredictable name (``.NAME.replaced-<pid>-<random>``), which the rename of the store replaces."""
    return new_folder(path, "replaced")


def has_prompts(path: Path) -> bool:
    """Whether the store folder ``path`` holds a committed prompt (what ``prompt_ids`` lists)."""
    folder = path / fmt.PROMPTS
    return folder.is_dir() and not folder.is_symlink() and any(
        PROMPT_ID.fullmatch(p.name) and (p / "zarr.json").is_file() for p in folder.iterdir())


def restore_or_drop(path: Path, aside: Path) -> bool:
    """Delete the replaced store ``aside`` if the store ``path`` holds a committed prompt; else put ``aside`` back
    under ``path`` (deleting the prompt-less new one). Returns True when the old store was put back."""
    if has_prompts(path):
        discard_folder(aside, path)
        return False
    if path.exists():
        discard_folder(path)
    os.rename(aside, path)
    fsync_dir(path.parent)
    return True


def settle_replaced(path: Path) -> list[Path]:
    """Settle the stores that ``--force-new`` runs of processes now gone kept aside beside ``path``
    (:func:`restore_or_drop`); returns those put back (at most one: the newest)."""
    restored = []
    asides = [p for p in path.parent.glob(f".{path.name}.replaced-*") if not p.is_symlink()]
    for aside in sorted(asides, key=lambda p: p.stat().st_mtime):
        pid = aside_pid(aside.name, path.name, ("replaced",))
        if pid is not None and not alive(pid) and restore_or_drop(path, aside):
            restored.append(aside)
    return restored[-1:]

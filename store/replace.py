"""A store replaced by ``--force-new`` is kept aside until the new run holds a prompt.

The old store is renamed ``.NAME.replaced-<pid>`` (never deleted first); when the new run's handle closes, the old
one is deleted if the new store holds a committed prompt, and put back under ``NAME`` otherwise (the new store,
prompt-less, goes). A run killed before that leaves the aside folder: the next writer of ``NAME`` settles it by the
same rule (:func:`settle_replaced`), so a failed replacement never loses the old store.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import format as fmt
from .disk import alive, fsync_dir


def replaced_name(path: Path, pid: int | None = None) -> Path:
    """Where ``--force-new`` keeps the store it replaces, for process ``pid`` (default: this one)."""
    return path.with_name(f".{path.name}.replaced-{pid if pid is not None else os.getpid()}")


def has_prompts(path: Path) -> bool:
    """Whether the store folder ``path`` holds a committed prompt."""
    folder = path / fmt.PROMPTS
    return folder.is_dir() and not folder.is_symlink() and any((p / "zarr.json").is_file() for p in folder.iterdir())


def _drop(path: Path, folder: Path) -> None:
    """Delete ``folder`` (beside the store ``path``) crash-safely: renamed ``.NAME.old-<pid>`` first, which a later
    writer clears if a kill comes before the deletion ends."""
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(folder, old)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def restore_or_drop(path: Path, aside: Path) -> bool:
    """Delete the replaced store ``aside`` if the store ``path`` holds a committed prompt; else put ``aside`` back
    under ``path`` (deleting the prompt-less new one). Returns True when the old store was put back."""
    if has_prompts(path):
        _drop(path, aside)
        return False
    if path.exists():
        _drop(path, path)
    os.rename(aside, path)
    fsync_dir(path.parent)
    return True


def settle_replaced(path: Path) -> list[Path]:
    """Settle the stores that ``--force-new`` runs of processes now gone kept aside beside ``path``
    (:func:`restore_or_drop`); returns those put back (at most one: the newest)."""
    restored = []
    asides = [p for p in path.parent.glob(f".{path.name}.replaced-*") if not p.is_symlink()]
    for aside in sorted(asides, key=lambda p: p.stat().st_mtime):
        pid = aside.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not alive(int(pid)) and restore_or_drop(path, aside):
            restored.append(aside)
    return restored[-1:]

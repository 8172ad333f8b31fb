"""A JSON file of entries by name that several processes update at once, each its own (a benchmark's results file,
one entry per model, each model measured in a process of its own).

A process reads the file once (:func:`load_entries`) and saves its entry as it goes (:func:`save_entry`): each save
merges only that entry, or one key of it, into the file as it is on disk at that moment, under an exclusive lock,
written aside and renamed (:mod:`detjac.aside`), so another process's entries survive and a kill leaves the previous
complete file. :func:`holding` lets one process at a time work on a name: two would each save their own copy of its
entry. Standard library only; the locks are POSIX ``flock`` locks on files beside the JSON file.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from detjac.outputs import write_output


def load_entries(path: str | Path) -> dict[str, Any]:
    """The file's entries by name ({} while there is no file)."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def save_entry(path: str | Path, entries: dict[str, Any], name: str, key: str | None = None) -> None:
    """``entries[name]`` (or only its ``key``) merged into the file at ``path`` as it is on disk now, under a lock;
    the other entries (and keys) stay as the file has them."""
    path = Path(path)
    with _flock(path.with_name(path.name + ".lock")):
        on_disk = load_entries(path)
        if key is None:
            on_disk[name] = entries[name]
        else:
            on_disk.setdefault(name, {})[key] = entries[name][key]
        text = json.dumps(on_disk, indent=1, ensure_ascii=False) + "\n"
        write_output(path, text)


@contextmanager
def holding(path: str | Path, name: str) -> Iterator[None]:
    """Hold ``name`` of the file at ``path`` for the block; a BlockingIOError at once when another process holds
    it."""
    path = Path(path)
    with _flock(path.with_name(f"{path.name}.{name}.lock"), wait=False) as held:
        if not held:
            raise BlockingIOError(f"another process is running {name} on {path}; wait for it, or run another one")
        yield


@contextmanager
def _flock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (created if absent) for the block; with ``wait=False`` yields False at
    once when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

"""File-system primitives of the directory backend: durable writes (temporary name, fsync, rename), crash-safe
removal, ``.npz`` files written aside, and ``OSError`` turned into a StoreError that says what failed and why
(:func:`disk_error`). Knows nothing of zarr.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from detjac.aside import aside_pid, fsync_dir, new_folder, reason_of
from detjac.errors import StoreError
from detjac.outputs import write_output


def disk_error(exc: OSError, what: str) -> StoreError:
    """The StoreError to raise when ``what`` (e.g. ``"commit prompt 3f2a..."``) failed with ``exc``.

    Parameters
    ----------
    exc : OSError
        The error the file system raised.
    what : str
        What was being done, as a verb phrase ("write prompt p").

    Returns
    -------
    StoreError
        "Could not <what>: <reason>. Nothing half-written is visible; ...", with the common
        errnos (disk full, quota, read-only, permissions) in words.
    """
    reason = reason_of(exc)
    return StoreError(f"Could not {what}: {reason}. Nothing half-written is visible; fix this and re-run to resume.")


@contextmanager
def disk_refusal(what: str, undo: Callable[[], None] | None = None) -> Iterator[None]:
    """Run the block; where the file system refuses it (``OSError``), run ``undo`` (remove what was half-written)
    and raise :func:`disk_error` saying ``what``.

    Parameters
    ----------
    what : str
        What the block does, as a verb phrase ("write prompt p").
    undo : callable or None
        Called before the error is raised, e.g. a writer's ``abort``.

    Raises
    ------
    StoreError
        From :func:`disk_error`, chained to the ``OSError``.
    """
    try:
        yield
    except OSError as exc:
        if undo is not None:
            undo()
        raise disk_error(exc, what) from exc


def fsync_tree(path: Path) -> None:
    """Flush every file and folder under ``path`` (so a rename publishes data that is on disk)."""
    for folder, _, files in os.walk(path):
        for name in files:
            fsync_dir(os.path.join(folder, name))
        fsync_dir(folder)


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def discard_folder(path: Path, store: Path | None = None) -> None:
    """Delete the folder ``path`` crash-safely: rename it aside (``.NAME.old-<pid>-<random>``, NAME the name of
    ``store``, by default ``path`` itself), then delete that.

    A kill between the two leaves the aside folder, which :func:`clear_aside` of that store removes later; never a
    half-deleted folder under the original name.
    """
    aside = new_folder(path.with_name((store or path).name), "old")  # new, empty: the rename replaces it
    try:
        os.rename(path, aside)
    except BaseException:
        aside.rmdir()
        raise
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def aside_entries(folder: Path, dead_only: bool = True) -> list[Path]:
    """What interrupted writes left in ``folder``: ``.NAME.tmp-<pid>`` and ``.NAME.old-<pid>`` entries (a group
    being written, one being replaced), of processes that are gone (``dead_only``) or any; never a symlink."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    return sorted(p for p in folder.iterdir() if (pid := aside_pid(p.name)) is not None and not p.is_symlink()
                  and not (dead_only and alive(pid)))


def clear_aside_in(folder: Path) -> None:
    """Remove what writers killed while writing in ``folder`` left there (see :func:`aside_entries`)."""
    for stale in aside_entries(folder):
        shutil.rmtree(stale, ignore_errors=True)


def clear_aside(path: Path) -> None:
    """Remove what killed writers left beside the store ``path``: ``.NAME.tmp-<pid>`` (a store being created) and
    ``.NAME.old-<pid>`` (one being replaced), for processes that are gone."""
    for stale in [*path.parent.glob(f".{path.name}.tmp-*"), *path.parent.glob(f".{path.name}.old-*")]:
        pid = aside_pid(stale.name, path.name)
        if pid is not None and not alive(pid) and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def npz_name(out: str | Path) -> Path:
    """The ``.npz`` file ``out`` names: numpy's rule, ``.npz`` added to a name without it."""
    path = Path(out)
    return path if path.suffix.lower() == ".npz" else path.with_name(path.name + ".npz")


def write_npz(path: Path, arrays: dict[str, Any], *, compressed: bool = False) -> Path:
    """Write ``arrays`` to the ``.npz`` file ``path`` beside it first, then rename it into place: a kill or a full
    disk leaves the previous file (or none), never a truncated one."""
    import numpy as np

    try:
        return write_output(path, lambda handle: (np.savez_compressed if compressed else np.savez)(handle, **arrays))
    except OSError as exc:  # a refusal of the file system, with nothing half-written left
        raise disk_error(exc, f"write {path}") from exc

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

from detjac.aside import aside_pid, fsync_dir, new_folder, reason_of, write_file
from detjac.errors import StoreError


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


def npz_target(out: str | Path, force: bool) -> Path:
    """The ``.npz`` file ``out`` names (numpy adds ``.npz`` to a name without it), checked before any work: its
    folder exists, and it is new, or an existing regular file replaced only with ``force`` (never a folder or a
    link). InvalidArgumentError otherwise."""
    from detjac.errors import InvalidArgumentError

    path = Path(out)
    path = path if path.suffix.lower() == ".npz" else path.with_name(path.name + ".npz")
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"Expected an existing folder for {path}. Got none at {path.parent}.")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise InvalidArgumentError(f"Expected a new .npz file or an existing one to replace. Got {path}, which is "
                                   f"{'a link' if path.is_symlink() else 'not a file'}; nothing was written.")
    if path.exists() and not force:
        raise InvalidArgumentError(f"Expected a new file. Got {path}, which exists (--force replaces it).")
    return path


def json_target(out: str | Path, force: bool) -> Path:
    """The ``.json`` file ``out``, checked before any work as :func:`npz_target` checks a ``.npz`` file."""
    from detjac.errors import InvalidArgumentError

    path = Path(out)
    if path.suffix.lower() != ".json":
        raise InvalidArgumentError(f"Expected a .json file. Got {path}.")
    if not path.parent.is_dir():
        raise InvalidArgumentError(f"Expected an existing folder for {path}. Got none at {path.parent}.")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise InvalidArgumentError(f"Expected a new .json file or an existing one to replace. Got {path}, which is "
                                   f"{'a link' if path.is_symlink() else 'not a file'}; nothing was written.")
    if path.exists() and not force:
        raise InvalidArgumentError(f"Expected a new file. Got {path}, which exists (--force replaces it).")
    return path


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` beside it first, then rename it into place (as :func:`write_npz`)."""
    return _write_aside(path, "w", lambda handle: handle.write(text))


def write_npz(path: Path, arrays: dict[str, Any], *, compressed: bool = False) -> Path:
    """Write ``arrays`` to the ``.npz`` file ``path`` beside it first, then rename it into place: a kill or a full
    disk leaves the previous file (or none), never a truncated one."""
    import numpy as np

    return _write_aside(path, "wb", lambda handle: (np.savez_compressed if compressed else np.savez)(handle, **arrays))


def _write_aside(path: Path, mode: str, write: Callable[[Any], Any]) -> Path:
    """``write`` an open handle of a file beside ``path`` (a new file under an unpredictable name,
    :func:`detjac.aside.write_file`), synced, then renamed into place; a refusal of the file system is a
    :func:`disk_error`, and nothing half-written stays."""
    try:
        return write_file(path, write, mode)
    except OSError as exc:
        raise disk_error(exc, f"write {path}") from exc

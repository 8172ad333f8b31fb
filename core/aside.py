"""Files and folders written beside their destination under an unpredictable name, then renamed into place.

The one home of detjac's temporary names (torch-free, dependency-free). A temporary entry is always created new and
exclusively (``mkstemp`` / ``mkdtemp`` in the destination's folder): a name another user could guess and plant a
symbolic link at would make a write follow that link and overwrite whatever it points to. Names keep the writer's
process id, ``.NAME.tmp-<pid>-<random>`` (``old`` for an entry being replaced), so what a killed writer left is
recognised and removed later (:func:`aside_pid`); the random part makes the name unpredictable. The final rename
replaces a link at the destination itself and never writes through it.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
            errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied"}

KINDS = ("tmp", "old")  # what :func:`aside_pid` recognises by default: entries being written, or being replaced


def reason_of(exc: OSError) -> str:
    """Why the file system refused a write, in words for the common errnos (disk full, quota, read-only, permission
    denied), else the error's own text."""
    return _REASONS.get(exc.errno or 0, exc.strerror or str(exc))


def aside_prefix(path: Path, kind: str = "tmp") -> str:
    """The start of the temporary names of ``path``, ``.NAME.<kind>-<pid>-`` (``kind`` is ``tmp`` or ``old``)."""
    return f".{path.name}.{kind}-{os.getpid()}-"


def aside_pid(name: str, of: str | None = None, kinds: tuple[str, ...] = KINDS) -> int | None:
    """The process id in the temporary name ``name`` (``.NAME.<kind>-<pid>[-<random>]``, ``kind`` one of
    ``kinds``), None when ``name`` is not one (or is one of another destination than ``of``)."""
    match = re.fullmatch(rf"\.(?P<name>.+)\.(?:{'|'.join(map(re.escape, kinds))})-(?P<pid>[0-9]+)(?:-[A-Za-z0-9_]+)?",
                         name)
    if match is None or (of is not None and match["name"] != of):
        return None
    return int(match["pid"])


def fsync_dir(path: str | Path) -> None:
    """Flush one file or folder to disk (for a folder: its entries, e.g. a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; 0o022 where that is not there)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_file(path: str | Path, write: Callable[[Any], Any], mode: str = "wb") -> Path:
    """``write`` an open handle of a new file beside ``path``, synced, then renamed onto ``path``.

    Parameters
    ----------
    path : str or Path
        The destination file; its folder must exist. A link there is replaced, never written through.
    write : callable
        Called with the open handle (binary for ``mode="wb"``, UTF-8 text for ``"w"``).
    mode : str
        ``"wb"`` or ``"w"``.

    Returns
    -------
    Path
        ``path``. Raises what ``write`` or the file system raises, with the temporary file removed.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=aside_prefix(path), suffix="")
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would have made it (mkstemp makes it the owner's only)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": ""})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def new_folder(path: str | Path, kind: str = "tmp") -> Path:
    """A new, empty folder beside ``path`` under an unpredictable name (``.NAME.<kind>-<pid>-<random>``), created
    exclusively; renaming a folder onto it (``os.rename``) replaces it."""
    path = Path(path)
    folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=aside_prefix(path, kind)))
    os.chmod(folder, 0o777 & ~_umask())  # as mkdir() would have made it (mkdtemp makes it the owner's only)
    return folder


def keep_elsewhere(path: str | Path, data: bytes) -> Path | None:
    """Keep ``data``, which could not be written to ``path``, in a new file of the system's temporary folder (named
    after ``path``); None where that fails too. For results that took long to compute (a graph)."""
    try:
        fd, name = tempfile.mkstemp(prefix="detjac-kept-", suffix=f"-{Path(path).name}")
    except OSError:
        return None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    except OSError:
        Path(name).unlink(missing_ok=True)
        return None
    return Path(name)

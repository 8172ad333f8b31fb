"""The one check of every path detjac writes to, and the one atomic writer of its files and folders. Torch-free.

:func:`check_output` is called by every command that writes (before its work, so that a refusal costs nothing) and by
the library function that writes (so that Python callers get the same rules). It refuses, in one line and before
anything is written, as an :class:`~detjac.errors.InvalidArgumentError`:

- a target equal to, inside, or containing a path the command reads (a store, an index, a graph, a corpus, a
  model): writing there would change or delete what is being read;
- a target inside any zarr hierarchy (a folder above it holds ``zarr.json``): detjac stores, neuron indexes and saved
  lenses are zarr groups, and a file written into one makes it read as damaged (``detjac store verify``), or
  refuse to open. It is recognised on disk, so a store the command does not read is covered too;
- a missing parent folder: never created, for files and folders alike (a typo in a folder name is an error, not a
  new tree of folders);
- a link at the target itself: never followed and never replaced, for files, folders and stores alike. Links in
  the folders above the target are resolved first and the resolved path is what is checked, so a link cannot carry
  an output into a store;
- for a file: a name without the kind's suffix, an existing entry that is not a regular file, and an existing file
  without ``force``; for a folder: an existing entry that is not an empty folder without ``force`` (what ``force``
  may then replace is the caller's rule). A store or index target may exist: its own code creates or resumes it.

What passes is written by :func:`write_output` (a file) or :func:`write_folder` (a folder): the content goes to a
new entry under an unpredictable name beside the target (:mod:`detjac.aside`), is flushed, then renamed into place,
so a kill or a full disk leaves the previous content (or none), never a half-written one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from .aside import new_folder, write_file
from .errors import InvalidArgumentError

FILE, FOLDER, STORE = "file", "folder", "store"  # what an output is: a new file, a new folder, a store or index
KINDS = (FILE, FOLDER, STORE)
ZARR_MARK = "zarr.json"  # every zarr v3 group (a detjac store, a neuron index, a saved lens) holds one

T = TypeVar("T")


def check_output(out: str | os.PathLike[str], *, force: bool = False, kind: str = FILE, suffix: str | None = None,
                 reads: Iterable[tuple[str, str | os.PathLike[str]]] = ()) -> Path:
    """``out`` as a Path if the command may write there, checked before anything is written.

    Parameters
    ----------
    out : str or path
        The target, as the user gave it.
    force : bool
        Whether an existing file (or, for a folder, an existing non-empty one) may be replaced.
    kind : str
        ``"file"`` (a new file), ``"folder"`` (a new or empty folder) or ``"store"`` (a store or index folder,
        created or resumed by its own code).
    suffix : str, optional
        For a file: the ending its name must have (``".json"``, ``".npz"``), compared case-insensitively.
    reads : iterable of (str, path)
        What the command reads, each as (what it is, its path): ``("the store", "run.zarr")``.

    Returns
    -------
    Path
        ``out``, unchanged (messages and writes use the name the user gave).

    Raises
    ------
    InvalidArgumentError
        One of the refusals of the module's docstring, in one line saying what was expected and what was got.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")  # a caller's bug, not user input
    path = Path(out)
    if kind == FILE and suffix is not None and not path.name.lower().endswith(suffix.lower()):
        raise InvalidArgumentError(f"Expected a path ending in {suffix}. Got {str(out)!r}.")
    parent = path.absolute().parent
    real = parent.resolve() / path.name  # the folders above resolved: what the write will really reach
    for what, read in reads:
        _refuse_overlap(path, real, what, Path(read))
    root = zarr_root(real.parent)
    if root is not None:
        raise InvalidArgumentError(f"Expected an output outside any detjac store, neuron index or lens. Got {path}, "
                                   f"inside {root} (a zarr group: a file written there damages it); nothing was "
                                   "written.")
    if path.is_symlink():
        raise InvalidArgumentError(f"Expected a new {_noun(kind, suffix)} or an existing one. Got {path}, which is a "
                                   "link (links are never followed or replaced); nothing was written.")
    if not parent.is_dir():
        got = "a file" if parent.exists() else "none"
        raise InvalidArgumentError(f"Expected an existing folder for {path}. Got {got} at {parent}.")
    _refuse_existing(path, kind, suffix, force)
    return path


def zarr_root(folder: str | os.PathLike[str]) -> Path | None:
    """The outermost folder of ``folder`` and those above it that holds a ``zarr.json`` (the root of the zarr
    hierarchy ``folder`` lies in), None when none does."""
    found = None
    for above in (Path(folder), *Path(folder).parents):
        if (above / ZARR_MARK).exists():
            found = above
    return found


def _noun(kind: str, suffix: str | None) -> str:
    return {FILE: f"{suffix} file" if suffix else "file", FOLDER: "folder", STORE: "store or index folder"}[kind]


def _refuse_overlap(path: Path, real: Path, what: str, read: Path) -> None:
    """Refuse ``real`` (``path`` resolved) equal to, inside, or holding ``read``, which the command reads."""
    read = read.resolve()
    if real == read or read in real.parents:
        where = "is" if real == read else "is inside"
        raise InvalidArgumentError(f"Expected an output outside {what} {read}, which this command reads. Got {path}, "
                                   f"which {where} it; nothing was written.")
    if real in read.parents:
        raise InvalidArgumentError(f"Expected an output outside {what} {read}, which this command reads. Got {path}, "
                                   "which holds it; nothing was written.")


def _refuse_existing(path: Path, kind: str, suffix: str | None, force: bool) -> None:
    """Refuse what exists at ``path`` that a write of this kind must not replace."""
    if not path.exists() or kind == STORE:
        return
    if kind == FILE:
        if not path.is_file():
            what = "a folder" if path.is_dir() else "something that is not a regular file"
            raise InvalidArgumentError(f"Expected a new {_noun(kind, suffix)} or an existing one to replace. Got "
                                       f"{what} at {path}; nothing was written.")
        if not force:
            raise InvalidArgumentError(f"Expected a new file. Got {path}, which exists (--force replaces it).")
        return
    if not path.is_dir():
        raise InvalidArgumentError(f"Expected a new or empty folder. Got {path}, which is a file; nothing was "
                                   "written.")
    if not force and any(path.iterdir()):
        raise InvalidArgumentError(f"Expected a new or empty folder. Got {path}, which is not empty.")


def write_output(path: str | os.PathLike[str], content: str | bytes | Callable[[Any], Any]) -> Path:
    """Write ``content`` to the file ``path`` atomically: to a new file beside it, flushed, then renamed into place.

    Parameters
    ----------
    path : str or path
        The file, in an existing folder (:func:`check_output` has checked it).
    content : str, bytes or callable
        Text (written as UTF-8), bytes, or a function given the open binary handle (``numpy.savez``, ``torch.save``).

    Returns
    -------
    Path
        ``path``. Raises what the file system (or ``content``) raises, with nothing half-written left.
    """
    if isinstance(content, str):
        data = content.encode("utf-8")
        return write_file(path, lambda handle: handle.write(data))
    if isinstance(content, bytes):
        return write_file(path, lambda handle: handle.write(content))
    return write_file(path, content)


def write_folder(path: str | os.PathLike[str], fill: Callable[[Path], T]) -> T:
    """Fill a new folder beside ``path`` (``fill(folder)``, returning what it returns), then rename it onto
    ``path``, which must be absent or an empty folder: a reader never sees a half-written folder at ``path``.
    Raises what ``fill`` or the file system raises, with the new folder removed."""
    path = Path(path)
    tmp = new_folder(path)  # new, under an unpredictable name: never a link planted there
    try:
        result = fill(tmp)
        if path.is_dir() and not path.is_symlink():
            path.rmdir()  # empty (checked by check_output); rmdir fails rather than delete anything
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result

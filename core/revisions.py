"""Revisions of a Hugging Face repository as the local cache holds them (torch-free): the one home of what a revision
may be and of the commit it names, so that neither a revision nor a ``refs`` file leads outside the cache.

The cache keeps ``models--org--name/refs/<revision>`` (a file holding a commit hash) and
``snapshots/<commit>/<file>``; a revision ``../../../outside``, or a refs file holding ``../../../outside``, would
otherwise be joined into a path outside it (huggingface_hub joins both unchecked when it reads the cache offline).
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import CheckpointError, InvalidArgumentError

REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")  # a branch, tag or commit, as the hub names them
COMMIT = re.compile(r"[0-9a-f]{40}")  # what refs/<revision> holds, and what names a snapshot


def check_revision(repo_id: str, revision: str) -> str:
    """``revision`` if it is a branch, tag or commit name (letters, digits, ``._-/``, no ``..`` component);
    InvalidArgumentError otherwise."""
    if not isinstance(revision, str) or not REVISION.fullmatch(revision) or ".." in revision.split("/"):
        raise InvalidArgumentError(f"Expected a revision of {repo_id} (a branch, tag or commit: letters, digits, "
                                   f"'._-/', no '..'). Got {revision!r}.")
    return revision


def cached_commit(repo: Path, repo_id: str, revision: str) -> str | None:
    """The commit ``revision`` names in the cached repository folder ``repo``: its ``refs`` file's content, or the
    revision itself when it is a commit hash; None when the cache has neither.

    Raises
    ------
    InvalidArgumentError
        ``revision`` is not a name (:func:`check_revision`).
    CheckpointError
        Its refs file holds anything but a commit hash (40 hexadecimal digits).
    """
    ref = repo / "refs" / check_revision(repo_id, revision)
    if ref.is_file() and not ref.is_symlink():
        commit = ref.read_text(errors="replace").strip()[:100]
        if not COMMIT.fullmatch(commit):
            raise CheckpointError(f"Expected a commit hash (40 hexadecimal digits) in {ref}. Got {commit!r}.")
        return commit
    if ref.is_symlink():
        raise CheckpointError(f"Expected a refs file in the Hugging Face cache at {ref}. Got a link; nothing was read.")
    return revision if COMMIT.fullmatch(revision) else None


def check_inside(path: Path, repo: Path, what: str) -> Path:
    """``path`` if it resolves inside the cached repository folder ``repo`` (a snapshot's links lead to its
    ``blobs``); CheckpointError otherwise."""
    if not Path(path).resolve().is_relative_to(repo.resolve()):
        raise CheckpointError(f"Expected {what} inside its folder of the Hugging Face cache {repo}. Got a link to "
                              f"{Path(path).resolve()}; nothing was read.")
    return path

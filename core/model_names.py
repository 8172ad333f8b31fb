"""What a MODEL argument names, decided in one place and without torch: the shipped model (``default``), a GGUF file,
a checkpoint folder, or a Hugging Face hub id (``org/name``).

:func:`model_kind` is asked once per MODEL, by :meth:`detjac.engine.ModelRef.resolve` (and, before anything heavy is
imported, by the CLI's MODEL argument, so that a mistyped path is refused in a fraction of a second); everything below
takes the resulting :class:`~detjac.engine.ModelRef` and never asks again."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import CheckpointError

DEFAULT_MODEL_NAME = "default"
GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"
KINDS = ("default", "gguf", "folder", "hub")  # what a MODEL can name

# A repository id as the hub accepts it: one namespace, one name, neither starting with '.' or '-'.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def is_hub_id(source: object) -> bool:
    """Whether ``source`` names a Hub repository rather than a local folder: ``org/name``, not a path that exists."""
    if not isinstance(source, str) or not _HUB_ID.fullmatch(source):
        return False
    if ".." in source or "--" in source or source.endswith(".git"):
        return False
    return not Path(source).exists()


def is_gguf(source: Any) -> bool:
    """Whether ``source`` names a GGUF file: a path ending in ``.gguf``, or an existing file that starts with the
    GGUF magic bytes."""
    if not isinstance(source, str | Path):
        return False
    path = Path(source).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def looks_like_gguf(source: Any) -> bool:
    """Whether ``source``'s suffix looks like a mistyped ``.gguf`` (``.ggfu``, ``.guf``, ``.gguff``): one letter
    changed, added, dropped or two swapped, or made of g, u and f alone. For messages: such a name meant a file."""
    if not isinstance(source, str | Path):
        return False
    suffix = Path(source).suffix.lower().lstrip(".")
    return bool(suffix) and (_edits(suffix, GGUF_SUFFIX[1:]) <= 1 or set(suffix) == set("guf"))


def _edits(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) that turn ``a`` into ``b``."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def missing_gguf(path: Path) -> CheckpointError:
    """The error for a GGUF file that is not there, naming the GGUF files its folder holds."""
    found = sorted(p.name for p in path.parent.glob("*.gguf")) if path.parent.is_dir() else []
    return CheckpointError(f"Expected a GGUF file at {path}. Got no such file"
                           + (f" (the folder holds {', '.join(found[:5])})." if found else "."))


def model_kind(model: str | Path, gguf_file: str | None = None) -> str:
    """What ``model`` names, one of :data:`KINDS`: ``default`` (unless a folder of that name exists), a ``gguf`` file,
    a checkpoint ``folder``, or a ``hub`` id; with ``gguf_file`` (``--gguf-file``), the folder or hub id holding it.
    Only names are read here (and a GGUF's first four bytes): the folder's contents are checked where it is loaded.

    Raises
    ------
    CheckpointError
        A path that does not exist (a mistyped ``.gguf`` named as such), a file that is not a GGUF, or with
        ``gguf_file`` a MODEL that is neither a folder nor a hub id.
    """
    text, path = str(model), Path(model).expanduser()
    if gguf_file is not None:
        if is_hub_id(text) or path.is_dir():
            return "hub" if is_hub_id(text) else "folder"
        raise CheckpointError(f"Expected a folder (or hub id) holding {gguf_file} with --gguf-file. Got {text!r}, "
                              "which is not a folder.")
    if text == DEFAULT_MODEL_NAME and not path.exists():
        return "default"
    if is_gguf(path):
        if not path.is_file():
            raise missing_gguf(path)
        return "gguf"
    if is_hub_id(text):
        return "hub"
    if path.is_dir():
        return "folder"
    if not path.exists():
        if looks_like_gguf(path):  # a mistyped .gguf: the user meant a file
            raise CheckpointError(f"Expected a GGUF file (*.gguf), a Hugging Face checkpoint directory or a hub id "
                                  f"(org/name). Got {text!r}, which does not exist (a GGUF file's name ends in .gguf).")
        raise CheckpointError(f"Expected a Hugging Face checkpoint directory or a hub id (org/name). Got {text!r}, "
                              "which does not exist.")
    raise CheckpointError(f"Expected a Hugging Face checkpoint directory or a GGUF file (*.gguf). Got {text!r}, which "
                          "is a file but not a GGUF.")

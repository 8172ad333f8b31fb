"""Sealed groups written whole and replaced atomically (analysis results, lens groups): built as
``.<name>.tmp-<pid>-<random>`` (``detjac.aside``), sealed, flushed and renamed into place; read back only if every
file matches its seal
(``docs/store-format.md``, "Integrity"). Nothing here imports torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from ..integrity import INTEGRITY, CorruptError, check_name, check_seal, read_attrs, refuse_links, seal
from .claimed import check_claimed
from .disk import clear_aside_in, disk_refusal, fsync_tree, new_folder


def write_sealed(folder: Path, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any], what: str,
                 dims: dict[str, tuple[str, ...]] | None = None) -> Path:
    """Write the group ``folder/name`` (``folder`` an existing zarr group) with ``arrays`` and ``attrs``, sealed.

    Parameters
    ----------
    folder : Path
        The parent group's folder (inside a store: reached through :func:`refuse_links`).
    name : str
        The group's name (checked: letters, digits, ``_ . -``).
    arrays : dict
        Arrays by name (each name checked), written as one chunk each with the store's codecs.
    attrs : dict
        The group's attributes (JSON); ``written_at`` is added.
    what : str
        What is written, for error messages ("write analysis svd of prompt 3f2a...").
    dims : dict or None
        Dimension names of some arrays (zarr v3 ``dimension_names``).

    Returns
    -------
    Path
        The group's folder. Raises StoreError (disk full, read-only, ...) with nothing half-written visible.
    """
    import zarr

    check_name(name, "a group name")
    final = refuse_links(folder, name)
    clear_aside_in(folder)  # what killed writes left here (their processes are gone)
    with disk_refusal(what):
        tmp = new_folder(final)  # new, under an unpredictable name: never a link planted there
    with disk_refusal(what, lambda: shutil.rmtree(tmp, ignore_errors=True)):
        group = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        for key, values in arrays.items():
            fmt.put_array(group, check_name(key, "an array name"), values, (dims or {}).get(key))
        group.attrs.update({**attrs, "written_at": fmt.now()})
        group.attrs.update({INTEGRITY: seal(tmp, read_attrs(tmp))})
        fsync_tree(tmp)
        old = None
        if final.exists():
            old = new_folder(final, "old")
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_sealed(path: Path, what: str, *, sealed: bool = True, arrays: bool = True,
                hint: str = "Re-run the analysis to replace it."
                ) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """(arrays, attrs) of the sealed group at ``path`` (its seal left out of ``attrs``), or None when absent.

    With ``sealed`` the seal is checked, every file's SHA-256 included (CorruptError otherwise); without
    (format-1 stores) absent chunks read as zeros. ``arrays=False`` reads the attributes only: their own SHA-256
    and the files' names and sizes are checked, the files' contents when the arrays are read.
    """
    from .strict import open_group, sparse_any

    if not (path / "zarr.json").is_file():
        return None
    try:
        attrs = read_attrs(path)
        if sealed:
            check_seal(path, attrs, hashes=arrays)
    except CorruptError as exc:
        raise CorruptError(f"Expected an intact {what}. Got a damaged one: {exc}. {hint}") from exc
    attrs.pop(INTEGRITY, None)
    if not arrays:
        return {}, attrs
    try:
        check_claimed(path, what)  # read whole: what the arrays' metadata claims must agree and fit, first
    except CorruptError as exc:
        raise CorruptError(f"Expected an intact {what}. Got a damaged one: {exc}. {hint}") from exc
    group = open_group(path, what, None if sealed else sparse_any)
    try:
        return {key: group[key][...] for key in group.array_keys()}, attrs
    except ValueError as exc:  # a chunk of another length than its array's metadata says (resealed)
        raise CorruptError(f"Expected an intact {what}. Got a damaged one: a chunk that does not decode to its "
                           f"array's shape ({exc}). {hint}") from exc


def remove_sealed(folder: Path, name: str) -> None:
    """Remove the group ``folder/name`` crash-safely (renamed aside, then deleted); nothing if absent."""
    final = refuse_links(folder, check_name(name, "a group name"))
    if not final.exists():
        return
    with disk_refusal(f"remove {final}"):
        aside = new_folder(final, "old")
        os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)

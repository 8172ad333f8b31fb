"""The zarr backend, creating a store: built as ``.NAME.tmp-<pid>-<random>`` and renamed into place; ``--force-new``
keeps the old store aside until the new one holds a prompt (:mod:`.replace`); deletions rename aside first
(``docs/store-format.md``, "Replacing a store").
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from detjac.errors import StoreError, StoreMismatchError

from .. import format as fmt
from ..integrity import file_digest
from ..location import store_path
from . import lock
from .disk import clear_aside, discard_folder, disk_error, fsync_dir, fsync_tree, new_folder
from .replace import replaced_name, restore_or_drop, settle_replaced
from .zarr_store import ZarrStore

MODEL_ROWS = 8192  # rows of a model matrix per chunk, and per block read from the model while copying it in


def _write_rows(group: Any, name: str, values: Any) -> str:
    """Copy a matrix into ``group`` one row block at a time (``values``: a numpy array, or anything with ``shape``,
    ``dtype`` and row slices, such as an engine's row reader), so a vocabulary-sized matrix is never held whole;
    returns the SHA-256 of its row-major bytes."""
    shape = tuple(values.shape)
    if not shape:
        raise StoreError(f"Expected a model matrix with rows for {name!r}. Got a scalar.")
    block = max(1, min(MODEL_ROWS, shape[0]))
    arr = fmt.new_array(group, name, shape, values.dtype, fmt.DIMENSIONS[name], chunks=(block, *shape[1:]))
    digest = hashlib.sha256()
    for start in range(0, shape[0], block):
        stop = min(start + block, shape[0])
        part = np.ascontiguousarray(values[start:stop], dtype=arr.dtype)
        if part.shape != (stop - start, *shape[1:]):
            raise StoreError(f"Expected rows {start}:{stop} of {name!r} with shape {(stop - start, *shape[1:])}. "
                             f"Got {part.shape}.")
        arr[start:stop] = part
        digest.update(part.tobytes())
    return digest.hexdigest()


def _write_model(root: Any, arrays: dict[str, Any], files: dict[str, bytes]) -> dict[str, str]:
    """Model matrices (for decoding without the model) and small files, as arrays; returns their SHA-256s."""
    group = root.create_group(fmt.MODEL)
    digests = {}
    for name, values in arrays.items():
        digests[name] = _write_rows(group, name, values)
    for name, data in files.items():
        array = fmt.MODEL_FILES.get(name)
        if array is None:
            raise StoreError(f"Expected model files among {', '.join(fmt.MODEL_FILES)}. Got {name!r}.")
        fmt.put_array(group, array, np.frombuffer(data, dtype=np.uint8), fmt.DIMENSIONS[array],
                      chunks=(max(1, min(len(data), 1 << 22)),)).attrs["file"] = name
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def metadata_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of each array's ``zarr.json`` in the group ``folder`` (the model group), by path relative to it."""
    return {f"{p.parent.name}/zarr.json": file_digest(p) for p in sorted(folder.glob("*/zarr.json"))}


def _new_store(path: Path, run: dict[str, Any], arrays: dict[str, Any] | None = None,
               files: dict[str, bytes] | None = None) -> None:
    """Create the store under a temporary name and rename it into place."""
    import zarr

    try:
        tmp = new_folder(path)  # new, under an unpredictable name: never a link planted there
    except OSError as exc:
        raise disk_error(exc, f"create the store {path}") from exc
    try:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        root.create_group(fmt.PROMPTS)
        root.create_group(fmt.WRITER)  # its zarr.json is the writer lock (lock.py)
        digests = _write_model(root, arrays or {}, files or {})
        root.attrs[fmt.ROOT_KEY] = fmt.sealed_root(run, digests, metadata_digests(tmp / fmt.MODEL))
        fsync_tree(tmp)
        os.rename(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(exc, f"create the store {path}") from exc
    except BaseException:  # the model's matrices are read while they are copied in: a failed read leaves nothing
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _half_deleted(path: Path) -> bool:
    """A folder without a root ``zarr.json`` whose entries are all a store's: a store an older detjac was deleting."""
    names = {p.name for p in path.iterdir()}
    return bool(names) and "zarr.json" not in names and names <= fmt.STORE_ENTRIES and fmt.PROMPTS in names


def create_store(path: str | os.PathLike[str], run: dict[str, Any], *, force_new: bool = False,
                 model_data: Callable[[], tuple[dict[str, Any], dict[str, bytes]]] | None = None) -> ZarrStore:
    """Open ``path`` for writing: create it, or resume it if it holds the same run.

    When a new store is created, ``model_data()`` is called for the arrays (``embedding``
    (vocab, col), ``unembedding`` (vocab, row): numpy arrays or row readers, copied in row
    blocks) and files (e.g. ``tokenizer.json``) kept under ``model/``, so that analyses can
    decode singular vectors without the model; a resumed store already has them, and the call
    is skipped.

    Raises StoreMismatchError if the store was written for another model or settings, or in
    an older format (unless ``force_new``, which replaces it: renamed aside, then deleted),
    StoreFormatError if ``path`` is not a detjac store, StoreError if it cannot be written or
    another writer holds it.
    """
    path = store_path(path)
    if path.is_symlink():
        path = path.resolve()  # a link to the store folder names the store; links inside it are refused
    restored: list[Path] = []
    if path.parent.is_dir():
        clear_aside(path)
        restored = settle_replaced(path)  # a killed --force-new run's old store is back unless the new one has prompts
    replaced = None
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        if force_new and path.is_dir() and _half_deleted(path):
            discard_folder(path)
        else:
            replaced = _replace_or_resume(path, run, force_new)
    elif path.exists():
        path.rmdir()  # an empty folder: replace it with the new store
    try:
        store = _open_for_writing(path, run, model_data, replaced)
    except BaseException:
        if replaced is not None:  # the new store could not be made: the old one goes back
            restore_or_drop(path, replaced)
        raise
    store.restored_earlier = restored[0] if restored else None
    return store


def _open_for_writing(path: Path, run: dict[str, Any], model_data: Callable[[], tuple[dict[str, Any],
                      dict[str, bytes]]] | None, replaced: Path | None) -> ZarrStore:
    """Create the store ``path`` if it is not there, then take its writer lock."""
    fresh = not path.exists()
    if fresh:
        if not path.parent.is_dir():
            raise StoreError(f"Expected an existing parent folder for the store {path}. Got none at {path.parent}.")
        if not os.access(path.parent, os.W_OK):
            raise StoreError(f"Could not create the store {path}: {path.parent} is not writable.")
        _new_store(path, run, *(model_data() if model_data is not None else ({}, {})))
    if not os.access(path, os.W_OK):
        raise StoreError(f"Could not write to the store {path}: it is read-only.")
    handle = lock.acquire(path)
    try:
        store = ZarrStore(path, fmt.read_root(path), handle, fresh=fresh, replaced=replaced)
        shutil.rmtree(path / fmt.STAGING, ignore_errors=True)  # leftovers of crashed runs: partial prompts are redone
    except BaseException:
        lock.release(handle)
        raise
    return store


def _replace_or_resume(path: Path, run: dict[str, Any], force_new: bool) -> Path | None:
    """Leave a store of the same run in place (it is resumed); replace another one if ``force_new`` (renamed aside:
    returns where), else refuse."""
    root = fmt.read_root(path)
    differences = fmt.mismatches(root.get("run", {}), run)
    if root["format_version"] < fmt.FORMAT_VERSION:
        differences.append(f"format_version: {root['format_version']} (store) != {fmt.FORMAT_VERSION}: stores of an "
                           "older format are read, not extended")
    if differences and not force_new:
        raise StoreMismatchError(f"Expected the store {path} to hold the same run. Got differences: "
                                 + "; ".join(differences) + ". Use --force-new to replace it, or another --out.")
    if differences:
        held = lock.acquire(path)  # refuse to replace a store that another writer is using
        try:
            aside = replaced_name(path)
            try:
                os.rename(path, aside)  # kept until the new run holds a prompt (store/backend/replace.py)
            except BaseException:
                aside.rmdir()
                raise
            fsync_dir(path.parent)
        finally:
            lock.release(held)
        return aside
    return None

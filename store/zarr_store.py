"""The zarr v3 directory backend: one folder per store, one group per prompt.

Crash safety comes from the file system: a prompt is written into ``_staging/<id>.<attempt>``
and renamed into ``prompts/<id>`` only after every chunk and its attributes are on disk
(``os.rename`` of a directory is atomic on POSIX), so readers, who only list ``prompts/``,
see it complete or not at all. The store itself is created under a temporary name and
renamed into place. One run at a time holds the writer lock (``lock.py``); it clears staging
leftovers of crashed runs when it starts. Reading a prompt lives in ``zarr_prompt.py``,
writing one in ``zarr_writer.py``; this module opens, creates and manages the store.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError, StoreMismatchError
from . import failed, lock
from . import format as fmt
from .base import JacobianStore, LayerwiseSpec, PromptWriter, VerifyResult
from .disk import alive, disk_error, fsync_tree
from .location import store_path
from .zarr_prompt import ZarrPrompt, verify_prompt
from .zarr_writer import ZarrPromptWriter


class ZarrStore(JacobianStore):
    """A store folder. Use :func:`open_store` (read) or :func:`create_store` (write)."""

    def __init__(self, path: Path, root: dict[str, Any], lock: Any | None = None, lease: str | None = None) -> None:
        self.path = path
        self.run = root.get("run", {})
        self.format_version = root["format_version"]
        self.created = root.get("created")
        self._lock = lock
        self._lease = lease  # set for a worker writing on behalf of the lock holder (attach_store)

    @property
    def writable(self) -> bool:
        return self._lock is not None or self._lease is not None

    @property
    def lease(self) -> str | None:
        """The writer lease under which workers may write into this store (None: not opened for writing)."""
        if self._lease is not None:
            return self._lease
        record = lock.holder(self.path) if self._lock is not None else None
        return record.get("lease") if record else None

    def check_writer(self) -> None:
        """Raise StoreError unless this handle may still publish prompts (its run holds the store)."""
        if self._lease is not None:
            lock.check_lease(self.path, self._lease)
        elif self._lock is None:
            raise StoreError(f"Expected a store opened for writing (create_store). Got {self.path} opened read-only.")

    def failures(self) -> dict[str, dict[str, Any]]:
        """Failure records of prompts a run could not compute, by prompt id: ``prompt``, ``line``, ``reason``,
        ``error``, ``stage``, ``failed_at``."""
        return failed.read_all(self.path)

    def record_failure(self, prompt_id: str, attrs: dict[str, Any]) -> None:
        """Record that ``prompt_id`` failed (replacing an earlier record); needs the store opened for writing."""
        self.check_writer()
        failed.record(self.path, prompt_id, attrs)

    def clear_failure(self, prompt_id: str) -> None:
        failed.clear(self.path, prompt_id)

    def clear_staging(self) -> None:
        """Remove the staging folders of attempts that never committed (call when no attempt is running)."""
        self.check_writer()
        shutil.rmtree(self.path / fmt.STAGING, ignore_errors=True)

    def prompt_ids(self) -> list[str]:
        folder = self.path / fmt.PROMPTS
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if (p / "zarr.json").is_file())

    def get(self, prompt_id: str) -> ZarrPrompt:
        path = self.path / fmt.PROMPTS / prompt_id
        if not (path / "zarr.json").is_file():
            failure = self.failures().get(prompt_id)
            if failure is not None:
                raise StoreError(f"Expected a complete prompt {prompt_id!r} in {self.path}. Got a failed one (line "
                                 f"{failure.get('line')}): {failure.get('reason')}")
            raise StoreError(f"Expected a complete prompt {prompt_id!r} in {self.path}. Got none "
                             f"({len(self.prompt_ids())} complete prompts; list them with `detjac store ls`).")
        return ZarrPrompt(path)

    def model_array(self, name: str) -> np.ndarray:
        """``embedding`` (vocab, col), ``unembedding`` (vocab, row) or ``final_norm`` (row,), as stored at creation."""
        import zarr

        folder = self.path / fmt.MODEL
        if not (folder / name / "zarr.json").is_file():
            raise StoreError(f"Expected a model array {name!r} in {self.path}. Got none (stores written without "
                             "the model's matrices cannot decode).")
        return zarr.open_array(str(folder / name), mode="r")[...]

    def model_file(self, name: str) -> Path | None:
        """Path of a file kept with the model arrays (e.g. ``tokenizer.json``), or None."""
        path = self.path / fmt.MODEL / name
        return path if path.is_file() else None

    def write_analysis(self, prompt_id: str, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        """Store an analysis result of a prompt under ``analysis/<prompt_id>/<name>`` (replaced atomically)."""
        import zarr

        self.get(prompt_id)  # the prompt must exist
        final = self.path / fmt.ANALYSIS / prompt_id / name
        tmp = final.with_name(f".{name}.tmp-{os.getpid()}")
        try:
            group = zarr.open_group(str(tmp), mode="w", zarr_format=3)
            for key, values in arrays.items():
                fmt.put_array(group, key, values)
            group.attrs.update({**attrs, "written_at": fmt.now()})
            old = final.with_name(f".{name}.old-{os.getpid()}")
            if final.exists():
                os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_error(exc, f"write analysis {name} of prompt {prompt_id}") from exc

    def read_analysis(self, prompt_id: str, name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(arrays, attrs) of a stored analysis result, or None."""
        import zarr

        path = self.path / fmt.ANALYSIS / prompt_id / name
        if not (path / "zarr.json").is_file():
            return None
        group = zarr.open_group(str(path), mode="r")
        return {key: group[key][...] for key in group.array_keys()}, dict(group.attrs)

    def staging_leftovers(self) -> list[str]:
        folder = self.path / fmt.STAGING
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def begin(self, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
              row_block: int, rank: int | None = None,
              layerwise: dict[str, LayerwiseSpec] | None = None, shard_bytes: int | None = None) -> PromptWriter:
        if not self.writable:
            raise StoreError(f"Expected a store opened for writing (create_store). Got {self.path} opened read-only.")
        return ZarrPromptWriter(self, prompt_id, n_rows=n_rows, n_tokens=n_tokens, n_cols=n_cols, dtype=dtype,
                                row_block=row_block, rank=rank, layerwise=layerwise,
                                shard_bytes=shard_bytes)

    def verify(self, progress: bool = False) -> list[VerifyResult]:
        from detjac.progress import tqdm

        ids = self.prompt_ids()
        return [verify_prompt(self.path / fmt.PROMPTS / pid) for pid in tqdm(ids, desc="verify", unit="prompt",
                                                                              disable=not progress)]

    def close(self) -> None:
        """Release the writer lock (if this store was opened for writing)."""
        if self._lock is not None:
            lock.release(self._lock)  # clears the holder record; closing the file releases its flock
            self._lock = None


def open_store(path: str | os.PathLike[str]) -> ZarrStore:
    """Open a store for reading (works while a writer is running); a path or a ``file://`` URL."""
    path = store_path(path)
    return ZarrStore(path, fmt.read_root(path))


def _write_model(root: Any, tmp: Path, arrays: dict[str, np.ndarray], files: dict[str, bytes]) -> dict[str, str]:
    """Model matrices (for decoding without the model) and small files; returns their SHA-256s."""
    import hashlib

    group = root.create_group(fmt.MODEL)
    digests = {}
    for name, values in arrays.items():
        fmt.put_array(group, name, values, fmt.DIMENSIONS[name], chunks=(min(8192, values.shape[0]), *values.shape[1:]))
        digests[name] = hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()
    for name, data in files.items():
        (tmp / fmt.MODEL / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def _new_store(path: Path, run: dict[str, Any], arrays: dict[str, np.ndarray] | None = None,
               files: dict[str, bytes] | None = None) -> None:
    """Create the store under a temporary name and rename it into place."""
    import zarr

    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a writer killed while creating the store
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        root.create_group(fmt.PROMPTS)
        digests = _write_model(root, tmp, arrays or {}, files or {})
        root.attrs[fmt.ROOT_KEY] = {"format_version": fmt.FORMAT_VERSION, "created": fmt.now(), "run": run,
                                    "model_sha256": digests}
        fsync_tree(tmp)
        os.rename(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(exc, f"create the store {path}") from exc


def create_store(path: str | os.PathLike[str], run: dict[str, Any], *, force_new: bool = False,
                 model_data: Callable[[], tuple[dict[str, np.ndarray], dict[str, bytes]]] | None = None) -> ZarrStore:
    """Open ``path`` for writing: create it, or resume it if it holds the same run.

    When a new store is created, ``model_data()`` is called for the arrays (``embedding``
    (vocab, col), ``unembedding`` (vocab, row)) and files (e.g. ``tokenizer.json``) kept
    under ``model/``, so that analyses can decode singular vectors without the model; a
    resumed store already has them, and the call (a copy of the matrices) is skipped.

    Raises StoreMismatchError if the store was written for another model or settings
    (unless ``force_new``, which deletes it and starts again), StoreFormatError if ``path``
    is not a detjac store, StoreError if it cannot be written or another writer holds it.
    """
    path = store_path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        root = fmt.read_root(path)
        differences = fmt.mismatches(root.get("run", {}), run)
        if differences and not force_new:
            raise StoreMismatchError(f"Expected the store {path} to hold the same run. Got differences: "
                                     + "; ".join(differences) + ". Use --force-new to replace it, or another --out.")
        if differences:
            lock.release(lock.acquire(path))  # refuse to delete a store that another writer is using
            shutil.rmtree(path)
    elif path.exists():
        path.rmdir()  # an empty folder: replace it with the new store
    if not path.exists():
        if not path.parent.is_dir():
            raise StoreError(f"Expected an existing parent folder for the store {path}. Got none at {path.parent}.")
        if not os.access(path.parent, os.W_OK):
            raise StoreError(f"Could not create the store {path}: {path.parent} is not writable.")
        _new_store(path, run, *(model_data() if model_data is not None else ({}, {})))
    if not os.access(path, os.W_OK):
        raise StoreError(f"Could not write to the store {path}: it is read-only.")
    handle = lock.acquire(path)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path / fmt.STAGING)  # leftovers of crashed runs: partial prompts are redone
    return ZarrStore(path, fmt.read_root(path), handle)


def attach_store(location: str | os.PathLike[str], lease: str) -> ZarrStore:
    """Open a store for writing prompts on behalf of the run that holds its writer lock under ``lease``.

    This is how a run's workers write (``detjac run --scheduler``): they take no lock, and each
    commit checks that the lock file still names ``lease``. Raises StoreError if it does not.
    """
    path = store_path(location)
    lock.check_lease(path, lease)
    return ZarrStore(path, fmt.read_root(path), lease=lease)

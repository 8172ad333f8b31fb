"""The zarr v3 directory backend, writing side: staged prompt groups, store creation, the writer lock.

A prompt is written into ``_staging/<id>.<pid>`` and renamed into ``prompts/<id>`` only
after every chunk and its attributes are on disk. One writer at a time holds an exclusive
``flock`` on ``.writer.lock``; it clears staging leftovers of crashed runs when it starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, StoreError, StoreMismatchError
from . import format as fmt
from .base import PromptWriter
from .zarr_store import ZarrStore, read_root


def disk_error(exc: OSError, what: str) -> StoreError:
    reasons = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
               errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied"}
    reason = reasons.get(exc.errno or 0, str(exc))
    return StoreError(f"Could not {what}: {reason}. Nothing half-written is visible; fix this and re-run to resume.")


def _fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """Flush every file and folder under ``path`` (so a rename publishes data that is on disk)."""
    for folder, _, files in os.walk(path):
        for name in files:
            _fsync_dir(os.path.join(folder, name))
        _fsync_dir(folder)


class ZarrPromptWriter(PromptWriter):
    """Writes one prompt group under ``_staging``; row blocks are grouped into whole shards."""

    def __init__(self, store: ZarrStore, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
                 row_block: int, rank: int | None = None) -> None:
        import zarr

        self.id, self.n_rows, self.n_tokens, self.dtype, self.rank = prompt_id, n_rows, n_tokens, dtype, rank
        self.final = store.path / fmt.PROMPTS / prompt_id
        self.staging = store.path / fmt.STAGING / f"{prompt_id}.{os.getpid()}"
        self._written: set[str] = set()
        self._buffer: list[np.ndarray] = []
        self._buffer_start = self._next_row = 0
        self.shard_rows = fmt.shard_rows(row_block, n_rows, n_tokens * n_cols * np.dtype(dtype).itemsize)
        try:
            shutil.rmtree(self.staging, ignore_errors=True)
            group = zarr.open_group(str(self.staging), mode="w", zarr_format=3)
            shapes = {"jacobian": ((n_rows, n_tokens, n_cols), dtype), "embeddings": ((n_tokens, n_cols), dtype),
                      "output": ((n_rows,), dtype), "token_ids": ((n_tokens,), "int64")}
            if rank is not None:
                del shapes["jacobian"]
            self._arrays = {}
            for name, (shape, dt) in shapes.items():
                big = name == "jacobian"
                self._arrays[name] = group.create_array(
                    name, shape=shape, dtype=dt, dimension_names=fmt.DIMENSIONS[name],
                    chunks=(min(row_block, n_rows), n_tokens, n_cols) if big else shape,
                    shards=(self.shard_rows, n_tokens, n_cols) if big else None,
                    compressors=fmt.compressors(np.dtype(dt).itemsize), fill_value=0)
            self._group = group
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"start prompt {prompt_id} in {store.path}") from exc

    def write_rows(self, start: int, stop: int, values: np.ndarray) -> None:
        if start != self._next_row or stop <= start or stop > self.n_rows or values.shape[0] != stop - start:
            raise StoreError(f"Expected jacobian rows starting at {self._next_row} for prompt {self.id}. "
                             f"Got rows {start}:{stop} with {values.shape[0]} values.")
        if self.rank is not None:
            raise StoreError(f"Expected triplets for prompt {self.id} (low-rank mode). Got jacobian rows.")
        self._next_row = stop
        self._buffer.append(np.asarray(values))
        if stop - self._buffer_start >= self.shard_rows or stop == self.n_rows:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        block = np.concatenate(self._buffer, axis=0)
        try:
            self._arrays["jacobian"][self._buffer_start:self._buffer_start + len(block)] = block
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._buffer_start += len(block)
        self._buffer = []
        if self._buffer_start == self.n_rows:
            self._written.add("jacobian")

    def write_array(self, name: str, values: np.ndarray) -> None:
        if name not in fmt.SMALL_ARRAYS:
            raise InvalidArgumentError(f"Expected one of {', '.join(fmt.SMALL_ARRAYS)}. Got {name!r}.")
        try:
            self._arrays[name][...] = values
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._written.add(name)

    def commit(self, attrs: dict[str, Any]) -> None:
        missing = {"jacobian" if self.rank is None else "triplets", *fmt.SMALL_ARRAYS} - self._written
        if missing:
            self.abort()
            raise StoreError(f"Expected every array of prompt {self.id} before commit. Got none for "
                             f"{', '.join(sorted(missing))} (rows written: {self._next_row} of {self.n_rows}).")
        try:
            self._group.attrs.update({**attrs, "complete": True})
            _fsync_tree(self.staging)
            if self.final.exists():  # the same prompt was stored meanwhile: keep the first
                self.abort()
                return
            os.rename(self.staging, self.final)
            _fsync_dir(self.final.parent)
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"commit prompt {self.id}") from exc

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def write_triplets(self, per_token: list[Any], combined: Any) -> dict[str, Any]:
        """Low-rank mode: per-token and combined triplets (``store.subspace.Triplets``); returns attrs to commit."""
        if self.rank is None:
            raise StoreError(f"Expected jacobian rows for prompt {self.id} (full mode). Got triplets.")
        arrays = {
            "token_U": (np.stack([t.U for t in per_token]), ("token", "row", "rank")),
            "token_S": (np.stack([t.S for t in per_token]), ("token", "rank")),
            "token_V": (np.stack([t.V for t in per_token]), ("token", "col", "rank")),
            "token_frobenius_sq": (np.array([t.frobenius_sq for t in per_token]), ("token",)),
            "token_residual_sq": (np.array([t.residual_sq for t in per_token]), ("token",)),
            "combined_U": (combined.U, ("row", "rank")),
            "combined_S": (combined.S, ("rank",)),
            "combined_V": (combined.V.reshape(len(per_token), -1, combined.V.shape[-1]), ("token", "col", "rank")),
        }
        try:
            for name, (values, dims) in arrays.items():
                fmt.put_array(self._group, name, values.astype(self.dtype), dims)
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._written.add("triplets")
        return {"keep": f"rank:{self.rank}", "rank": int(combined.S.shape[0]),
                "combined_frobenius_sq": combined.frobenius_sq, "combined_residual_sq": combined.residual_sq,
                "combined_captured": combined.captured}


def _acquire_lock(path: Path) -> Any:
    handle = open(path / fmt.LOCK, "a+")  # noqa: SIM115 - kept open while the store is written
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        handle.close()
        raise StoreError(f"Expected no other writer on {path}. Got one running (it holds {path / fmt.LOCK}); "
                         "wait for it to finish or write to another --out.") from exc
    return handle


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_model(root: Any, tmp: Path, arrays: dict[str, np.ndarray], files: dict[str, bytes]) -> dict[str, str]:
    """Model matrices (for decoding without the model) and small files; returns their SHA-256s."""
    import hashlib

    group = root.create_group(fmt.MODEL)
    digests = {}
    for name, values in arrays.items():
        fmt.put_array(group, name, values, fmt.DIMENSIONS[name], chunks=(min(8192, values.shape[0]), values.shape[1]))
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
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        root.create_group(fmt.PROMPTS)
        digests = _write_model(root, tmp, arrays or {}, files or {})
        root.attrs[fmt.ROOT_KEY] = {"format_version": fmt.FORMAT_VERSION, "created": fmt.now(), "run": run,
                                    "model_sha256": digests}
        _fsync_tree(tmp)
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
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        root = read_root(path)
        differences = fmt.mismatches(root.get("run", {}), run)
        if differences and not force_new:
            raise StoreMismatchError(f"Expected the store {path} to hold the same run. Got differences: "
                                     + "; ".join(differences) + ". Use --force-new to replace it, or another --out.")
        if differences:
            _acquire_lock(path).close()  # refuse to delete a store that another writer is using
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
    lock = _acquire_lock(path)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path / fmt.STAGING)  # leftovers of crashed runs: partial prompts are redone
    return ZarrStore(path, read_root(path), lock)

"""The zarr v3 directory backend, writing side: staged prompt groups, store creation, the writer lock.

A prompt is written into ``_staging/<id>.<host>.<pid>.<random>`` (one folder per attempt, so
a retry on another worker never meets a killed attempt's files) and renamed into
``prompts/<id>`` only after every chunk and its attributes are on disk. One run at a time
holds the writer lock (``lock.py``); it clears staging leftovers of crashed runs when it starts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, StoreError, StoreMismatchError
from . import format as fmt
from . import lock
from .base import LayerwiseSpec, PromptWriter
from .location import store_path
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
                 row_block: int, rank: int | None = None, layerwise: dict[str, LayerwiseSpec] | None = None,
                 shard_bytes: int | None = None) -> None:
        import zarr

        if shard_bytes is not None and (isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int)
                                        or shard_bytes < 1):
            raise StoreError(f"Expected shard_bytes to be a positive integer or None. Got {shard_bytes!r}.")

        self.id, self.n_rows, self.n_tokens, self.dtype, self.rank = prompt_id, n_rows, n_tokens, dtype, rank
        self.n_cols = n_cols
        self.layerwise = dict(layerwise or {})
        if self.layerwise and rank is not None:
            raise StoreError(f"Expected full mode for layerwise Jacobians of prompt {prompt_id}. Got rank {rank}.")
        self._covered: dict[str, int] = {}  # elements (rows x tokens) written per region-written Jacobian
        self.store = store
        self.final = store.path / fmt.PROMPTS / prompt_id
        attempt = f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        self.staging = store.path / fmt.STAGING / f"{prompt_id}.{attempt}"
        self._written: set[str] = set()
        self._buffer: np.ndarray | None = None  # the shard being filled, rows from _buffer_start
        self._filled = self._buffer_start = self._next_row = 0
        self.shard_rows = fmt.shard_rows(row_block, n_rows, n_tokens * n_cols * np.dtype(dtype).itemsize,
                                         fmt.SHARD_BYTES if shard_bytes is None else shard_bytes)
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
            for name, spec in self.layerwise.items():
                self._create_layerwise(group, name, spec, n_cols, row_block)
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"start prompt {prompt_id} in {store.path}") from exc

    def write_rows(self, start: int, stop: int, values: np.ndarray) -> None:
        values = np.asarray(values)
        if start != self._next_row or stop <= start or stop > self.n_rows or values.shape[0] != stop - start:
            raise StoreError(f"Expected jacobian rows starting at {self._next_row} for prompt {self.id}. "
                             f"Got rows {start}:{stop} with {values.shape[0]} values.")
        if self.rank is not None:
            raise StoreError(f"Expected triplets for prompt {self.id} (low-rank mode). Got jacobian rows.")
        if values.shape[1:] != (self.n_tokens, self.n_cols):
            raise StoreError(f"Expected jacobian rows of shape (rows, {self.n_tokens}, {self.n_cols}) for prompt "
                             f"{self.id}. Got values of shape {values.shape}.")
        self._next_row = stop
        done = 0
        while done < len(values):  # fill whole shards; a shard that comes whole is written without a copy
            rows = min(self.shard_rows, self.n_rows - self._buffer_start)
            if self._filled == 0 and len(values) - done >= rows:
                self._write_shard(values[done:done + rows])
                done += rows
                continue
            if self._buffer is None:
                self._buffer = np.empty((rows, self.n_tokens, self.n_cols), dtype=self.dtype)
            take = min(len(values) - done, rows - self._filled)
            self._buffer[self._filled:self._filled + take] = values[done:done + take]
            self._filled += take
            done += take
            if self._filled == rows:
                buffer, self._buffer, self._filled = self._buffer, None, 0
                self._write_shard(buffer)

    def _write_shard(self, block: np.ndarray) -> None:
        try:
            self._arrays["jacobian"][self._buffer_start:self._buffer_start + len(block)] = block
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._buffer_start += len(block)
        if self._buffer_start == self.n_rows:
            self._written.add("jacobian")

    def _create_layerwise(self, group: Any, name: str, spec: LayerwiseSpec, n_cols: int, row_block: int) -> None:
        sub = group.require_group(fmt.LAYERWISE).create_group(name)
        sub.attrs.update({"layer": spec.layer, "component": spec.component, "local": spec.local, "mode": spec.mode})
        n, d = self.n_tokens, self.n_rows
        # chunks follow the blocks the engine produces: row blocks (reverse mode) or token blocks (forward mode)
        chunks = (d, min(spec.token_block, n), n_cols) if spec.mode == "forward" else (min(row_block, d), n, n_cols)
        itemsize = np.dtype(self.dtype).itemsize
        arrays = {"jacobian": ((d, n, n_cols), chunks), "output": ((d,), (d,))}
        if spec.local:
            arrays["inputs"] = ((n, n_cols), (n, n_cols))
        for array, (shape, chunk) in arrays.items():
            sub.create_array(array, shape=shape, dtype=self.dtype, dimension_names=fmt.DIMENSIONS[array],
                             chunks=chunk, compressors=fmt.compressors(itemsize), fill_value=0)

    def write_block(self, target: str, start: int, stop: int, token_start: int, token_stop: int,
                    values: np.ndarray) -> None:
        """Jacobian rows ``start:stop`` x tokens ``token_start:token_stop`` of ``target``.

        ``target`` is ``"jacobian"`` (the prompt's Jacobian) or the name of a layerwise target
        given to ``begin``. Blocks may come in any order and must not overlap; a Jacobian counts
        as written when its blocks cover it.
        """
        if target == "jacobian" and (token_start, token_stop) == (0, self.n_tokens):
            self.write_rows(start, stop, values)
            return
        if target != "jacobian" and target not in self.layerwise:
            raise StoreError(f"Expected 'jacobian' or a layerwise target of prompt {self.id} "
                             f"({', '.join(self.layerwise) or 'none'}). Got {target!r}.")
        shape = (stop - start, token_stop - token_start)
        if not (0 <= start < stop <= self.n_rows and 0 <= token_start < token_stop <= self.n_tokens) \
                or tuple(values.shape[:2]) != shape:
            raise StoreError(f"Expected a block inside ({self.n_rows} rows, {self.n_tokens} tokens) of {target} for "
                             f"prompt {self.id}. Got rows {start}:{stop}, tokens {token_start}:{token_stop} with "
                             f"values of shape {tuple(values.shape)}.")
        arr = self._arrays["jacobian"] if target == "jacobian" else self._group[f"{fmt.LAYERWISE}/{target}/jacobian"]
        try:
            arr[start:stop, token_start:token_stop] = values
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._covered[target] = self._covered.get(target, 0) + shape[0] * shape[1]
        if self._covered[target] == self.n_rows * self.n_tokens:
            self._written.add(target)

    def write_layerwise(self, target: str, array: str, values: np.ndarray) -> None:
        """A layerwise target's ``output`` (row,) -- the value its Jacobian reconstructs -- or, for a
        per-layer (``*_local``) target, its ``inputs`` (token, col): the layer's input hidden states."""
        spec = self.layerwise.get(target)
        allowed = ("output", "inputs") if spec is not None and spec.local else ("output",)
        if spec is None or array not in allowed:
            raise StoreError(f"Expected one of {', '.join(allowed)} for a layerwise target of prompt {self.id} "
                             f"({', '.join(self.layerwise) or 'none'}). Got {target!r} / {array!r}.")
        try:
            self._group[f"{fmt.LAYERWISE}/{target}/{array}"][...] = values
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._written.add(f"{target}/{array}")

    def write_array(self, name: str, values: np.ndarray) -> None:
        allowed = (*fmt.SMALL_ARRAYS, *fmt.OPTIONAL_ARRAYS)
        if name not in allowed:
            raise InvalidArgumentError(f"Expected one of {', '.join(allowed)}. Got {name!r}.")
        if name in fmt.OPTIONAL_ARRAYS and np.shape(values) != (self.n_rows,):
            raise StoreError(f"Expected {name} of shape ({self.n_rows},) for prompt {self.id}. "
                             f"Got {np.shape(values)}.")
        try:
            if name in fmt.OPTIONAL_ARRAYS:
                self._arrays[name] = fmt.put_array(self._group, name, np.asarray(values, dtype=self.dtype),
                                                   fmt.DIMENSIONS[name])
                self._written.add(name)
                return
            self._arrays[name][...] = values
        except OSError as exc:
            self.abort()
            raise disk_error(exc, f"write prompt {self.id}") from exc
        self._written.add(name)

    def commit(self, attrs: dict[str, Any]) -> None:
        missing = {"jacobian" if self.rank is None else "triplets", *fmt.SMALL_ARRAYS} - self._written
        for name, spec in self.layerwise.items():
            missing |= {name, f"{name}/output", *([f"{name}/inputs"] if spec.local else [])} - self._written
        if missing:
            self.abort()
            raise StoreError(f"Expected every array of prompt {self.id} before commit. Got none for "
                             f"{', '.join(sorted(missing))} (rows written: {self._next_row} of {self.n_rows}).")
        try:
            self._group.attrs.update({**attrs, "complete": True})
            _fsync_tree(self.staging)
            self.store.check_writer()
            if self.final.exists():  # the same prompt was stored meanwhile: keep the first
                self.abort()
                return
            os.rename(self.staging, self.final)
            _fsync_dir(self.final.parent)
        except OSError as exc:
            self.abort()
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and self.final.exists():
                return  # another attempt at the same prompt committed first: it is stored once
            if isinstance(exc, StoreError):
                raise
            raise disk_error(exc, f"commit prompt {self.id}") from exc
        self.store.clear_failure(self.id)  # a prompt is complete or failed, never both

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
    path = store_path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        root = read_root(path)
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
    return ZarrStore(path, read_root(path), handle)


def attach_store(location: str | os.PathLike[str], lease: str) -> ZarrStore:
    """Open a store for writing prompts on behalf of the run that holds its writer lock under ``lease``.

    This is how a run's workers write (``detjac run --scheduler``): they take no lock, and each
    commit checks that the lock file still names ``lease``. Raises StoreError if it does not.
    """
    path = store_path(location)
    lock.check_lease(path, lease)
    return ZarrStore(path, read_root(path), lease=lease)

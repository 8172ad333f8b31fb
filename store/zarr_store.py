"""The zarr v3 directory backend: one folder per store, one group per prompt.

Crash safety comes from the file system: a prompt is written into ``_staging/<id>.<pid>``
and renamed into ``prompts/<id>`` only after every chunk and its attributes are on disk
(``os.rename`` of a directory is atomic on POSIX), so readers, who only list ``prompts/``,
see it complete or not at all. One writer at a time holds an exclusive ``flock`` on
``.writer.lock``; it clears staging leftovers of crashed runs when it starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, StoreError, StoreFormatError, StoreMismatchError
from . import format as fmt
from .base import JacobianStore, PromptWriter, StoredPrompt, VerifyResult

SMALL_ARRAYS = ("embeddings", "output", "token_ids")
# Relative reconstruction error above which verify calls a prompt corrupt, by compute dtype.
DTYPE_BOUND = {"float64": 1e-9, "float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}


def _disk_error(exc: OSError, what: str) -> StoreError:
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


def read_root(path: Path) -> dict[str, Any]:
    """The store's root description; raises StoreFormatError for anything else."""
    meta_file = path / "zarr.json"
    if not path.exists():
        raise StoreFormatError(f"Expected a detjac store at {path}. Got no such file or folder.")
    if not path.is_dir() or not meta_file.is_file():
        raise StoreFormatError(f"Expected a detjac store (a zarr v3 folder with zarr.json) at {path}. "
                               f"Got {'a file' if path.is_file() else 'a folder without zarr.json'} instead.")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise StoreFormatError(f"Expected readable JSON in {meta_file}. Got an error: {exc}.") from exc
    root = meta.get("attributes", {}).get(fmt.ROOT_KEY)
    if meta.get("zarr_format") != 3 or not isinstance(root, dict):
        raise StoreFormatError(f"Expected a detjac store at {path}. Got a zarr folder without the "
                               f"'{fmt.ROOT_KEY}' attribute (not written by detjac).")
    version = root.get("format_version")
    if not isinstance(version, int) or version > fmt.FORMAT_VERSION:
        raise StoreFormatError(f"Expected store format version <= {fmt.FORMAT_VERSION} at {path}. Got {version!r}: "
                               "it was written by a newer detjac; upgrade detjac to read it.")
    return root


class ZarrPrompt(StoredPrompt):
    """A complete prompt group, opened read-only."""

    def __init__(self, path: Path) -> None:
        import zarr

        self.path = path
        self.id = path.name
        self._group = zarr.open_group(str(path), mode="r")
        self.attrs = dict(self._group.attrs)

    @property
    def low_rank(self) -> bool:
        return "rank" in self.attrs

    def _full(self) -> Any:
        if self.low_rank:
            raise StoreError(f"Prompt {self.id} was stored in low-rank mode ({self.attrs.get('keep')}): it has no "
                             "full Jacobian. Use prompt.triplets(k) for token k or prompt.triplets() for all tokens.")
        return self._group["jacobian"]

    def triplets(self, k: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Low-rank mode: (U (row, rank), S (rank,), V) of token ``k``'s ``J_k`` (V: (col, rank)) or, with
        ``k=None``, of the combined ``[J_1 ... J_n]`` (V: (token, col, rank))."""
        if not self.low_rank:
            raise StoreError(f"Prompt {self.id} holds the full Jacobian, not triplets; use jacobian() or operator().")
        if k is None:
            return tuple(self._group[f"combined_{x}"][...] for x in "USV")  # type: ignore[return-value]
        n = self.n_tokens
        if not -n <= k < n:
            raise InvalidArgumentError(f"Expected a token index in [-{n}, {n}) for prompt {self.id}. Got {k}.")
        return tuple(self._group[f"token_{x}"][k % n] for x in "USV")  # type: ignore[return-value]

    def jacobian(self, lazy: bool = True) -> Any:
        arr = self._full()
        if lazy:
            import dask.array as da

            return da.from_zarr(arr)
        return arr[...]

    def operator(self, k: int) -> np.ndarray:
        n = self.n_tokens
        if not -n <= k < n:
            raise InvalidArgumentError(f"Expected a token index in [-{n}, {n}) for prompt {self.id}. Got {k}.")
        return self._full()[:, k % n, :]

    def array(self, name: str) -> np.ndarray:
        names = sorted(set(self._group.array_keys()) - {"jacobian"})
        if name not in names:
            raise InvalidArgumentError(f"Expected one of {', '.join(names)}. Got {name!r}.")
        return self._group[name][...]


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
            raise _disk_error(exc, f"start prompt {prompt_id} in {store.path}") from exc

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
            raise _disk_error(exc, f"write prompt {self.id}") from exc
        self._buffer_start += len(block)
        self._buffer = []
        if self._buffer_start == self.n_rows:
            self._written.add("jacobian")

    def write_array(self, name: str, values: np.ndarray) -> None:
        if name not in SMALL_ARRAYS:
            raise InvalidArgumentError(f"Expected one of {', '.join(SMALL_ARRAYS)}. Got {name!r}.")
        try:
            self._arrays[name][...] = values
        except OSError as exc:
            self.abort()
            raise _disk_error(exc, f"write prompt {self.id}") from exc
        self._written.add(name)

    def commit(self, attrs: dict[str, Any]) -> None:
        missing = {"jacobian" if self.rank is None else "triplets", *SMALL_ARRAYS} - self._written
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
            raise _disk_error(exc, f"commit prompt {self.id}") from exc

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
                values = values.astype(self.dtype)
                arr = self._group.create_array(name, shape=values.shape, dtype=values.dtype, dimension_names=dims,
                                               chunks=values.shape, compressors=fmt.compressors(values.itemsize))
                arr[...] = values
        except OSError as exc:
            self.abort()
            raise _disk_error(exc, f"write prompt {self.id}") from exc
        self._written.add("triplets")
        return {"keep": f"rank:{self.rank}", "rank": int(combined.S.shape[0]),
                "combined_frobenius_sq": combined.frobenius_sq, "combined_residual_sq": combined.residual_sq,
                "combined_captured": combined.captured}


class ZarrStore(JacobianStore):
    """A store folder. Use :func:`open_store` (read) or :func:`create_store` (write)."""

    def __init__(self, path: Path, root: dict[str, Any], lock: Any | None = None) -> None:
        self.path = path
        self.run = root.get("run", {})
        self.format_version = root["format_version"]
        self.created = root.get("created")
        self._lock = lock

    @property
    def writable(self) -> bool:
        return self._lock is not None

    def prompt_ids(self) -> list[str]:
        folder = self.path / fmt.PROMPTS
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if (p / "zarr.json").is_file())

    def get(self, prompt_id: str) -> ZarrPrompt:
        path = self.path / fmt.PROMPTS / prompt_id
        if not (path / "zarr.json").is_file():
            raise StoreError(f"Expected a complete prompt {prompt_id!r} in {self.path}. Got none "
                             f"({len(self.prompt_ids())} complete prompts; list them with `detjac store ls`).")
        return ZarrPrompt(path)

    def model_array(self, name: str) -> np.ndarray:
        """``embedding`` (vocab, col) or ``unembedding`` (vocab, row), as stored at creation."""
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
                values = np.asarray(values)
                arr = group.create_array(key, shape=values.shape, dtype=values.dtype, chunks=values.shape or None,
                                         compressors=fmt.compressors(values.itemsize))
                arr[...] = values
            group.attrs.update({**attrs, "written_at": fmt.now()})
            old = final.with_name(f".{name}.old-{os.getpid()}")
            if final.exists():
                os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _disk_error(exc, f"write analysis {name} of prompt {prompt_id}") from exc

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
              row_block: int, rank: int | None = None) -> ZarrPromptWriter:
        if not self.writable:
            raise StoreError(f"Expected a store opened for writing (create_store). Got {self.path} opened read-only.")
        return ZarrPromptWriter(self, prompt_id, n_rows=n_rows, n_tokens=n_tokens, n_cols=n_cols, dtype=dtype,
                                row_block=row_block, rank=rank)

    def verify(self, progress: bool = False) -> list[VerifyResult]:
        from tqdm import tqdm

        ids = self.prompt_ids()
        return [verify_prompt(self.path / fmt.PROMPTS / pid) for pid in tqdm(ids, desc="verify", unit="prompt",
                                                                              disable=not progress)]

    def close(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def __enter__(self) -> ZarrStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def verify_prompt(path: Path) -> VerifyResult:
    """Decode every chunk (crc32c is checked on read) and recompute the reconstruction error."""
    pid = path.name
    try:
        prompt = ZarrPrompt(path)
        if prompt.low_rank:
            return _verify_low_rank(prompt)
        arr = prompt._group["jacobian"]
        x = prompt.array("embeddings").astype(np.float64)
        y = prompt.array("output").astype(np.float64)
        recon = np.empty_like(y)
        step = arr.chunks[0]
        for start in range(0, arr.shape[0], step):
            block = arr[start:start + step].astype(np.float64)  # (rows, token, col)
            recon[start:start + step] = np.einsum("rtc,tc->r", block, x)
    except Exception as exc:  # noqa: BLE001 - any decode failure means the prompt is corrupt
        return VerifyResult(pid, False, None, f"unreadable: {type(exc).__name__}: {exc}")
    error = float(np.linalg.norm(recon - y) / max(np.linalg.norm(y), np.finfo(np.float64).tiny))
    bound = max(DTYPE_BOUND.get(prompt.attrs.get("dtype", "float64"), 1e-9),
                10 * float(prompt.attrs.get("reconstruction_error", 0.0)))
    if not np.isfinite(error) or error > bound:
        return VerifyResult(pid, False, error, f"reconstruction error {error:.3e} above {bound:.1e}")
    return VerifyResult(pid, True, error)


def _verify_low_rank(prompt: ZarrPrompt) -> VerifyResult:
    """Decode every array (checksums); singular values finite, non-negative, descending, not above the energy."""
    arrays = {name: prompt._group[name][...] for name in prompt._group.array_keys()}
    for name in ("token_S", "combined_S"):
        s = arrays[name].astype(np.float64)
        if not np.all(np.isfinite(s)) or np.any(s < 0) or np.any(np.diff(s, axis=-1) > 1e-12 * s.max(initial=1)):
            return VerifyResult(prompt.id, False, None, f"{name} is not a valid descending spectrum")
    energy = (arrays["token_S"].astype(np.float64) ** 2).sum(-1)
    if np.any(energy > arrays["token_frobenius_sq"] * (1 + 1e-6) + 1e-300):
        return VerifyResult(prompt.id, False, None, "singular values exceed the stored Frobenius norms")
    return VerifyResult(prompt.id, True, None)


def open_store(path: str | os.PathLike[str]) -> ZarrStore:
    """Open a store for reading (works while a writer is running)."""
    path = Path(path)
    return ZarrStore(path, read_root(path))


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
        arr = group.create_array(name, shape=values.shape, dtype=values.dtype, dimension_names=fmt.DIMENSIONS[name],
                                 chunks=(min(8192, values.shape[0]), values.shape[1]),
                                 compressors=fmt.compressors(values.itemsize))
        arr[...] = values
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
        raise _disk_error(exc, f"create the store {path}") from exc


def create_store(path: str | os.PathLike[str], run: dict[str, Any], *, force_new: bool = False,
                 model_arrays: dict[str, np.ndarray] | None = None,
                 model_files: dict[str, bytes] | None = None) -> ZarrStore:
    """Open ``path`` for writing: create it, or resume it if it holds the same run.

    A new store also keeps ``model_arrays`` (``embedding`` (vocab, col), ``unembedding``
    (vocab, row)) and ``model_files`` (e.g. ``tokenizer.json``) under ``model/``, so that
    analyses can decode singular vectors without the model.

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
            shutil.rmtree(path)
    elif path.exists():
        path.rmdir()  # an empty folder: replace it with the new store
    if not path.exists():
        if not path.parent.is_dir():
            raise StoreError(f"Expected an existing parent folder for the store {path}. Got none at {path.parent}.")
        if not os.access(path.parent, os.W_OK):
            raise StoreError(f"Could not create the store {path}: {path.parent} is not writable.")
        _new_store(path, run, model_arrays, model_files)
    if not os.access(path, os.W_OK):
        raise StoreError(f"Could not write to the store {path}: it is read-only.")
    lock = _acquire_lock(path)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path / fmt.STAGING)  # leftovers of crashed runs: partial prompts are redone
    return ZarrStore(path, read_root(path), lock)

"""The zarr v3 directory backend's store: :class:`ZarrStore`, opened by :func:`open_store` and :func:`attach_store`.

One folder per store, one group per prompt, published by renaming it from ``_staging/`` into ``prompts/``; one
run at a time holds the writer lock. Every path built from a name checks the name first and refuses symlinks on
the way. The protocol: ``docs/store-format.md``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from detjac.errors import InvalidArgumentError, StoreError

from .. import format as fmt
from ..analysis_cache import AnalysisCache
from ..integrity import NAME, PROMPT_ID, CorruptError, check_name, check_prompt_id, file_digest, refuse_links
from ..location import store_path
from ..reader import VerifyResult
from ..stored_prompt import LayerwiseSpec, PromptWriter
from ..writer import StoreWriter
from . import failed, lock
from .disk import aside_entries, discard_folder, disk_refusal
from .replace import restore_or_drop
from .sealed import read_sealed, remove_sealed, write_sealed
from .zarr_analyses import ZarrAnalyses
from .zarr_prompt import StoreContext, ZarrPrompt, checked_attrs, verify_prompt
from .zarr_writer import ZarrPromptWriter


class ZarrStore(StoreWriter):
    """A store folder. Use :func:`open_store` (read) or :func:`create_store` (write)."""

    def __init__(self, path: Path, root: dict[str, Any], lock: Any | None = None, lease: str | None = None,
                 fresh: bool = False, replaced: Path | None = None) -> None:
        self.path = path
        self.run = root.get("run", {})
        self.format_version = root["format_version"]
        self.created = root.get("created")
        self.model_sha256 = root.get("model_sha256") or {}
        self._model_metadata = root.get(fmt.MODEL_METADATA)  # None: a store written before it was recorded
        self._model_checked = False  # the model group's metadata is hashed once per handle, on its first read
        self.context = StoreContext(path, self.format_version, self.run)
        self.fresh = fresh  # created by this handle (see discard)
        self.replaced = replaced  # the store --force-new replaced, kept aside until this one holds a prompt
        self.restored: Path | None = None  # set by close(): the replaced store was put back (no prompt was stored)
        self.restored_earlier: Path | None = None  # a killed --force-new run's old store, put back when opened
        self._lock = lock
        self._lease = lease  # set for a worker writing on behalf of the lock holder (attach_store)
        self._analyses = ZarrAnalyses(self)

    @property
    def analyses(self) -> AnalysisCache:
        """Analysis results under ``analysis/<prompt_id>/<name>``, sealed (:class:`~.zarr_analyses.ZarrAnalyses`)."""
        return self._analyses

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

    @contextmanager
    def writing(self) -> Iterator[ZarrStore]:
        """Hold the store's writer lock for the block (a handle opened with :func:`open_store` takes it, one that
        already holds it keeps it): ``detjac lens fit`` and a run never write the same store at once. Raises
        StoreError naming the holder when another process writes the store."""
        if self.writable:
            yield self
            return
        held = lock.acquire(self.path)
        self._lock = held
        try:
            yield self
        finally:
            self._lock = None
            lock.release(held)

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
        check_prompt_id(prompt_id)
        self.check_writer()
        failed.record(self.path, prompt_id, attrs)

    def clear_failure(self, prompt_id: str) -> None:
        failed.clear(self.path, check_prompt_id(prompt_id))

    def clear_staging(self) -> None:
        """Remove the staging folders of attempts that never committed (call when no attempt is running)."""
        self.check_writer()
        shutil.rmtree(refuse_links(self.path, fmt.STAGING), ignore_errors=True)

    def prompt_ids(self) -> list[str]:
        folder = refuse_links(self.path, fmt.PROMPTS)
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if PROMPT_ID.fullmatch(p.name) and (p / "zarr.json").is_file())

    def get(self, prompt_id: str) -> ZarrPrompt:
        path = refuse_links(self.path, fmt.PROMPTS, check_prompt_id(prompt_id))
        if not (path / "zarr.json").is_file():
            failure = self.failures().get(prompt_id)
            if failure is not None:
                raise StoreError(f"Expected a complete prompt {prompt_id!r} in {self.path}. Got a failed one (line "
                                 f"{failure.get('line')}): {failure.get('reason')}")
            raise StoreError(f"Expected a complete prompt {prompt_id!r} in {self.path}. Got none "
                             f"({len(self.prompt_ids())} complete prompts; list them with `detjac store ls`).")
        return ZarrPrompt(path, self.context)

    def prompt_attrs(self, prompt_id: str) -> dict[str, Any]:
        """A prompt's attributes, their types and (format 2) SHA-256 checked; its files are checked when it is
        opened (:meth:`get`). Reads one small file: 15x faster than opening the prompt."""
        path = refuse_links(self.path, fmt.PROMPTS, check_prompt_id(prompt_id))
        if not (path / "zarr.json").is_file():
            return dict(self.get(prompt_id).attrs)  # raises the StoreError that names the prompt
        return checked_attrs(path, self.context, files=False)

    def model_array(self, name: str) -> np.ndarray:
        """``embedding`` (vocab, col), ``unembedding`` (vocab, row) or ``final_norm`` (row,), as stored at creation;
        checked against the SHA-256 recorded then."""
        from .strict import open_group

        check_name(name, "a model array name")
        folder = refuse_links(self.path, fmt.MODEL)
        if not (folder / name / "zarr.json").is_file() or name in fmt.MODEL_FILES.values():
            raise StoreError(f"Expected a model array {name!r} in {self.path}. Got none (stores written without "
                             "the model's matrices cannot decode).")
        self._check_model_metadata(folder)
        values = open_group(folder, f"the model arrays of {self.path}")[name][...]
        self._check_digest(name, values.tobytes())
        return values

    def model_bytes(self, name: str) -> bytes | None:
        """A file kept with the model arrays (``tokenizer.json``), checked against its SHA-256; None if not kept."""
        from .strict import open_group

        if name not in fmt.MODEL_FILES:
            raise InvalidArgumentError(f"Expected one of {', '.join(fmt.MODEL_FILES)}. Got {name!r}.")
        folder = refuse_links(self.path, fmt.MODEL)
        if self.context.sealed:
            array = fmt.MODEL_FILES[name]
            if not (folder / array / "zarr.json").is_file():
                return None
            self._check_model_metadata(folder)
            data = open_group(folder, f"the model arrays of {self.path}")[array][...].tobytes()
        else:
            path = refuse_links(self.path, fmt.MODEL, name)
            if not path.is_file():
                return None
            data = path.read_bytes()
        self._check_digest(name, data)
        return data

    def _check_model_metadata(self, folder: Path) -> None:
        """Raise CorruptError unless every model array's ``zarr.json`` is the one written at creation: the values'
        digest cannot see a same-size edit of a shape or a dtype, which reads the same bytes as other numbers."""
        if self._model_checked or self._model_metadata is None:
            return
        recorded = self._model_metadata if isinstance(self._model_metadata, dict) else {}
        found = {f"{p.parent.name}/zarr.json" for p in folder.glob("*/zarr.json")}
        for rel in sorted(found | set(recorded)):
            path = refuse_links(folder, *rel.split("/"))
            if rel not in recorded or not path.is_file() or file_digest(path) != recorded[rel]:
                raise CorruptError(f"Expected model/{rel} of {self.path} to match the SHA-256 recorded when the "
                                   "store was created. Got " + ("a file not recorded then" if rel not in recorded
                                                                else "none" if not path.is_file() else
                                                                "different bytes") + ": the model arrays would be "
                                   "read with another shape or type.")
        self._model_checked = True

    def _check_digest(self, name: str, data: bytes) -> None:
        import hashlib

        expected = self.model_sha256.get(name)
        if expected is None and not self.context.sealed:
            return  # format 1 stores may predate the digests
        if hashlib.sha256(data).hexdigest() != expected:
            raise CorruptError(f"Expected model/{name} of {self.path} to match the SHA-256 recorded when the store "
                               "was created. Got different bytes: it was changed or damaged, and decoding with it "
                               "would give wrong tokens.")

    def lens_names(self) -> list[str]:
        """Names of the groups under ``lens/`` (the fitted lens, a fit's partial sums): ``detjac.analysis.lens``."""
        folder = refuse_links(self.path, fmt.LENS)
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if NAME.fullmatch(p.name) and (p / "zarr.json").is_file())

    def write_lens(self, name: str, arrays: dict[str, np.ndarray], attrs: dict[str, Any],
                   dims: dict[str, tuple[str, ...]] | None = None) -> None:
        """Store a group under ``lens/<name>``, sealed like an analysis result and replaced atomically."""
        what = f"write lens/{check_name(name, 'a lens group name')} of {self.path}"
        with disk_refusal(what):
            folder = refuse_links(self.path, fmt.LENS)
            fmt.ensure_group(folder)
        write_sealed(folder, name, arrays, attrs, what, dims)

    def read_lens(self, name: str, arrays: bool = True) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(arrays, attrs) of ``lens/<name>``, or None; CorruptError if it changed since it was written."""
        path = refuse_links(self.path, fmt.LENS, check_name(name, "a lens group name"))
        return read_sealed(path, f"lens/{name} of {self.path}", arrays=arrays,
                           hint="Fit the lens again (`detjac lens fit`) to replace it.")

    def remove_lens(self, name: str) -> None:
        """Remove ``lens/<name>`` (crash-safely; nothing if absent)."""
        remove_sealed(refuse_links(self.path, fmt.LENS), name)

    def interrupted_writes(self) -> list[str]:
        """Paths (relative to the store) of what writes killed midway left: ``.NAME.tmp-<pid>`` / ``.NAME.old-<pid>``
        folders of gone processes in ``analysis/``, its prompt folders, ``lens/``, ``failed/`` and ``prompts/``.
        Never read as results; the next write into the same folder removes them."""
        folders = [self.path / name for name in (fmt.ANALYSIS, fmt.LENS, fmt.FAILED, fmt.PROMPTS)]
        analysis = folders[0]  # a symlinked folder is verify's to report (aside_entries never follows one)
        if analysis.is_dir() and not analysis.is_symlink():
            folders += [p for p in sorted(analysis.iterdir()) if p.is_dir() and not p.is_symlink()]
        return [str(p.relative_to(self.path)) for folder in folders for p in aside_entries(folder)]

    def staging_leftovers(self) -> list[str]:
        folder = refuse_links(self.path, fmt.STAGING)
        return sorted(p.name for p in folder.iterdir() if p.name != "zarr.json") if folder.is_dir() else []

    def begin(self, prompt_id: str, *, n_rows: int, n_tokens: int, n_cols: int, dtype: str,
              row_block: int, rank: int | None = None,
              layerwise: dict[str, LayerwiseSpec] | None = None, shard_bytes: int | None = None,
              jacobian: bool = True, graph: bool = False) -> PromptWriter:
        if not self.writable:
            raise StoreError(f"Expected a store opened for writing (create_store). Got {self.path} opened read-only.")
        return ZarrPromptWriter(self, prompt_id, n_rows=n_rows, n_tokens=n_tokens, n_cols=n_cols, dtype=dtype,
                                row_block=row_block, rank=rank, layerwise=layerwise,
                                shard_bytes=shard_bytes, jacobian=jacobian, graph=graph)

    def verify(self, progress: bool = False) -> list[VerifyResult]:
        from detjac.progress import tqdm

        from .verify import verify_store

        ids = self.prompt_ids()
        prompts = [verify_prompt(self.path / fmt.PROMPTS / pid, self.context)
                   for pid in tqdm(ids, desc="verify", unit="prompt", disable=not progress)]
        return prompts + verify_store(self, self.model_sha256, self.context.sealed)

    def discard(self) -> None:
        """Delete this store if this handle created it and it holds no prompt and no failure record (a store it
        replaced, kept aside, goes back whenever this one holds no prompt: see :meth:`close`)."""
        if self.replaced is not None or not self.fresh or self.prompt_ids() or self.failures():
            self.close()
            return
        self.close()
        discard_folder(self.path)

    def close(self) -> None:
        """Release the writer lock (if this store was opened for writing); then settle the store ``--force-new``
        replaced: deleted if this one holds a committed prompt, else put back in its place (``restored``)."""
        if self._lock is not None:
            lock.release(self._lock)  # clears the holder record; closing the file releases its flock
            self._lock = None
        if self.replaced is not None:
            replaced, self.replaced = self.replaced, None
            if restore_or_drop(self.path, replaced):
                self.restored = self.path


def open_store(path: str | os.PathLike[str]) -> ZarrStore:
    """Open a store for reading (works while a writer is running); a path or a ``file://`` URL."""
    path = store_path(path)
    return ZarrStore(path, fmt.read_root(path))


def attach_store(location: str | os.PathLike[str], lease: str) -> ZarrStore:
    """Open a store for writing prompts on behalf of the run that holds its writer lock under ``lease``.

    This is how a run's workers write (``detjac run --scheduler``): they take no lock, and each
    commit checks that the lock file still names ``lease``. Raises StoreError if it does not.
    """
    path = store_path(location)
    lock.check_lease(path, lease)
    return ZarrStore(path, fmt.read_root(path), lease=lease)

"""The zarr v3 directory backend, reading side: one folder per store, one group per prompt.

Crash safety comes from the file system: a prompt is written into ``_staging/<id>.<pid>``
and renamed into ``prompts/<id>`` only after every chunk and its attributes are on disk
(``os.rename`` of a directory is atomic on POSIX), so readers, who only list ``prompts/``,
see it complete or not at all. Writing lives in ``zarr_writer.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, StoreError, StoreFormatError
from . import failed, lock
from . import format as fmt
from .base import JacobianStore, LayerwiseSpec, PromptWriter, StoredPrompt, VerifyResult

# Relative reconstruction error above which verify calls a prompt corrupt, by compute dtype.
DTYPE_BOUND = {"float64": 1e-9, "float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}


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

    @property
    def layerwise_targets(self) -> list[str]:
        """Names of the layerwise Jacobians stored with this prompt (``layer.3``, ``mlp_local.0``, ...)."""
        if fmt.LAYERWISE not in self._group:
            return []
        return sorted(self._group[fmt.LAYERWISE].group_keys(), key=_target_order)

    def layerwise(self, target: str, array: str = "jacobian", lazy: bool = True) -> Any:
        """A layerwise target's ``jacobian`` (row, token, col; lazy dask by default), ``output`` (row,) -- the
        value it reconstructs -- or, for ``*_local`` targets, ``inputs`` (token, col), the layer's input."""
        if target not in self.layerwise_targets:
            raise InvalidArgumentError(f"Expected a layerwise target of prompt {self.id} "
                                       f"({', '.join(self.layerwise_targets) or 'none stored'}). Got {target!r}.")
        group = self._group[f"{fmt.LAYERWISE}/{target}"]
        if array not in group.array_keys():
            raise InvalidArgumentError(f"Expected one of {', '.join(sorted(group.array_keys()))} for {target}. "
                                       f"Got {array!r}.")
        if array == "jacobian" and lazy:
            import dask.array as da

            return da.from_zarr(group[array])
        return group[array][...]

    def layerwise_info(self, target: str) -> dict[str, Any]:
        """``layer``, ``component``, ``local``, ``mode`` and ``reconstruction_error`` of a layerwise target."""
        self.layerwise(target, "output")
        return {**dict(self._group[f"{fmt.LAYERWISE}/{target}"].attrs),
                **self.attrs.get("layerwise", {}).get(target, {})}

    def array(self, name: str) -> np.ndarray:
        names = sorted(set(self._group.array_keys()) - {"jacobian"})
        if name not in names:
            raise InvalidArgumentError(f"Expected one of {', '.join(names)}. Got {name!r}.")
        return self._group[name][...]


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

        from .zarr_writer import disk_error

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
        from .zarr_writer import ZarrPromptWriter

        return ZarrPromptWriter(self, prompt_id, n_rows=n_rows, n_tokens=n_tokens, n_cols=n_cols, dtype=dtype,
                                row_block=row_block, rank=rank, layerwise=layerwise,
                                shard_bytes=shard_bytes)

    def verify(self, progress: bool = False) -> list[VerifyResult]:
        from tqdm import tqdm

        ids = self.prompt_ids()
        return [verify_prompt(self.path / fmt.PROMPTS / pid) for pid in tqdm(ids, desc="verify", unit="prompt",
                                                                              disable=not progress)]

    def close(self) -> None:
        """Release the writer lock (if this store was opened for writing)."""
        if self._lock is not None:
            lock.release(self._lock)  # clears the holder record; closing the file releases its flock
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
        if "bias" in prompt._group.array_keys():  # an affine model: y = sum_k J_k x_k + b
            recon += prompt.array("bias").astype(np.float64)
    except Exception as exc:  # noqa: BLE001 - any decode failure means the prompt is corrupt
        return VerifyResult(pid, False, None, f"unreadable: {type(exc).__name__}: {exc}")
    error = _relative(recon, y)
    stored = float(prompt.attrs.get("reconstruction_error", 0.0))
    bound = DTYPE_BOUND.get(prompt.attrs.get("dtype", "float64"), 1e-9)
    for target in prompt.layerwise_targets:  # each reconstructs its own output, within the same bound
        try:
            t_error = _layerwise_error(prompt, target, x)
        except Exception as exc:  # noqa: BLE001
            return VerifyResult(pid, False, error, f"layerwise {target} unreadable: {type(exc).__name__}: {exc}")
        t_stored = float(prompt.attrs.get("layerwise", {}).get(target, {}).get("reconstruction_error", 0.0))
        t_bound = max(bound, 10 * t_stored)
        if prompt.attrs.get("detached") is not False and (not np.isfinite(t_error) or t_error > t_bound):
            return VerifyResult(pid, False, error, f"layerwise {target}: reconstruction error {t_error:.3e} "
                                                   f"above {t_bound:.1e}")
    if prompt.attrs.get("detached") is False:  # an ordinary Jacobian: it must reproduce its stored error
        if not np.isfinite(error) or abs(error - stored) > bound * max(1.0, stored):
            return VerifyResult(pid, False, error, f"reconstruction error {error:.3e} differs from the stored "
                                                   f"{stored:.3e}")
        return VerifyResult(pid, True, error)
    bound = max(bound, 10 * stored)
    if not np.isfinite(error) or error > bound:
        return VerifyResult(pid, False, error, f"reconstruction error {error:.3e} above {bound:.1e}")
    return VerifyResult(pid, True, error)


def _relative(recon: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(recon - y) / max(np.linalg.norm(y), np.finfo(np.float64).tiny))


def _layerwise_error(prompt: ZarrPrompt, target: str, embeddings: np.ndarray) -> float:
    """``|| sum_k J_k x_k - output || / || output ||`` of one layerwise target, chunk by chunk."""
    arr = prompt._group[f"{fmt.LAYERWISE}/{target}/jacobian"]
    local = "inputs" in prompt._group[f"{fmt.LAYERWISE}/{target}"].array_keys()
    x = prompt.layerwise(target, "inputs").astype(np.float64) if local else embeddings
    y = prompt.layerwise(target, "output").astype(np.float64)
    recon = np.zeros_like(y)
    rows, tokens = arr.chunks[0], arr.chunks[1]
    for r in range(0, arr.shape[0], rows):
        for k in range(0, arr.shape[1], tokens):
            block = arr[r:r + rows, k:k + tokens].astype(np.float64)
            recon[r:r + rows] += np.einsum("rtc,tc->r", block, x[k:k + tokens])
    return _relative(recon, y)


def _target_order(name: str) -> tuple[int, str]:
    """``layer.2`` before ``layer.10``; the component breaks ties."""
    component, _, layer = name.rpartition(".")
    return (int(layer), component) if layer.lstrip("-").isdigit() else (1 << 30, name)


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
    """Open a store for reading (works while a writer is running); a path or a ``file://`` URL."""
    from .location import store_path

    path = store_path(path)
    return ZarrStore(path, read_root(path))

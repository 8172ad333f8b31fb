"""A zarr store that never hands back a fill value for a chunk that should be on disk.

zarr reads an absent chunk as the array's fill value: right for sparse arrays, wrong for a
store whose every chunk was written (format 2 writes them all, ``write_empty_chunks``). Readers
open prompts and analysis results through :class:`StrictLocalStore`, so a deleted chunk raises
:class:`~detjac.store.integrity.CorruptError` on read instead of reading back as zeros. A
module of its own (importing zarr) so that the class pickles for dask workers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zarr.storage import LocalStore

from .integrity import CorruptError, is_chunk_key, refuse_links


class StrictLocalStore(LocalStore):
    """A read-only :class:`zarr.storage.LocalStore` that refuses absent chunks and chunks reached through a symlink.

    Parameters
    ----------
    root : Path
        The group's folder.
    what : str
        What the folder holds, for messages ("prompt 3f2a... in run.zarr").
    allow_missing : callable or None
        ``key -> bool``: chunks that may be absent (format-1 stores skipped all-zero chunks of
        some arrays); None: none may.
    """

    def __init__(self, root: Path | str, *, read_only: bool = True, what: str = "",
                 allow_missing: Callable[[str], bool] | None = None) -> None:
        super().__init__(root, read_only=True)
        self.what, self.allow_missing = what or str(root), allow_missing

    def with_read_only(self, read_only: bool = False) -> StrictLocalStore:
        return type(self)(self.root, what=self.what, allow_missing=self.allow_missing)

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        chunk = is_chunk_key(key)
        if chunk:
            refuse_links(Path(self.root), *key.split("/"))
        value = await super().get(key, prototype, byte_range)
        if value is None and chunk and not (self.allow_missing is not None and self.allow_missing(key)):
            raise CorruptError(f"Expected chunk {key} of {self.what}. Got none: the file is missing, so the data "
                               "is damaged (`detjac store verify` lists everything that is).")
        return value


def open_group(root: Path, what: str, allow_missing: Callable[[str], bool] | None = None) -> Any:
    """The zarr v3 group at ``root``, read-only, through a :class:`StrictLocalStore`.

    Consolidated metadata (kept in a prompt's ``zarr.json`` for xarray) is not used: it lies outside
    the seal, so every array's metadata is read from its own sealed ``zarr.json``.
    """
    import zarr

    return zarr.open_group(store=StrictLocalStore(root, what=what, allow_missing=allow_missing), mode="r",
                           zarr_format=3, use_consolidated=False)


SPARSE_IN_FORMAT_1 = ("bias", "token_residual_sq")  # arrays that may be all zero: an exact subspace, no offset


def sparse_layerwise(key: str) -> bool:
    """Chunks a format-1 prompt may lack: it skipped all-zero chunks, which a layerwise Jacobian has where a token
    cannot reach the target (sliding-window attention), and which ``bias`` or ``token_residual_sq`` may be."""
    parts = key.split("/")
    if len(parts) >= 4 and parts[0] == "layerwise" and parts[2:4] == ["jacobian", "c"]:
        return True
    return len(parts) >= 2 and parts[0] in SPARSE_IN_FORMAT_1 and parts[1] == "c"


def sparse_any(key: str) -> bool:
    """Any chunk may be absent (a format-1 analysis result: all-zero chunks were skipped)."""
    return True

"""A zarr store that raises CorruptError for a chunk that should be on disk and is absent or fails its crc32c,
where zarr would read the fill value or raise a bare ``ValueError`` inside a dask task (``docs/store-format.md``,
"Every chunk is written"). A module of its own (importing zarr) so that the class pickles for dask workers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zarr.storage import LocalStore

from detjac.safe_json import read_json

from ..integrity import CorruptError, is_chunk_key, refuse_links


class StrictLocalStore(LocalStore):
    """A read-only :class:`zarr.storage.LocalStore` that refuses absent chunks and any key reached through a symlink.

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
        # metadata too: a zarr.json linked outside the store would be read as the array's shape and codecs
        refuse_links(Path(self.root), *key.split("/"))
        value = await super().get(key, prototype, byte_range)
        if value is None and chunk and not (self.allow_missing is not None and self.allow_missing(key)):
            raise CorruptError(f"Expected chunk {key} of {self.what}. Got none: the file is missing, so the data "
                               "is damaged (`detjac store verify` lists everything that is).")
        if value is not None and chunk:
            layout = self._layout(key)
            if layout is not None and not _intact(value.as_numpy_array(), layout, whole=byte_range is None):
                raise CorruptError(f"Expected chunk {key} of {self.what} to match its crc32c checksum. Got bytes that "
                                   "do not, so the data is damaged (`detjac store verify` lists everything that is)."
                                   ) from CorruptError(f"chunk {key} fails its crc32c checksum")
        return value

    def _layout(self, key: str) -> dict[str, Any] | None:
        """How the array holding chunk ``key`` checksums its bytes (read once per array): None where it does not."""
        array = key.rsplit("/c/", 1)[0] if "/c/" in key else key[: -len("c")].rstrip("/")
        known = self.__dict__.setdefault("_layouts", {})
        if array not in known:
            try:
                meta = read_json(Path(self.root) / array / "zarr.json")
            except (OSError, ValueError) as exc:
                raise CorruptError(f"Expected the metadata of array {array or '.'} of {self.what}. Got an unreadable "
                                   f"one: {exc}") from exc
            known[array] = _checksum_layout(meta if isinstance(meta, dict) else {})
        return known[array]


def _ends_in_crc(codecs: Any) -> bool:
    last = codecs[-1] if isinstance(codecs, list) and codecs else None
    return isinstance(last, dict) and last.get("name") == "crc32c"


def _checksum_layout(meta: dict[str, Any]) -> dict[str, Any] | None:
    """``{"shard": False}`` for chunks ending in a crc32c; for shards whose index and inner chunks both do,
    ``{"shard": True, "index_bytes": ..., "index_at_end": ...}``; None for anything else (not checked here)."""
    codecs = meta.get("codecs")
    if _ends_in_crc(codecs):
        return {"shard": False}
    first = codecs[0] if isinstance(codecs, list) and codecs else None
    if not (isinstance(first, dict) and first.get("name") == "sharding_indexed"):
        return None
    config = first.get("configuration") or {}
    outer = ((meta.get("chunk_grid") or {}).get("configuration") or {}).get("chunk_shape")
    inner = config.get("chunk_shape")
    if not (_ends_in_crc(config.get("codecs")) and _ends_in_crc(config.get("index_codecs"))
            and isinstance(outer, list) and isinstance(inner, list) and len(outer) == len(inner)):
        return None
    count = 1
    for o, i in zip(outer, inner, strict=True):
        count *= -(-int(o) // max(int(i), 1))
    return {"shard": True, "index_bytes": 16 * count + 4, "index_at_end": config.get("index_location", "end") == "end"}


def _crc_ok(blob: Any) -> bool:
    import google_crc32c
    import numpy as np

    return len(blob) >= 4 and np.uint32(google_crc32c.value(blob[:-4])).tobytes() == blob[-4:].tobytes()


def _intact(data: Any, layout: dict[str, Any], whole: bool) -> bool:
    """Whether bytes read from a chunk file match their checksums: the whole chunk; for a shard, a part read by
    byte range (its index or one inner chunk, each ending in its own crc32c) or the whole shard (index, then every
    inner chunk the index points at)."""
    import numpy as np

    if not layout["shard"]:  # zarr reads such a chunk whole; a part of one carries no checksum of its own
        return not whole or _crc_ok(data)
    if not whole:
        return _crc_ok(data)
    size = layout["index_bytes"]
    if len(data) < size:
        return False
    index = data[len(data) - size:] if layout["index_at_end"] else data[:size]
    if not _crc_ok(index):
        return False
    empty = 2**64 - 1
    for offset, nbytes in np.frombuffer(index[:-4].tobytes(), dtype="<u8").reshape(-1, 2).tolist():
        if offset == empty and nbytes == empty:
            continue  # an inner chunk never written
        if offset + nbytes > len(data) or not _crc_ok(data[offset:offset + nbytes]):
            return False
    return True


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

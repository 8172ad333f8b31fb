"""Failure records ``failed/<prompt_id>``: a sealed zarr group saying which prompt a run could not compute and why,
renamed into place, and removed when the prompt is committed (``docs/store-format.md``, "Failure records").
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from detjac.errors import StoreError
from detjac.safe_json import read_json

from .. import format as fmt
from ..integrity import INTEGRITY, PROMPT_ID, attrs_digest, check_prompt_id, check_seal, read_attrs, refuse_links
from .disk import disk_refusal, new_folder


def record(store_path: Path, prompt_id: str, attrs: dict[str, Any]) -> None:
    """Write (or replace) the failure record of ``prompt_id``."""
    import zarr

    folder = refuse_links(store_path, fmt.FAILED)
    final = folder / check_prompt_id(prompt_id)
    what = f"record the failure of prompt {prompt_id} in {store_path}"
    with disk_refusal(what):
        if not (folder / "zarr.json").is_file():
            zarr.open_group(str(folder), mode="a", zarr_format=3)
        tmp = new_folder(final)  # new, under an unpredictable name: never a link planted there
    with disk_refusal(what, lambda: shutil.rmtree(tmp, ignore_errors=True)):
        group = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        record = {**attrs, "failed_at": fmt.now()}
        group.attrs.update({**record, INTEGRITY: {"attrs_sha256": attrs_digest(record), "files": {}}})
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)


def read_all(store_path: Path) -> dict[str, dict[str, Any]]:
    """Every failure record, by prompt id (sorted)."""
    folder = refuse_links(store_path, fmt.FAILED)
    if not folder.is_dir():
        return {}
    records = {}
    for entry in sorted(folder.iterdir()):
        meta = entry / "zarr.json"
        if not PROMPT_ID.fullmatch(entry.name) or entry.is_symlink() or not meta.is_file():
            continue  # temporary names; anything else is reported by verify
        try:
            attrs = read_json(meta).get("attributes", {})
        except (OSError, ValueError, AttributeError) as exc:
            raise StoreError(f"Expected a readable failure record at {meta}. Got: {exc}.") from exc
        records[entry.name] = {k: v for k, v in attrs.items() if k != INTEGRITY}
    return records


def check(store_path: Path, prompt_id: str) -> None:
    """Raise CorruptError unless the record of ``prompt_id`` is as written (format 2 records are sealed)."""
    check_seal(refuse_links(store_path, fmt.FAILED, prompt_id), read_attrs(store_path / fmt.FAILED / prompt_id),
               hashes=True)


def clear(store_path: Path, prompt_id: str) -> None:
    """Remove the failure record of ``prompt_id``, if any."""
    shutil.rmtree(refuse_links(store_path, fmt.FAILED, check_prompt_id(prompt_id)), ignore_errors=True)

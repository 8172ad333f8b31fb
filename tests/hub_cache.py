"""A Hugging Face hub cache fabricated on disk, in the hub's own layout, so hub ids resolve with no network.

``models--org--name/blobs/<hash>`` holds each file once (LFS files under their SHA-256, the others under
their git blob SHA-1, as the hub names them), ``refs/main`` the commit, and
``snapshots/<commit>/<file>`` is a relative symlink to the blob.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fabricate_hub_cache(cache: Path, repo_id: str, folder: Path, *, commit: str | None = None,
                        ref: str = "main", files: dict[str, bytes] | None = None) -> Path:
    """Put every file of ``folder`` (or ``files``: name -> bytes) into ``cache`` as snapshot ``commit`` of
    ``repo_id`` under the ref ``ref``; returns the snapshot folder."""
    contents = files if files is not None else {p.name: p.read_bytes() for p in sorted(folder.iterdir())
                                                if p.is_file()}
    commit = commit or hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in
                                                contents.items())).encode()).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        blob = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_sha1(data)
        (repo / "blobs" / blob).write_bytes(data)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.join("..", "..", "blobs", blob), link)
    (repo / "refs" / ref).write_text(commit)
    return snapshot

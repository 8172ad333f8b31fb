"""Where a store lives: a path or an fsspec URL, resolved to the file system the store protocol needs.

The commit protocol (a prompt group renamed into place, ``flock`` on the writer lock, fsync)
needs a POSIX file system: a local disk or a shared one mounted on every worker (NFS v4,
Lustre, GPFS, CephFS). Such a store is named by a path or a ``file://`` URL. Object stores
(``s3://``, ``gs://``, ...) have no atomic rename and no locks; what a backend for them needs
is written down in ``docs/store-format.md`` ("Object stores"), and their URLs are refused here
with that pointer rather than written half-safely.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import StoreError

LOCAL_PROTOCOLS = (None, "file", "local")


def store_path(location: str | os.PathLike[str]) -> Path:
    """The local path of a store given as a path or a ``file://`` / ``local://`` URL.

    Raises StoreError for URLs of other fsspec file systems (object stores, http, ...).
    """
    if isinstance(location, Path):
        return location
    from fsspec.core import split_protocol

    text = os.fspath(location)
    protocol, rest = split_protocol(text)
    if protocol not in LOCAL_PROTOCOLS:
        raise StoreError(f"Expected a store on a POSIX file system (a path, or a file:// URL of a folder shared by "
                         f"every worker). Got {text!r} ({protocol}:// has no atomic rename or lock, which the "
                         "store's commit protocol needs; see 'Object stores' in docs/store-format.md).")
    if protocol is None:
        return Path(text)
    host = urlsplit(text).netloc
    if host not in ("", "localhost"):  # fsspec drops the host: file://host/path would be ./host/path here
        raise StoreError(f"Expected a {protocol}:// URL without a host (file:///path/to/store.zarr, three slashes). "
                         f"Got {text!r}, naming the host {host!r}: a store is written on this machine's file "
                         "system only.")
    from fsspec.core import url_to_fs

    return Path(url_to_fs(text)[1])

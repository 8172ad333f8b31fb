"""Writer locks: one run writes a store at a time (an exclusive ``flock`` on ``_writer/zarr.json``, its holder record
in that file), and its workers write under its lease (``docs/store-format.md``, "One run writes"). :func:`hold` is the
primitive, also used for a lock file of another name (a neuron index's, kept beside its folder).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detjac.errors import StoreError
from detjac.safe_json import parse_json

from .. import format as fmt
from .disk import disk_error


def lock_file(path: Path) -> Path:
    """The lock file of the store at ``path``: format 1's ``.writer.lock`` where there is one, else
    ``_writer/zarr.json``."""
    legacy = path / fmt.LOCK
    return legacy if legacy.is_file() and not legacy.is_symlink() else path / fmt.WRITER / "zarr.json"


def acquire(path: Path) -> Held:
    """Take the writer lock of the store at ``path`` and record this process as its holder.

    Returns the lock as held (give it to :func:`release`); raises StoreError naming the holder
    if another process holds it.
    """
    file = lock_file(path)
    if file.parent.is_symlink() or file.is_symlink():
        raise StoreError(f"Expected no symlinks inside the store {path}. Got {file} reached through one.")
    try:  # a read-only store (or file system) fails here first: one line, as a run's writes say it
        file.parent.mkdir(exist_ok=True)
    except OSError as exc:
        raise disk_error(exc, f"take the writer lock of the store {path}") from exc
    return hold(file, str(path), plain=file.name == fmt.LOCK,
                inside="detjac writes only inside the store")


def hold(file: Path, what: str, plain: bool = True, inside: str = "detjac writes its own lock file only") -> Held:
    """Take an exclusive ``flock`` on ``file`` (created if absent; never through a symlink or a hard link) for the
    whole of a run writing ``what``, and record this process in it: a JSON holder record (``plain``) or a zarr
    group's metadata holding one (a store's ``_writer/zarr.json``).

    Raises StoreError naming the holder (pid, host, since) and ``file`` when another process holds it; ``inside``
    says why a file that is not a regular one is refused.
    """
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise disk_error(exc, f"take the writer lock of {what}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # written in place: never through a hard link
        os.close(fd)
        raise StoreError(f"Expected the lock file of {what} at {file}. Got "
                         + ("something that is not a regular file" if not stat.S_ISREG(info.st_mode) else
                            f"a file with {info.st_nlink} hard links (the same file as one elsewhere)")
                         + f": {inside}. Remove it and run again.")
    handle = os.fdopen(fd, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        handle.close()
        raise StoreError(f"Expected no other writer on {what}. Got one running ({describe(read_holder(file))}; it "
                         f"holds {file}); wait for it to finish or write to another --out.") from exc
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": fmt.now(), "lease": secrets.token_hex(8)}
    held = Held(handle, file, plain)
    _rewrite(handle, held.encode(record))
    return held


@dataclass
class Held:
    """A writer lock as held: the open lock file (closing it releases the flock), its path, and whether it holds a
    plain JSON record or a zarr group's metadata."""

    handle: Any
    file: Path
    plain: bool

    def encode(self, record: dict[str, Any] | None) -> str:
        if self.plain:
            return json.dumps(record) if record else ""
        return fmt.group_meta({"holder": record} if record else {})


def _rewrite(handle: Any, text: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(text)
    handle.flush()


def release(held: Held) -> None:
    """Clear the holder record and release the lock (a later check of the old lease fails)."""
    _rewrite(held.handle, held.encode(None))
    held.handle.close()


def holder(path: Path) -> dict[str, Any] | None:
    """The holder record of the store at ``path``, or None when no writer holds it (or it predates records)."""
    return read_holder(lock_file(path))


def read_holder(file: Path) -> dict[str, Any] | None:
    """The holder record in the lock file ``file`` (plain JSON or a zarr group's metadata), or None."""
    try:
        text = file.read_text()
    except OSError:
        return None
    try:
        record = parse_json(text) if text.strip() else None
    except ValueError:
        return None
    if isinstance(record, dict) and "attributes" in record:
        record = record.get("attributes", {}).get("holder")
    return record if isinstance(record, dict) else None


def describe(record: dict[str, Any] | None) -> str:
    if record is None:
        return "a writer that left no record"
    return f"pid {record.get('pid')} on host {record.get('host')}, since {record.get('since')}"


def check_lease(path: Path, lease: str) -> None:
    """Raise StoreError unless the store's writer lock is still held under ``lease``."""
    record = holder(path)
    if record is None or record.get("lease") != lease:
        now_held = describe(record) if record is not None else "no writer"
        raise StoreError(f"Expected the store {path} to be held by the run that sent this prompt (lease {lease}). "
                         f"Got {now_held}: that run has ended or another took over, so this prompt is left "
                         "to the run that holds the store now.")

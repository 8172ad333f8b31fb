"""What makes a store refuse damaged data: names checked before they become paths (:func:`check_prompt_id`,
:func:`check_name`), seals (:func:`seal`, :func:`check_seal`), and strict chunk reads
(:class:`detjac.store.backend.strict.StrictLocalStore`). The rules: docs/store-format.md, "Integrity"."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError, StoreError
from ..safe_json import read_json

INTEGRITY = "integrity"  # the attribute holding a group's seal
PROMPT_ID = re.compile(r"[0-9a-f]{16}")
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
HASH_BLOCK = 1 << 22


class CorruptError(StoreError):
    """Stored data that no longer is what was written: a missing or changed file, attribute or chunk."""


def damage_reason(exc: BaseException) -> str:
    """What is wrong, in short: for a reader's "Expected an intact ... Got a damaged one" CorruptError, the damage
    it was raised from; for any other error, its own message."""
    cause = exc.__cause__
    return str(cause) if isinstance(exc, CorruptError) and isinstance(cause, CorruptError) else str(exc)


def check_prompt_id(prompt_id: object) -> str:
    """``prompt_id`` if it is 16 lower-case hex digits (a prompt id of a detjac store); else InvalidArgumentError."""
    if not isinstance(prompt_id, str) or not PROMPT_ID.fullmatch(prompt_id):
        raise InvalidArgumentError(f"Expected a prompt id of 16 hex digits (as `detjac store ls` lists them). "
                                   f"Got {prompt_id!r}.")
    return prompt_id


def check_name(name: object, what: str) -> str:
    """``name`` if it is a safe single path component (letters, digits, ``_ . -``; no leading dot, no ``..``)."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise InvalidArgumentError(f"Expected {what} made of letters, digits, '_', '.' and '-' (not starting with "
                                   f"'.', at most 128 characters). Got {name!r}.")
    return name


def digest_json(value: Any) -> str:
    """SHA-256 of ``value`` as canonical JSON (sorted keys, no spaces, UTF-8)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def attrs_digest(attrs: dict[str, Any]) -> str:
    """SHA-256 of a group's attributes, its seal left out."""
    return digest_json({k: v for k, v in attrs.items() if k != INTEGRITY})


def file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(HASH_BLOCK):
            sha.update(block)
    return sha.hexdigest()


def tree(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """Files under ``folder`` by path relative to it (its own ``zarr.json`` aside), and the symlinks found."""
    files: dict[str, Path] = {}
    links: list[str] = []
    for here, dirs, names in os.walk(folder):
        base = Path(here)
        for name in sorted(dirs):
            if (base / name).is_symlink():
                links.append((base / name).relative_to(folder).as_posix())
        for name in names:
            path = base / name
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                links.append(rel)
            elif rel != "zarr.json":
                files[rel] = path
    return files, sorted(links)


def seal(folder: Path, attrs: dict[str, Any]) -> dict[str, Any]:
    """The ``integrity`` record of a group about to be committed: its attributes' and every file's SHA-256."""
    files, links = tree(folder)
    if links:
        raise StoreError(f"Expected no symlinks in {folder}. Got {', '.join(links)}.")
    return {"attrs_sha256": attrs_digest(attrs),
            "files": {rel: [path.stat().st_size, file_digest(path)] for rel, path in sorted(files.items())}}


def check_seal(folder: Path, attrs: dict[str, Any], *, hashes: bool) -> None:
    """Raise CorruptError unless the group at ``folder`` is what its seal says.

    Parameters
    ----------
    folder : Path
        The group's folder.
    attrs : dict
        Its attributes, ``integrity`` included.
    hashes : bool
        Also hash every file (what ``verify`` does); without, the names and sizes of the chunks are compared (a
        ``stat`` per file) and only the metadata files are hashed: a same-size edit of an array's ``zarr.json``
        (its chunk-key separator, a shape digit) would otherwise make every read miss or misplace its chunks.
    """
    record = check_attrs_seal(folder, attrs)
    files, links = tree(folder)
    if links:
        raise CorruptError(f"symlinks inside the store are refused: {', '.join(links)}")
    expected = record["files"]
    missing = sorted(set(expected) - set(files))
    if missing:
        raise CorruptError(f"missing file{'s' * (len(missing) > 1)} {', '.join(missing[:5])}"
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    extra = sorted(set(files) - set(expected))
    if extra:
        raise CorruptError(f"unexpected file{'s' * (len(extra) > 1)} {', '.join(extra[:5])}"
                           + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    for rel, path in files.items():
        size, sha = _entry(expected[rel], rel)
        if path.stat().st_size != size:
            raise CorruptError(f"file {rel} has {path.stat().st_size} bytes, {size} when written")
        if (hashes or is_metadata(rel)) and file_digest(path) != sha:
            raise CorruptError(f"file {rel} changed since commit (its SHA-256 differs)")


def check_hashes(folder: Path, attrs: dict[str, Any], prefix: str) -> None:
    """Raise CorruptError unless every file its seal lists under ``prefix`` (e.g. ``graph/``) of the group at
    ``folder`` has the SHA-256 it was committed with: what :func:`check_seal` without ``hashes`` leaves out, for
    arrays whose chunks an equal-sized swap (another array's, another prompt's) would otherwise pass."""
    for rel, entry in sorted(check_attrs_seal(folder, attrs)["files"].items()):
        if rel.startswith(prefix) and not is_metadata(rel):
            sha = _entry(entry, rel)[1]
            path = folder / rel
            if path.is_symlink() or not path.is_file():
                raise CorruptError(f"missing file {rel}")
            if file_digest(path) != sha:
                raise CorruptError(f"file {rel} changed since commit (its SHA-256 differs)")


def check_attrs_seal(folder: Path, attrs: dict[str, Any]) -> dict[str, Any]:
    """The group's integrity record, once its attributes are checked against the SHA-256 it holds (raises
    CorruptError); the files are :func:`check_seal`'s part."""
    record = attrs.get(INTEGRITY)
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise CorruptError(f"Expected an integrity record in the attributes of {folder}. Got {record!r}.")
    if record.get("attrs_sha256") != attrs_digest(attrs):
        raise CorruptError("attributes changed since commit (their SHA-256 differs from the one written then)")
    return record


def _entry(entry: Any, rel: str) -> tuple[int, str]:
    if (not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int
            or not isinstance(entry[1], str)):
        raise CorruptError(f"Expected [size, sha256] for {rel} in the integrity record. Got {entry!r}.")
    return entry[0], entry[1]


def refuse_links(root: Path, *parts: str) -> Path:
    """``root / parts``, after checking that no component below ``root`` is a symlink."""
    path = root
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise StoreError(f"Expected no symlinks inside the store {root}. Got {path} -> {os.readlink(path)}; "
                             "detjac reads and writes only inside the store.")
    return path


def is_metadata(rel: str) -> bool:
    """Whether a path inside a group is zarr metadata (an array's or a subgroup's ``zarr.json``), which every read
    of the arrays under it depends on."""
    return rel == "zarr.json" or rel.endswith("/zarr.json")


def content_digest(attrs: dict[str, Any]) -> str | None:
    """SHA-256 of a sealed group's integrity record (its attributes' and every file's SHA-256): what a result
    computed from the group was computed from; None for a group without a seal (format 1)."""
    record = attrs.get(INTEGRITY)
    return digest_json(record) if isinstance(record, dict) else None


def is_chunk_key(key: str) -> bool:
    """Whether a zarr v3 key names a chunk (``.../c/0/1``, ``.../c``) rather than metadata."""
    return "/c/" in f"/{key}" or key == "c" or key.endswith("/c")


def read_attrs(folder: Path) -> dict[str, Any]:
    """The attributes of the zarr group at ``folder``, parsed from its ``zarr.json`` (raises CorruptError)."""
    try:
        meta = read_json(folder / "zarr.json")
    except (OSError, ValueError) as exc:
        raise CorruptError(f"unreadable zarr.json: {exc}") from exc
    attrs = meta.get("attributes") if isinstance(meta, dict) else None
    if not isinstance(attrs, dict) or meta.get("node_type") != "group":
        raise CorruptError("zarr.json is not the metadata of a group with attributes")
    return attrs

"""What a run's weights are: the SHA-256 of every weight file of its checkpoint, so a store knows its weights.

A run's identity (see ``docs/store-format.md``) holds ``weights_sha256``, one digest of the
per-file digests, and its description the per-file digests themselves (``weights``), so that
resuming a store after the weights changed is refused with the file that differs.

Where a file's SHA-256 comes from:

- a file of the Hugging Face cache is a symlink to ``blobs/<sha256>`` for LFS files (every weight
  file): the hub's own hash, read from the blob's name, with nothing read;
- any other file is hashed once and the digest kept in a small JSON cache keyed by the file's
  resolved path, size and modification time (``$DETJAC_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/detjac``, else ``~/.cache/detjac``: ``weights-sha256.json``); a file whose
  size or time changed is hashed again, an unchanged one never. An unwritable cache only costs
  the hashing again next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

# The files a checkpoint's weights are read from (the loaders prefer safetensors; .bin when there are none).
SAFETENSORS = ("*.safetensors", "*.safetensors.index.json")
PICKLES = ("*.bin", "*.bin.index.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")
CACHE_FILE = "weights-sha256.json"


def cache_dir() -> Path:
    """Where file digests are kept: ``$DETJAC_CACHE_DIR``, else ``$XDG_CACHE_HOME/detjac``, else ``~/.cache/detjac``."""
    explicit = os.environ.get("DETJAC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "detjac"


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder, sorted: its safetensors (and index), else its .bin files; a GGUF
    file is its own one weight file."""
    if folder.is_file():
        return [folder]
    for patterns in (SAFETENSORS, PICKLES):
        files = sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file()})
        if files:
            return files
    return []


def hub_blob_sha256(path: Path) -> str | None:
    """The SHA-256 the Hugging Face cache names a file's blob by (LFS files), or None for another file."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    return target.name if target.parent.name == "blobs" and _SHA256.fullmatch(target.name) else None


class DigestCache:
    """File digests by resolved path, valid while the file's size and modification time are unchanged."""

    def __init__(self, folder: Path | None = None) -> None:
        self.file = (folder or cache_dir()) / CACHE_FILE
        try:
            entries = json.loads(self.file.read_text())
        except (OSError, ValueError):
            entries = {}
        self.entries: dict[str, dict[str, object]] = entries if isinstance(entries, dict) else {}
        self.hashed: list[Path] = []  # files read and hashed by this instance (the others came from the cache)

    def sha256(self, path: Path) -> str:
        stat, key = path.stat(), str(path.resolve())
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
            return str(entry["sha256"])
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(2**22), b""):
                digest.update(chunk)
        self.entries[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()}
        self.hashed.append(path)
        return digest.hexdigest()

    def save(self) -> None:
        """Write the cache (atomically: a temporary file renamed); a cache that cannot be written is skipped."""
        if not self.hashed:
            return
        with contextlib.suppress(OSError):
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_name(f".{self.file.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
            os.replace(tmp, self.file)


def weights_fingerprint(folder: str | Path, cache: DigestCache | None = None) -> dict[str, str]:
    """``{file name: sha256}`` of a checkpoint folder's weight files (the hub's hash where the cache has one)."""
    cache = cache or DigestCache()
    out = {p.name: hub_blob_sha256(p) or cache.sha256(p) for p in weight_files(Path(folder))}
    cache.save()
    return out


def combined_digest(files: dict[str, str]) -> str:
    """One SHA-256 of the per-file digests (names and hashes, sorted): the ``weights_sha256`` of a run."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def weights_identity(folder: str | Path | None) -> dict[str, object]:
    """The run description's ``weights`` (per file) and ``weights_sha256`` (identity) of a checkpoint folder or a
    GGUF file (and, for a GGUF, ``gguf_types``: its tensors' quantization types); nothing for a model that is
    neither."""
    if folder is None:
        return {}
    files = weights_fingerprint(folder)
    identity: dict[str, object] = {"weights": files, "weights_sha256": combined_digest(files)} if files else {}
    if Path(folder).is_file():
        from detjac.engine.gguf import read_header

        identity["gguf_types"] = read_header(Path(folder)).quantization_types()
    return identity


def weights_difference(stored: dict[str, object], wanted: dict[str, object]) -> str | None:
    """The weight files whose SHA-256 differs between a store's run and this one, as text; None when both runs
    fingerprinted the same files (or either did not)."""
    old, new = stored.get("weights"), wanted.get("weights")
    if not isinstance(old, dict) or not isinstance(new, dict) or old == new:
        return None
    return "; ".join(f"{name}: {_short(old.get(name))} (store) != {_short(new.get(name))}"
                     for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name))


def _short(digest: object) -> str:
    return "absent" if digest is None else f"sha256 {str(digest)[:16]}..."

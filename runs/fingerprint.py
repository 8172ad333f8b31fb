"""What a run's weights are: the SHA-256 of every weight file of its checkpoint, so a store knows its weights.

The hub's own digest where the Hugging Face cache has one; otherwise the file is hashed once and the digest cached,
trusted only while the file's metadata and a content sample are unchanged. Tokenizer files are hashed whole. Details:
docs/store-format.md, "Root attribute detjac_store"."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from detjac.outputs import write_output
from detjac.safe_json import parse_json, read_json

# The files a checkpoint's weights are read from (the loaders prefer safetensors; .bin when there are none).
SAFETENSORS = ("*.safetensors", "*.safetensors.index.json")
PICKLES = ("*.bin", "*.bin.index.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")
CACHE_FILE = "weights-sha256.json"
# The files a tokenizer is read from (whichever a checkpoint folder has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
SAMPLE_HEAD, SAMPLE_BLOCK, SAMPLE_POINTS = 2**20, 4096, 256


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


def content_sample(path: Path) -> str:
    """SHA-256 of a fixed sample of a file's bytes (its first MiB, 4 KiB at 256 evenly spaced offsets, its last
    4 KiB and, for safetensors, the first and last 4 KiB of every tensor): what the digest cache checks before it
    trusts a cached digest. About 2 MiB read whatever the file's size."""
    size = path.stat().st_size
    spans = [(0, SAMPLE_HEAD), (max(0, size - SAMPLE_BLOCK), SAMPLE_BLOCK)]
    spans += [(i * size // SAMPLE_POINTS, SAMPLE_BLOCK) for i in range(SAMPLE_POINTS)]
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            spans += _tensor_spans(f, size)
        for start, length in sorted(set(spans)):
            f.seek(start)
            digest.update(f.read(length))
    return digest.hexdigest()


def _tensor_spans(f: object, size: int) -> list[tuple[int, int]]:
    """The first and last 4 KiB of every tensor of a safetensors file (none when its header is unreadable: the
    evenly spaced samples and the whole-file hash still stand)."""
    try:
        n = int.from_bytes(f.read(8), "little")  # type: ignore[attr-defined]
        header = parse_json(f.read(n)) if 0 < n <= min(size, 2**27) else {}  # type: ignore[attr-defined]
        ranges = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
        return [(8 + n + a + offset, SAMPLE_BLOCK) for a, b in ranges for offset in (0, max(0, b - a - SAMPLE_BLOCK))]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 4 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**22), b""):
            digest.update(chunk)
    return digest.hexdigest()


class DigestCache:
    """File digests by resolved path, used only while the file's size, inode, modification and status-change times
    are unchanged and its :func:`content_sample` hashes as it did."""

    def __init__(self, folder: Path | None = None) -> None:
        self.file = (folder or cache_dir()) / CACHE_FILE
        try:
            entries = read_json(self.file)
        except (OSError, ValueError):
            entries = {}
        self.entries: dict[str, dict[str, object]] = entries if isinstance(entries, dict) else {}
        self.hashed: list[Path] = []  # files read and hashed by this instance (the others came from the cache)

    @staticmethod
    def _stamp(path: Path) -> dict[str, object]:
        st = path.stat()
        return {"size": st.st_size, "inode": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}

    def sha256(self, path: Path) -> str:
        stamp, key = self._stamp(path), str(path.resolve())
        entry = self.entries.get(key)
        if (isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items())
                and entry.get("sample") == content_sample(path)):
            return str(entry["sha256"])
        digest = file_sha256(path)
        self.entries[key] = {**stamp, "sample": content_sample(path), "sha256": digest}
        self.hashed.append(path)
        return digest

    def save(self) -> None:
        """Write the cache (atomically: a temporary file renamed); a cache that cannot be written is skipped."""
        if not self.hashed:
            return
        with contextlib.suppress(OSError):
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_output(self.file, json.dumps(self.entries, indent=0, sort_keys=True))


def weights_fingerprint(folder: str | Path, cache: DigestCache | None = None) -> dict[str, str]:
    """``{file name: sha256}`` of a checkpoint folder's weight files (the hub's hash where the cache has one)."""
    cache = cache or DigestCache()
    out = {p.name: hub_blob_sha256(p) or cache.sha256(p) for p in weight_files(Path(folder))}
    cache.save()
    return out


def combined_digest(files: dict[str, str]) -> str:
    """One SHA-256 of the per-file digests (names and hashes, sorted): the ``weights_sha256`` of a run."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def tokenizer_fingerprint(folder: str | Path) -> dict[str, str]:
    """``{file name: sha256}`` of a checkpoint folder's tokenizer files (:data:`TOKENIZER_FILES`); none for a GGUF
    file (its tokenizer is in the file, covered by its weights digest)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {name: file_sha256(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}


def weights_identity(folder: str | Path | None) -> dict[str, object]:
    """The run description's ``weights`` (per file) and ``weights_sha256`` (identity) of a checkpoint folder or a
    GGUF file (and, for a GGUF, ``gguf_types``: its tensors' quantization types), with its ``tokenizer`` files
    and ``tokenizer_sha256`` (identity) where the folder has tokenizer files; nothing for a model that is
    neither."""
    if folder is None:
        return {}
    files = weights_fingerprint(folder)
    identity: dict[str, object] = {"weights": files, "weights_sha256": combined_digest(files)} if files else {}
    tokenizer = tokenizer_fingerprint(folder)
    if tokenizer:
        identity.update({"tokenizer": tokenizer, "tokenizer_sha256": combined_digest(tokenizer)})
    if Path(folder).is_file():
        from detjac.engine import read_gguf_header

        identity["gguf_types"] = read_gguf_header(Path(folder)).quantization_types()
    return identity


def weights_difference(stored: dict[str, object], wanted: dict[str, object], key: str = "weights") -> str | None:
    """The files (``key``: ``weights`` or ``tokenizer``) whose SHA-256 differs between a store's run and this one,
    as text; None when both runs fingerprinted the same files (or either did not)."""
    old, new = stored.get(key), wanted.get(key)
    if not isinstance(old, dict) or not isinstance(new, dict) or old == new:
        return None
    return "; ".join(f"{name}: {_short(old.get(name))} (store) != {_short(new.get(name))}"
                     for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name))


def _short(digest: object) -> str:
    return "absent" if digest is None else f"sha256 {str(digest)[:16]}..."


def model_identity(source: str | Path) -> dict[str, object]:
    """What a store's run would record of the model at ``source`` (a checkpoint folder or a GGUF file):
    ``config_sha256`` (of its ``config.json``, for a folder that has one), ``weights_sha256`` and
    ``tokenizer_sha256``; empty for anything else (a hub id not in the cache). Compared with a store's run by
    :func:`detjac.store.model_differences`."""
    path = Path(source)
    if not (path.is_dir() or path.is_file()):
        return {}
    identity = {k: v for k, v in weights_identity(path).items() if k in ("weights_sha256", "tokenizer_sha256")}
    if (path / "config.json").is_file():
        identity["config_sha256"] = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    return identity

"""Hub ids: a model named ``org/name`` found in the Hugging Face cache (or, online, downloaded into it).

The cache is looked in first, with no network; under ``HF_HUB_OFFLINE=1`` a model missing from it is an error naming
the command that fetches it (``hf download ID --revision R``). Details: docs/user-guide.md, "Models from the Hugging
Face hub"."""

from __future__ import annotations

import os
from pathlib import Path

from detjac.errors import CheckpointError
from detjac.revisions import cached_commit, check_inside

_TRUE = {"1", "ON", "YES", "TRUE"}

# What loading a model reads: config, tokenizer, safetensors weights (never pickles, never other formats).
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids the network."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def fetch_command(repo_id: str, revision: str | None = None) -> str:
    """The command that puts ``repo_id`` at ``revision`` into the cache."""
    return f"hf download {repo_id} --revision {revision or 'main'}"


def repo_folder(repo_id: str, cache: Path | None = None) -> Path:
    """The cache folder of a model repository: ``models--org--name``."""
    return (cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


def resolve_hub_id(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` (default ``main``): from the cache, else downloaded.

    Raises
    ------
    CheckpointError
        Not in the cache while offline, or the download failed (no such repository or revision,
        a gated model without access, no network). The message names the id, the revision, the
        cache folder and the command that fetches the model.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache, rev = hub_cache_dir(), revision or "main"
    cached_commit(repo_folder(repo_id, cache), repo_id, rev)  # never a path outside the cache (detjac.revisions)
    try:
        found = Path(snapshot_download(repo_id, revision=rev, cache_dir=cache, local_files_only=True,
                                       allow_patterns=DOWNLOAD_PATTERNS))
    except HFValidationError as exc:
        raise CheckpointError(f"Expected a checkpoint folder or a Hugging Face model id (org/name). Got "
                              f"{repo_id!r}: {exc}") from None
    except (LocalEntryNotFoundError, OSError) as exc:  # IncompleteSnapshotError is an OSError too
        cached_error: Exception = exc
    else:
        return check_inside(found, repo_folder(repo_id, cache), f"the snapshot of {repo_id} at {rev}")
    if hub_offline():
        raise _not_found(repo_id, rev, cache, "HF_HUB_OFFLINE is set, so nothing is downloaded") from cached_error
    try:
        return Path(snapshot_download(repo_id, revision=rev, cache_dir=cache, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as exc:  # the hub's many errors (HTTP, gated, not found, offline) all end here
        raise _not_found(repo_id, rev, cache, f"the download failed: {_reason(exc)}") from None


def resolve_hub_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """One file of ``repo_id`` at ``revision`` (a GGUF named by ``--gguf-file``): from the cache, else downloaded.

    Raises
    ------
    CheckpointError
        As :func:`resolve_hub_id`, naming the file too.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache, rev = hub_cache_dir(), revision or "main"
    cached_commit(repo_folder(repo_id, cache), repo_id, rev)  # never a path outside the cache (detjac.revisions)
    try:
        found = Path(hf_hub_download(repo_id, filename, revision=rev, cache_dir=cache, local_files_only=True))
    except HFValidationError as exc:
        raise CheckpointError(f"Expected a checkpoint folder or a Hugging Face model id (org/name). Got "
                              f"{repo_id!r}: {exc}") from None
    except (LocalEntryNotFoundError, OSError) as exc:
        cached_error: Exception = exc
    else:
        return check_inside(found, repo_folder(repo_id, cache), f"{filename} of {repo_id} at {rev}")
    if hub_offline():
        raise _not_found(repo_id, rev, cache, "HF_HUB_OFFLINE is set, so nothing is downloaded",
                         filename) from cached_error
    try:
        return Path(hf_hub_download(repo_id, filename, revision=rev, cache_dir=cache))
    except Exception as exc:  # the hub's many errors (HTTP, gated, not found, offline) all end here
        raise _not_found(repo_id, rev, cache, f"the download failed: {_reason(exc)}", filename) from None


def _reason(exc: Exception) -> str:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):
        return "the model is gated: accept its terms on huggingface.co and set HF_TOKEN (or run `hf auth login`)"
    if isinstance(exc, RevisionNotFoundError):
        return "the hub has no such revision"
    if isinstance(exc, RepositoryNotFoundError):
        return "the hub has no such repository, or it is private (set HF_TOKEN)"
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''}".rstrip(": ")


def _not_found(repo_id: str, revision: str, cache: Path, why: str, filename: str | None = None) -> CheckpointError:
    folder = repo_folder(repo_id, cache)
    where = f"{folder}" if folder.is_dir() else f"{cache} (it has no {folder.name})"
    local = f" There is no local folder {repo_id!r} either." if "/" in repo_id else ""
    what = f"file {filename}" if filename else "complete snapshot"
    fetch = fetch_command(repo_id, revision).replace(f" {repo_id} ", f" {repo_id} {filename} ") if filename \
        else fetch_command(repo_id, revision)
    return CheckpointError(
        f"Expected the Hugging Face model {repo_id!r} at revision {revision!r} in the cache {where}. Got no "
        f"{what} there, and {why}.{local} Fetch it with:\n  {fetch}\n"
        "(the cache is HF_HUB_CACHE, else $HF_HOME/hub; a gated model needs HF_TOKEN)."
    )

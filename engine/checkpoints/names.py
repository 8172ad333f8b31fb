"""What a MODEL argument names: the shipped model (``"default"``), a GGUF file inside a folder or hub repository
(``--gguf-file``), or itself (a folder, a file, a hub id). The shipped model is described in
:mod:`detjac.engine.checkpoints.default`."""

from __future__ import annotations

from pathlib import Path

from detjac.errors import CheckpointError

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "gcide-llama"


def default_model_dir() -> Path:
    """Folder of the shipped checkpoint; raises CheckpointError if the package lacks it."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise CheckpointError(f"Expected the default model at {DEFAULT_MODEL_DIR}. Got no model.safetensors there; "
                              "reinstall detjac or rebuild it with scripts/train_default_model.py.")
    return DEFAULT_MODEL_DIR


def resolve_model(source: str | Path, gguf_file: str | None = None, revision: str | None = None) -> str | Path:
    """``"default"`` names the shipped model (unless a folder of that name exists); with ``gguf_file``, the GGUF
    file of that name inside the folder or hub id ``source`` (see
    :func:`detjac.engine.checkpoints.gguf.select_gguf`); else unchanged."""
    if gguf_file is not None:
        from .gguf import select_gguf

        return select_gguf(source, gguf_file, revision)
    if str(source) == DEFAULT_MODEL_NAME and not Path(source).exists():
        return default_model_dir()
    return source


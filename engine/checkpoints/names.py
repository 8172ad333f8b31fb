"""Where the shipped model (``"default"``) is. What a MODEL argument names is decided in
:func:`detjac.model_names.model_kind`, once, by :meth:`~detjac.engine.ModelRef.resolve`; the shipped model is
described in :mod:`detjac.engine.checkpoints.default`."""

from __future__ import annotations

from pathlib import Path

from detjac.errors import CheckpointError
from detjac.model_names import DEFAULT_MODEL_NAME  # noqa: F401  (re-exported by .default)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "gcide-llama"


def default_model_dir() -> Path:
    """Folder of the shipped checkpoint; raises CheckpointError if the package lacks it."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise CheckpointError(f"Expected the default model at {DEFAULT_MODEL_DIR}. Got no model.safetensors there; "
                              "reinstall detjac or rebuild it with scripts/train_default_model.py.")
    return DEFAULT_MODEL_DIR

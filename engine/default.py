"""The default model shipped with detjac: a small Llama trained on the GCIDE dictionary.

Trained by ``scripts/train_default_model.py``; the model card is ``assets/gcide-llama/README.md``.
It lets ``make demo`` and the tests run on a real trained model with no download.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError
from .loading import load_model

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "gcide-llama"

# Dictionary-style prompts, the register the model was trained on.
DEMO_PROMPTS = (
    "Bread, n. An article of food made from flour or meal by",
    "Oak, n. (Bot.) Any tree or shrub of the genus Quercus. The oaks have",
    "Whale, n. (Zool.) Any aquatic mammal of the order",
)


def default_model_dir() -> Path:
    """Folder of the shipped checkpoint; raises CheckpointError if the package lacks it."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        raise CheckpointError(f"Expected the default model at {DEFAULT_MODEL_DIR}. Got no model.safetensors there; "
                              "reinstall detjac or rebuild it with scripts/train_default_model.py.")
    return DEFAULT_MODEL_DIR


def resolve_model(source: str | Path, gguf_file: str | None = None, revision: str | None = None) -> str | Path:
    """``"default"`` names the shipped model (unless a folder of that name exists); with ``gguf_file``, the GGUF
    file of that name inside the folder or hub id ``source`` (see :func:`detjac.engine.gguf.select_gguf`); else
    unchanged."""
    if gguf_file is not None:
        from .gguf import select_gguf

        return select_gguf(source, gguf_file, revision)
    if str(source) == DEFAULT_MODEL_NAME and not Path(source).exists():
        return default_model_dir()
    return source


def load_default_model(dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Load the shipped model (and its tokenizer, see ``get_tokenizer``) with ``load_model``."""
    return load_model(default_model_dir(), dtype=dtype, device=device)

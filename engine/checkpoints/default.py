"""The default model shipped with detjac: a small Llama trained on the GCIDE dictionary.

Trained by ``scripts/train_default_model.py`` from the recipe in ``scripts/gcide.py``; the model card is
``assets/gcide-llama/README.md``.
It lets ``make demo`` and the tests run on a real trained model with no download.
"""

from __future__ import annotations

from .names import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, default_model_dir
from .reference import resolve_model

__all__ = ["DEFAULT_MODEL_DIR", "DEFAULT_MODEL_NAME", "default_model_dir", "resolve_model"]

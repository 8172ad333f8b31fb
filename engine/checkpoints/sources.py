"""Which weight source a model gets: a loaded model's own tensors, a GGUF file, or a folder's safetensors."""

from __future__ import annotations

from typing import Any

from torch import nn

from .gguf import GGUFWeights, is_gguf
from .weights import ModuleWeights, SafetensorsWeights, WeightSource


def open_source(source: Any, config: dict[str, Any] | None = None, model_config: Any = None) -> WeightSource:
    """A :class:`~detjac.engine.checkpoints.weights.WeightSource` for a loaded model, a GGUF file (``model_config``, its
    transformers config, maps its tensor names) or a checkpoint folder (``config``, its config.json, says whether
    it is quantized)."""
    if isinstance(source, nn.Module):
        return ModuleWeights(source)
    if is_gguf(source):
        return GGUFWeights.for_config(source, model_config)
    return SafetensorsWeights(source, config)
